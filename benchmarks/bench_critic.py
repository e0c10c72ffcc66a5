#!/usr/bin/env python
"""Which critic reaches a target reward first in wall-clock: updates-to-target on the tiny task (many
seeds) times seconds per update at the 0.5B shape, per ``value.kind``.

    python benchmarks/bench_critic.py curves --seeds 0-19 --updates 20,36 --jobs 3   # tiny reward curves, LoRA and full
    python benchmarks/bench_critic.py timing --layers 6 --updates 3                  # CPU s/update per kind, 0.5B widths
    python benchmarks/bench_critic.py report [--target 5.0]                           # the tables

The target (defined before any run): the 3-update moving average of ``objective/scores`` (the reward
model's score minus the missing-EOS penalty, before the KL penalty) reaches +5.0; the tiny task's
plateau is about +5.8 (docs/benchmarks.md). A seed's updates-to-target is the last update of the
first window whose mean reaches it; a seed that never does is censored at the run's length.
Every seed's censoring time is the same (the run length), so the Kaplan-Meier median is the plain
median with censored seeds sorted last ("> N" when half or more are censored); the restricted mean
counts a censored seed as N updates (a lower bound on its true mean).

Runs use benchmarks/bench_vs_trl.py's recipe, models and prompts. The curves use one torch thread per
run, in ``--jobs`` worker processes (curves are deterministic per seed; machine speed does not
change them). The timing records CPU seconds per update on one thread, which a shared machine's
load changes far less than wall-clock. Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_vs_trl", ROOT / "benchmarks" / "bench_vs_trl.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

CURVES = bench.RESULTS / "critic-curves.jsonl"
TIMING = bench.RESULTS / "critic-timing.jsonl"
KINDS = {  # the critic kinds that apply per mode (an adapter needs LoRA)
    "lora": ("head", "adapter", "model", "model-reward", "model-reward-frozen"),
    "full": ("head", "model", "model-reward", "model-reward-frozen"),
}
LR = {"lora": 1e-3, "full": 1e-4}  # the demo's LoRA rate (recipes/tiny_sentiment.yaml); the bench's full rate
TARGET, WINDOW = 5.0, 3


def updates_to_target(scores: list[float], target: float = TARGET, window: int = WINDOW) -> int | None:
    """1-based update at which the mean of the last ``window`` scores first reaches ``target``; None if never."""
    for end in range(window, len(scores) + 1):
        if statistics.fmean(scores[end - window:end]) >= target:
            return end
    return None


def censored_median(times: list[int | None], length: int) -> str:
    """Median with censored (None) values sorted after every observed one (common censoring time)."""
    ranked = sorted(t if t is not None else float("inf") for t in times)
    n = len(ranked)
    mid = (ranked[(n - 1) // 2] + ranked[n // 2]) / 2
    return f"> {length}" if mid == float("inf") else f"{mid:g}"


def bootstrap_ratio(times: list, cost: float, best_times: list, best_cost: float, draws: int = 2000) -> tuple[float, float]:
    """95% interval of (median updates-to-target x cost) over the best kind's, resampling each kind's seeds."""
    import random

    rng = random.Random(0)
    ratios = sorted(
        median_value(rng.choices(times, k=len(times))) * cost / (median_value(rng.choices(best_times, k=len(best_times))) * best_cost)
        for _ in range(draws))
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def median_value(times: list[int | None]) -> float:
    ranked = sorted(t if t is not None else float("inf") for t in times)
    return (ranked[(len(ranked) - 1) // 2] + ranked[len(ranked) // 2]) / 2


def _seeds(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def cmd_curves(args) -> None:
    """Split the runs over ``--jobs`` worker processes, each importing ppo_cli once and running its share
    one after another (a fresh process per tiny run spends most of its time importing and loading)."""
    updates = dict(zip(("lora", "full"), (int(n) for n in args.updates.split(","))))
    done = {("lora" if r["cfg"]["lora"] else "full", r["cfg"]["value_kind"], r["cfg"]["seed"])
            for r in bench._load(CURVES)
            if len(r["scores"]) >= updates["lora" if r["cfg"]["lora"] else "full"]}  # a longer run holds a shorter one
    jobs = []
    for seed in _seeds(args.seeds):  # seed-major: stopped early, every kind has about as many seeds
        for mode in args.modes.split(","):
            for kind in (args.kinds.split(",") if args.kinds else KINDS[mode]):
                if kind not in KINDS[mode] or (mode, kind, seed) in done:
                    continue
                ns = argparse.Namespace(shape="tiny", updates=updates[mode])
                cfg = bench.bench_config(ns, lora=(mode == "lora"), value_kind=kind, seed=seed, lr=LR[mode], threads=1)
                jobs.append((cfg, f"critic-{mode}-{kind}-s{seed}"))
    run_in_workers(jobs, args.jobs, __file__, "critic")


def run_in_workers(jobs: list, count: int, script: str, prefix: str) -> None:
    """Deal ``jobs`` round-robin to ``count`` processes of ``script worker SHARE``; wait for all of them."""
    import subprocess

    print(f"{len(jobs)} runs in {count} worker processes", flush=True)
    workers = []
    for i in range(count):
        share = bench.CACHE / "recipes" / f"{prefix}-worker-{i}.json"
        share.parent.mkdir(parents=True, exist_ok=True)
        share.write_text(json.dumps(jobs[i::count]))
        workers.append(subprocess.Popen([sys.executable, script, "worker", str(share)], env=bench.env(), cwd=ROOT))
    failed = [w.args for w in workers if w.wait() != 0]
    if failed:
        raise SystemExit(f"worker(s) failed: {failed}")


def cmd_worker(args) -> None:
    """Run a share of the curve runs in this process (ppo train's own entry point, one after another)."""
    import time

    import yaml

    from ppo_cli.commands.train import run
    from ppo_cli.recipe_loading import load_recipe

    for cfg, tag in json.loads(Path(args.share).read_text()):
        name = f"bench-{tag}"
        path = bench.CACHE / "recipes" / f"{name}.yaml"
        path.write_text(yaml.safe_dump(bench.ours_recipe(cfg, name), sort_keys=False))
        started = time.perf_counter()
        result = run(load_recipe(path), recipe_path=path, overwrite=True)
        metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        out = {"impl": "ours", "command": f"ppo train {path} --overwrite",
               "seconds_per_update": [m["time/step_s"] for m in metrics],
               "scores": [m["objective/scores"] for m in metrics], "kl": [m["objective/kl"] for m in metrics],
               "peak_memory_gb": None, "wall_s": time.perf_counter() - started}
        bench.record(out, cfg, "critic-curve", CURVES)  # one short line appended: safe beside the other worker
        print(f"{tag}: to target {updates_to_target(out['scores'])}, {out['wall_s']:.1f} s", flush=True)


def shallow_models(layers: int) -> str:
    """The 0.5B shape's widths with fewer layers (seeded random weights, as bench_vs_trl's 0.5b): a
    shape whose per-kind cost ratios follow the 0.5B shape's at a fraction of its time. Returns the shape name."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    shape = f"0.5b-{layers}l"
    paths = bench.shape_paths(shape)
    if (paths["reward"] / "config.json").exists():
        return shape
    tokenizer = AutoTokenizer.from_pretrained(bench.shape_paths("0.5b")["policy"])
    config = Qwen2Config(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, **{**bench.QWEN_05B, "num_hidden_layers": layers})
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(paths["policy"])
    tokenizer.save_pretrained(paths["policy"])
    torch.manual_seed(1)
    config.num_labels = 1
    Qwen2ForSequenceClassification(config).save_pretrained(paths["reward"])
    tokenizer.save_pretrained(paths["reward"])
    return shape


def cmd_timing(args) -> None:
    """Every kind back to back, the order reversed every round (and between modes), each in a fresh
    process (``cputime``) that records the CPU seconds of every update: on one thread these do not
    depend on what else the machine runs, where wall-clock on shared cores does."""
    import subprocess

    shape = "0.5b" if args.layers == 24 else shallow_models(args.layers)
    for round_ in range(args.rounds):
        for m, mode in enumerate(args.modes.split(",")):
            kinds = [k for k in KINDS[mode] if not args.kinds or f"{mode}:{k}" in args.kinds.split(",")]
            if (round_ + m) % 2:
                kinds.reverse()
            for kind in kinds:
                ns = argparse.Namespace(shape=shape, updates=args.updates)
                cfg = bench.bench_config(ns, lora=(mode == "lora"), value_kind=kind, seed=round_, threads=args.threads)
                share = bench.CACHE / "recipes" / f"critic-timing-{shape}-{mode}-{kind}.json"
                share.parent.mkdir(parents=True, exist_ok=True)
                share.write_text(json.dumps([cfg, f"critic-{shape}-{mode}-{kind}-r{round_}"]))
                print(f"[round {round_}] {shape} {mode} {kind} (load {bench.load_average():.2f})", flush=True)
                subprocess.run([sys.executable, __file__, "cputime", str(share)], env=bench.env(), cwd=ROOT,
                               check=True, stdout=subprocess.DEVNULL)


def cmd_cputime(args) -> None:
    """One timing run in this process: wall and CPU seconds of each update (trainer.train_step)."""
    import time

    import yaml

    from ppo_cli import trainer
    from ppo_cli.commands.train import peak_memory_gb, run
    from ppo_cli.recipe_loading import load_recipe

    cfg, tag = json.loads(Path(args.share).read_text())
    cpu, wall, loads = [], [], []
    step = trainer.train_step

    def timed_step(state):
        w, c = time.perf_counter(), time.process_time()
        out = step(state)
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
        loads.append(bench.load_average())
        return out

    trainer.train_step = timed_step  # train() looks it up at every update
    name = f"bench-{tag}"
    path = bench.CACHE / "recipes" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(bench.ours_recipe(cfg, name), sort_keys=False))
    run(load_recipe(path), recipe_path=path, overwrite=True)
    result = {"impl": "ours", "command": f"ppo train {path} --overwrite", "seconds_per_update": wall,
              "cpu_seconds_per_update": cpu, "load_per_update": loads, "scores": [], "peak_memory_gb": peak_memory_gb()}
    bench.record(result, cfg, "critic-timing", TIMING)
    print(f"{tag}: cpu s/update {[round(c, 1) for c in cpu]}, wall {[round(w, 1) for w in wall]}, "
          f"peak {result['peak_memory_gb']:.2f} GB", file=sys.stderr, flush=True)


def cmd_report(args) -> None:
    latest = {}
    for r in bench._load(CURVES):
        c = r["cfg"]
        latest["lora" if c["lora"] else "full", c["value_kind"], c["seed"]] = r
    timing: dict[tuple[str, str], list[dict]] = {}
    for r in bench._load(TIMING):
        if r["cfg"]["shape"] == args.timing_shape and "cpu_seconds_per_update" in r:
            timing.setdefault(("lora" if r["cfg"]["lora"] else "full", r["cfg"]["value_kind"]), []).append(r)
    print(f"target: {WINDOW}-update mean of objective/scores >= {args.target:+g}; cost: CPU seconds per update "
          f"(1 thread, median after the first update) at shape {args.timing_shape}\n")
    print("| mode | critic (bench name) | seeds | updates | reached | median updates-to-target | restricted mean "
          "| CPU s/update | CPU time to target (median) | x best (95% bootstrap) | peak GB | score, all updates | last 5 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for mode in ("lora", "full"):
        for kind in KINDS[mode]:
            runs = [r for k, r in sorted(latest.items()) if k[:2] == (mode, kind)]
            if not runs:
                continue
            n = min(len(r["scores"]) for r in runs)
            times = [updates_to_target(r["scores"][:n], args.target) for r in runs]
            reached = sum(t is not None for t in times)
            rmean = statistics.fmean(t if t is not None else n for t in times)
            sel = timing.get((mode, kind), [])
            spu = peak = cost = None
            if sel:
                spu = statistics.median(c for r in sel for c in r["cpu_seconds_per_update"][1:])
                peak = statistics.median(r["peak_memory_gb"] for r in sel)
                med = median_value(times)
                cost = None if med == float("inf") else med * spu
            all_ = statistics.fmean(statistics.fmean(r["scores"][:n]) for r in runs)
            last = statistics.fmean(statistics.fmean(r["scores"][n - 5:n]) for r in runs)
            rows.append((mode, kind, len(runs), n, reached, censored_median(times, n), rmean, spu, cost, peak, all_, last,
                         times))
    best = {mode: min((r[8] for r in rows if r[0] == mode and r[8] is not None), default=None) for mode in ("lora", "full")}
    winner = {r[0]: r for r in rows if r[8] is not None and r[8] == best[r[0]]}
    for mode, kind, seeds, n, reached, med, rmean, spu, cost, peak, all_, last, times in rows:
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        ratio = f"{cost / best[mode]:.2f}" if cost is not None and best[mode] else "-"
        if cost is not None and winner.get(mode) and winner[mode][1] != kind:
            w = winner[mode]
            low, high = bootstrap_ratio(times, spu, w[12], w[7])
            ratio += f" ({low:.2f}-{high:.2f})"
        print(f"| {mode} | {kind} | {seeds} | {n} | {reached}/{seeds} | {med} | {rmean:.1f} | {fmt(spu, '.2f')} | "
              f"{'-' if cost is None else f'{cost / 60:.1f} min'} | {ratio} | {fmt(peak, '.2f')} | {all_:+.2f} | {last:+.2f} |")
    if timing:
        print(f"\nTiming runs at {args.timing_shape} (per update: CPU s, wall s, 1-minute load average):\n")
        for (mode, kind), sel in timing.items():
            for r in sel:
                per = ", ".join(f"{c:.1f}/{w:.1f}/{ld:.1f}" for c, w, ld in
                                zip(r["cpu_seconds_per_update"], r["seconds_per_update"], r["load_per_update"]))
                print(f"- {r['time']} {mode} {kind}: {per}; peak {r['peak_memory_gb']:.2f} GB")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("curves")
    p.add_argument("--modes", default="lora,full")
    p.add_argument("--kinds", default=None, help="comma-separated; default: every kind that applies")
    p.add_argument("--seeds", default="0-19", help="e.g. 0-19")
    p.add_argument("--updates", default="20,30", help="updates per run: LoRA,full")
    p.add_argument("--jobs", type=int, default=2)
    p = sub.add_parser("worker")
    p.add_argument("share", help="a JSON list of [cfg, tag] written by curves")
    p = sub.add_parser("timing")
    p.add_argument("--modes", default="lora,full")
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--layers", type=int, default=24, help="24: the 0.5B shape; fewer: its widths at that depth")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run (1: CPU time is load-independent)")
    p.add_argument("--kinds", default=None, help="e.g. lora:head,full:model (default: every kind of every mode)")
    p = sub.add_parser("cputime")
    p.add_argument("share", help="a JSON [cfg, tag] written by timing")
    p = sub.add_parser("report")
    p.add_argument("--target", type=float, default=TARGET)
    p.add_argument("--timing-shape", default="0.5b-6l", help="the shape whose timing runs price an update")
    args = ap.parse_args(argv)
    from ppo_cli.engine.precision_probe import machine_record

    print(f"machine: {machine_record()}", flush=True)  # every figure below was measured on it
    {"curves": cmd_curves, "worker": cmd_worker, "timing": cmd_timing, "cputime": cmd_cputime, "report": cmd_report}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
