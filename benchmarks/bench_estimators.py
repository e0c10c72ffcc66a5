#!/usr/bin/env python
"""Does the critic earn its memory? PPO with each critic kind against the critic-free estimators (GRPO,
Dr. GRPO, RLOO, REINFORCE++) on the tiny task, at equal episodes per update: updates-to-target and
wall-clock-to-target over many seeds, and peak memory per estimator.

    python benchmarks/bench_estimators.py curves --seeds 0-9 --updates 20 --jobs 2   # tiny reward curves, every arm
    python benchmarks/bench_estimators.py memory --shape tiny --updates 3            # peak memory, a fresh process per arm
    python benchmarks/bench_estimators.py memory --shape 0.5b-6l --updates 2         # the same at the 0.5B widths, 6 layers
    python benchmarks/bench_estimators.py trl --shape tiny --updates 8 --rounds 2    # grpo against TRL's GRPOTrainer
    python benchmarks/bench_estimators.py trl --shape smollm2 --updates 3 --rounds 1 # the same on the real SmolLM2
    python benchmarks/bench_estimators.py report [--target 5.0]                      # the tables

Every arm gets 8 episodes per update: PPO 8 prompts x 1 completion; the group estimators 2 prompts x 4
completions (``--group``), one mini-batch of 8 episodes, 4 epochs, LoRA at lr 1e-3, kl_coef 0.05, 24
tokens (bench_critic.py's LoRA settings, its target and its censoring rules). Where each estimator puts
the KL is its default (grpo: the k3 term in the loss; the others: in the reward). ``reinforce-pp-g1`` is
REINFORCE++ proper (8 prompts x 1); ``reinforce-pp`` with groups is REINFORCE++-baseline.

Wall-clock to the target is the sum of the wall seconds of the updates up to it, and CPU-to-target the
same in CPU seconds (one torch thread per run; ``--jobs`` workers run their arms interleaved, so on a
shared machine every arm sees the same load; report their ratios, not their seconds). Memory is the
resident peak of a fresh process per arm (loading included). Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


critic = _load_module("bench_critic")
bench = critic.bench

CURVES = bench.RESULTS / "estimator-curves.jsonl"
MEMORY = bench.RESULTS / "estimator-memory.jsonl"
TRL = bench.RESULTS / "estimator-trl.jsonl"
EPISODES = 8  # per update, every arm
LR = 1e-3  # the demo's LoRA rate
# arm -> (ppo.advantage, value kind, extra ppo keys)
ARMS = {
    "ppo-head": ("gae", "head", {}),
    "ppo-adapter": ("gae", "adapter", {}),
    "ppo-model": ("gae", "model", {}),
    "ppo-model-reward": ("gae", "model-reward", {}),
    "ppo-model-reward-frozen": ("gae", "model-reward-frozen", {}),
    "grpo": ("grpo", "none", {}),
    "dr-grpo": ("grpo", "none", {"scale_rewards": "none", "loss_aggregation": "seq_mean_token_sum_norm"}),
    "rloo": ("rloo", "none", {}),
    "reinforce-pp": ("reinforce_pp", "none", {}),
    "reinforce-pp-g1": ("reinforce_pp", "none", {}),
}


def group_size(arm: str, group: int) -> int:
    return 1 if ARMS[arm][0] == "gae" or arm.endswith("-g1") else group


def arm_config(arm: str, seed: int, updates: int, group: int, shape: str = "tiny") -> dict:
    ns = argparse.Namespace(shape=shape, updates=updates)
    return bench.bench_config(ns, lora=True, value_kind=ARMS[arm][1], seed=seed, lr=LR, threads=1,
                              arm=arm, num_generations=group_size(arm, group))


def arm_recipe(cfg: dict, name: str) -> dict:
    """bench_vs_trl's recipe with the arm's estimator: EPISODES episodes per update in one mini-batch."""
    advantage, kind, extra = ARMS[cfg["arm"]]
    recipe = bench.ours_recipe(cfg, name)
    G = cfg["num_generations"]
    recipe["generation"]["num_generations"] = G
    recipe["ppo"].update(rollout_batch_size=EPISODES // G, mini_batch_size=EPISODES, micro_batch_size=EPISODES,
                         advantage=advantage, **extra)
    if advantage != "gae":
        recipe["value"] = {"kind": "none"}
        for key in ("vf_coef", "cliprange_value", "gae_lambda", "whiten_rewards", "whiten_advantages"):
            recipe["ppo"].pop(key)  # gae's keys (at their defaults here): left to the estimator
    return recipe


def _write_recipe(cfg: dict, tag: str) -> Path:
    import yaml

    name = f"bench-{tag}"
    path = bench.CACHE / "recipes" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(arm_recipe(cfg, name), sort_keys=False))
    return path


def _timed_train(path: Path) -> dict:
    """ppo train's own entry point, with the wall and CPU seconds of every update (trainer.train_step)."""
    import time

    from ppo_cli import trainer
    from ppo_cli.commands.train import run
    from ppo_cli.recipe_loading import load_recipe

    cpu, wall = [], []
    step = trainer.train_step

    def timed_step(state):
        w, c = time.perf_counter(), time.process_time()
        out = step(state)
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
        return out

    trainer.train_step = timed_step  # train() looks it up at every update
    try:
        started = time.perf_counter()
        result = run(load_recipe(path), recipe_path=path, overwrite=True)
    finally:
        trainer.train_step = step
    metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"impl": "ours", "command": f"ppo train {path} --overwrite", "seconds_per_update": wall,
            "cpu_seconds_per_update": cpu, "scores": [m["objective/scores"] for m in metrics],
            "kl": [m["objective/kl"] for m in metrics],
            "rollout_seconds": [m["time/rollout_s"] for m in metrics],
            "memory_peaks_gb": [{k: v for k, v in m.items() if k.startswith("memory/")} for m in metrics],
            "frac_reward_zero_std": [m.get("frac_reward_zero_std") for m in metrics],
            "wall_s": time.perf_counter() - started, "run_dir": str(result.run_dir)}


def cmd_curves(args) -> None:
    """Split the runs over ``--jobs`` worker processes, seed-major and arm-interleaved, so that every arm
    runs under about the same machine load and a sweep stopped early has about as many seeds per arm."""
    arms = args.arms.split(",") if args.arms else list(ARMS)
    done = {(r["cfg"]["arm"], r["cfg"]["seed"]) for r in bench._load(CURVES)
            if len(r["scores"]) >= args.updates and r["cfg"]["num_generations"] == group_size(r["cfg"]["arm"], args.group)}
    jobs = [(arm_config(arm, seed, args.updates, args.group), f"est-{arm}-g{group_size(arm, args.group)}-s{seed}")
            for seed in critic._seeds(args.seeds) for arm in arms if (arm, seed) not in done]
    critic.run_in_workers(jobs, args.jobs, __file__, "estimator")


def cmd_worker(args) -> None:
    for cfg, tag in json.loads(Path(args.share).read_text()):
        out = _timed_train(_write_recipe(cfg, tag))
        bench.record(out, cfg, "estimator-curve", CURVES)  # one short line appended: safe beside the other worker
        print(f"{tag}: to target {critic.updates_to_target(out['scores'])}, {out['wall_s']:.1f} s", flush=True)


def resolve_shape(shape: str) -> str:
    """tiny, 0.5b and smollm2 (the real SmolLM2-135M-Instruct) as bench_vs_trl.py builds them; 0.5b-<N>l
    built here on first use (bench_critic.py)."""
    return shape if shape in ("tiny", "0.5b", "smollm2") else critic.shallow_models(int(shape.split("-")[1][:-1]))


def cmd_memory(args) -> None:
    """Every arm in a fresh process (``single``), the order reversed every round."""
    import subprocess

    shape = resolve_shape(args.shape)
    arms = args.arms.split(",") if args.arms else [a for a in ARMS if a != "reinforce-pp-g1"]
    for round_ in range(args.rounds):
        for arm in (reversed(arms) if round_ % 2 else arms):
            cfg = arm_config(arm, round_, args.updates, args.group, shape)
            share = bench.CACHE / "recipes" / f"estimator-memory-{shape}-{arm}.json"
            share.parent.mkdir(parents=True, exist_ok=True)
            share.write_text(json.dumps([cfg, f"est-mem-{shape}-{arm}-r{round_}", str(MEMORY)]))
            print(f"[round {round_}] {shape} {arm} (load {bench.load_average():.2f})", flush=True)
            subprocess.run([sys.executable, __file__, "single", str(share)], env=bench.env(), cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL)


def cmd_single(args) -> None:
    from ppo_cli.commands.train import peak_memory_gb

    cfg, tag, results = json.loads(Path(args.share).read_text())
    out = _timed_train(_write_recipe(cfg, tag))
    out["peak_memory_gb"] = peak_memory_gb()
    bench.record(out, cfg, "estimator-single", Path(results))
    print(f"{tag}: peak {out['peak_memory_gb']:.2f} GB, cpu s/update {[round(c, 2) for c in out['cpu_seconds_per_update']]}",
          file=sys.stderr, flush=True)


def run_trl_grpo(cfg: dict, tag: str) -> dict:
    """One TRL GRPOTrainer run (benchmarks/bench_trl_grpo_driver.py in TRL's venv) at the arm's settings."""
    paths = bench.shape_paths(cfg["shape"])
    out = bench.CACHE / "trl-out" / f"{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    G = cfg["num_generations"]
    command = [str(bench.TRL_VENV / "bin" / "python"), str(ROOT / "benchmarks" / "bench_trl_grpo_driver.py"),
               "--policy", str(paths["policy"]), "--reward", str(paths["reward"]), "--prompts", str(paths["prompts"]),
               "--lora", "--updates", str(cfg["updates"]), "--prompts-per-update", str(EPISODES // G),
               "--num-generations", str(G), "--epochs", str(cfg["epochs"]), "--response-length", str(cfg["response_length"]),
               "--temperature", str(cfg["temperature"]), "--kl-coef", str(cfg["kl_coef"]), "--lr", str(cfg["lr"]),
               "--seed", str(cfg["seed"]), "--threads", str(cfg["threads"]), "--device", cfg.get("device", "cpu"),
               "--out", str(out)]
    if cfg["missing_eos_penalty"] is not None:
        command += ["--missing-eos-penalty", str(cfg["missing_eos_penalty"])]
    if cfg["precision"] == "native":
        command.append("--defaults")
    return bench.run_trl_driver(command, out)


def cmd_trl(args) -> None:
    """Rounds of ppo_cli's grpo arm and TRL's GRPOTrainer at the same settings, each a fresh process
    (``single`` for ours), the order flipped every round so that the machine's load hits both."""
    import subprocess

    shape = resolve_shape(args.shape)
    for round_ in range(args.rounds):
        cfg = arm_config("grpo", round_, args.updates, args.group, shape)
        cfg.update(threads=args.threads, precision=args.precision, device=args.device)
        for impl in (("ours", "trl") if round_ % 2 == 0 else ("trl", "ours")):
            tag = f"est-trl-{shape}-{args.precision}-{args.device}-{impl}-r{round_}"
            print(f"[round {round_}] {impl} (load {bench.load_average():.2f})", flush=True)
            if impl == "trl":
                bench.record(run_trl_grpo(cfg, tag), cfg, "estimator-trl", TRL)
            else:
                share = bench.CACHE / "recipes" / f"{tag}.json"
                share.parent.mkdir(parents=True, exist_ok=True)
                share.write_text(json.dumps([cfg, tag, str(TRL)]))
                subprocess.run([sys.executable, __file__, "single", str(share)], env=bench.env(), cwd=ROOT, check=True,
                               stdout=subprocess.DEVNULL)


def trl_report(warmup: int = 1) -> None:
    by_impl: dict[tuple[str, str], list[dict]] = {}
    for r in bench._load(TRL):
        key = f"{r['cfg']['shape']}, {r['cfg']['precision']}" + (", cuda" if r["cfg"].get("device") == "cuda" else "")
        by_impl.setdefault((key, r["impl"]), []).append(r)
    for shape in sorted({s for s, _ in by_impl}):
        print(f"\nppo_cli grpo against TRL GRPOTrainer, shape and precision {shape} (median s/update after {warmup} "
              "warm-up update, contended: read the ratio):\n")
        print("| impl | runs x updates | s/update | CPU s/update | peak GB | mean score/update |")
        print("|---|---|---|---|---|---|")
        med = {}
        for impl in ("trl", "ours"):
            runs = by_impl.get((shape, impl), [])
            if not runs:
                continue
            spu = statistics.median(s for r in runs for s in r["seconds_per_update"][warmup:])
            cpu = statistics.median(s for r in runs for s in r["cpu_seconds_per_update"][warmup:])
            peak = statistics.median(r["peak_memory_gb"] for r in runs)
            score = statistics.fmean(statistics.fmean(r["scores"]) for r in runs)
            med[impl] = (spu, cpu, peak)
            name = f"TRL {runs[0].get('trl_version', '')}" if impl == "trl" else "ppo_cli"
            print(f"| {name} | {len(runs)} x {len(runs[0]['seconds_per_update'])} | {spu:.2f} | {cpu:.3f} | {peak:.2f} | {score:+.2f} |")
        if len(med) == 2:
            (w, c, m), (tw, tc, tm) = med["ours"], med["trl"]
            print(f"\nours/TRL: wall time per update {w / tw:.2f}, CPU time per update {c / tc:.2f}, peak memory {m / tm:.2f}")


def _shape_cells(shape, arm, row, ref, memory, cost) -> str:
    """Peak GB and CPU s/update of the arm's runs at ``shape``, and the tiny task's median updates-to-target
    priced at that cost, over the reference arm's (bench_critic.py's estimate of time to target at a real width)."""
    if (shape, arm) not in memory:
        return " - | - | - |"
    spu = statistics.median(cost[shape, arm])
    cells = f" {statistics.median(memory[shape, arm]):.2f} | {spu:.2f} |"
    med, ref_med = critic.median_value(row["times"]), ref and critic.median_value(ref["times"])
    if not ref or (shape, ref["arm"]) not in cost or med == float("inf"):
        return cells + " - |"
    return cells + f" {med * spu / (ref_med * statistics.median(cost[shape, ref['arm']])):.2f} |"


def _to_target(per_update: list[float], t: int | None) -> float | None:
    return None if t is None else sum(per_update[:t])


def _median_censored(values: list[float | None]) -> float:
    return critic.median_value(values)  # None ranks last: a median of inf means half or more never got there


def cmd_report(args) -> None:
    latest = {}
    for r in bench._load(CURVES):
        if r["cfg"]["updates"] >= args.updates:
            latest[r["cfg"]["arm"], r["cfg"]["seed"]] = r
    memory: dict[tuple[str, str], list[float]] = {}
    cost: dict[tuple[str, str], list[float]] = {}  # CPU s per update after the first, in the memory runs
    for r in bench._load(MEMORY):
        memory.setdefault((r["cfg"]["shape"], r["cfg"]["arm"]), []).append(r["peak_memory_gb"])
        cost.setdefault((r["cfg"]["shape"], r["cfg"]["arm"]), []).extend(r["cpu_seconds_per_update"][1:])
    shapes = sorted({s for s, _ in memory})
    n = args.updates
    print(f"target: {critic.WINDOW}-update mean of objective/scores >= {args.target:+g} within {n} updates; "
          f"{EPISODES} episodes per update; wall and CPU seconds summed over the updates to the target, "
          f"as a ratio to {args.reference}'s median (same session, contended)\n")
    head = ("| arm | G x prompts | seeds | reached | median updates-to-target | restricted mean | wall to target, x ref "
            "| CPU to target, x ref | CPU s/update, x ref | score, all updates | last 5 | frac_reward_zero_std |")
    head += "".join(f" peak GB ({s}) | CPU s/update ({s}) | median updates x that, x ref |" for s in shapes)
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    rows = {}
    for arm in ARMS:
        runs = [r for (a, _), r in sorted(latest.items()) if a == arm]
        if not runs:
            continue
        times = [critic.updates_to_target(r["scores"][:n], args.target) for r in runs]
        wall = [_to_target(r["seconds_per_update"], t) for r, t in zip(runs, times)]
        cpu = [_to_target(r["cpu_seconds_per_update"], t) for r, t in zip(runs, times)]
        spu = statistics.median(c for r in runs for c in r["cpu_seconds_per_update"][1:n])
        zero = [z for r in runs for z in r["frac_reward_zero_std"][:n] if z is not None]
        rows[arm] = dict(arm=arm, runs=runs, times=times, wall=_median_censored(wall), cpu=_median_censored(cpu), spu=spu,
                         zero=statistics.fmean(zero) if zero else None)
    ref = rows.get(args.reference)
    for arm, row in rows.items():
        runs, times = row["runs"], row["times"]
        G = runs[0]["cfg"]["num_generations"]
        reached = sum(t is not None for t in times)
        rmean = statistics.fmean(t if t is not None else n for t in times)
        ratio = lambda key: "-" if not ref or row[key] == float("inf") else f"{row[key] / ref[key]:.2f}"  # noqa: E731
        all_ = statistics.fmean(statistics.fmean(r["scores"][:n]) for r in runs)
        last = statistics.fmean(statistics.fmean(r["scores"][n - 5:n]) for r in runs)
        zero = "-" if row["zero"] is None else f"{row['zero']:.2f}"
        mem = "".join(_shape_cells(s, arm, row, ref, memory, cost) for s in shapes)
        print(f"| {arm} | {G} x {EPISODES // G} | {len(runs)} | {reached}/{len(runs)} | {critic.censored_median(times, n)} "
              f"| {rmean:.1f} | {ratio('wall')} | {ratio('cpu')} | {ratio('spu')} | {all_:+.2f} | {last:+.2f} | {zero} |{mem}")
    trl_report()
    if ref:
        print(f"\nupdates-to-target, 95% bootstrap interval of the median's ratio to {args.reference} (seeds resampled):\n")
        for arm, row in rows.items():
            if arm != args.reference:
                low, high = critic.bootstrap_ratio(row["times"], 1.0, ref["times"], 1.0)
                print(f"- {arm}: {low:.2f}-{high:.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("curves")
    p.add_argument("--arms", default=None, help=f"comma-separated; default: all of {','.join(ARMS)}")
    p.add_argument("--seeds", default="0-9", help="e.g. 0-9")
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--group", type=int, default=4, help="completions per prompt for the group estimators")
    p.add_argument("--jobs", type=int, default=2)
    p = sub.add_parser("worker")
    p.add_argument("share", help="a JSON list of [cfg, tag] written by curves")
    p = sub.add_parser("memory")
    p.add_argument("--shape", default="tiny", help="tiny, 0.5b or 0.5b-<N>l (the 0.5B widths with N layers)")
    p.add_argument("--arms", default=None)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--group", type=int, default=4)
    p = sub.add_parser("trl")
    p.add_argument("--shape", default="tiny", help="tiny, 0.5b, 0.5b-<N>l or smollm2 (bench_vs_trl.py models --smollm2)")
    p.add_argument("--updates", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--precision", choices=("fp32", "native"), default="fp32",
                   help="native: each tool's defaults (ours mixed_precision auto; TRL bf16 + gradient checkpointing)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: both tools on the GPU, peak memory as torch.cuda.max_memory_allocated")
    p = sub.add_parser("single")
    p.add_argument("share", help="a JSON [cfg, tag] written by memory")
    p = sub.add_parser("report")
    p.add_argument("--target", type=float, default=critic.TARGET)
    p.add_argument("--updates", type=int, default=20, help="runs at least this long, read to this length")
    p.add_argument("--reference", default="ppo-head")
    args = ap.parse_args(argv)
    from ppo_cli.engine.precision_probe import machine_record

    print(f"machine: {machine_record()}", flush=True)  # every figure below was measured on it
    {"curves": cmd_curves, "worker": cmd_worker, "memory": cmd_memory, "single": cmd_single, "trl": cmd_trl,
     "report": cmd_report}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
