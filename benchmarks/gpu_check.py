#!/usr/bin/env python
"""The checks that need a GPU, as one prepared run on a lent machine (a few minutes of GPU time in all):

    python benchmarks/gpu_check.py --out DIR [--budget 480] [--steps models,grpo-trl,...]

Steps, in this order (each in its own process, each given what is left of ``--budget`` seconds; one
that fails is logged and the next runs):

- ``env``: the card, the driver, the library versions.
- ``models``: the tiny models (``PPO_TINY_MODELS``, built beforehand) under models/tiny, and the bench's
  0.5B shape (`bench_vs_trl.py models`: Qwen2-0.5B layout, random weights).
- ``grpo-trl``: ppo_cli's grpo against TRL's GRPOTrainer at the 0.5B shape, each tool's defaults
  (`bench_estimators.py trl --precision native --device cuda`); ``grpo-trl-fp32`` the fp32-for-both row.
- ``plan-1_5b``: recipes/qwen1_5b_sentiment.yaml as shipped (LoRA, bf16, 4-bit classifier), on random
  weights in Qwen2.5-1.5B's layout and a RoBERTa-base-shaped classifier: `ppo plan`'s estimate against the
  peak of `ppo train` for 3 updates, and each phase's peak (metrics memory/*, summary.json);
  ``plan-1_5b-no-entropy`` the same without the entropy bonus, with the allocator's history of its
  second update: what is alive at the update's peak, by where it was allocated (memory-peak.txt).
- ``tiny``, ``tiny-qlora``, ``tiny-grpo``: recipes/tiny_sentiment.yaml, tiny_qlora.yaml (4-bit base on
  CUDA) and tiny_grpo.yaml as shipped (eval prompts, checkpoints) on the GPU: the precision each
  resolved, the reward and the held-out score.

TRL runs from the machine's own python with TRL's wheels on PYTHONPATH (`.cache/trl-venv/bin/python`
links to it). Everything lands in ``--out``: log.txt, results.json and the benchmark's JSONL.
``--dry-run`` runs the same steps on the CPU (the 1.5B layout cut to 2 narrow layers) to check the
script before a GPU is spent on it. How a lent machine runs it: docs/benchmarks.md, "On a GPU".
Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QWEN_1_5B = dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True, rope_theta=1_000_000.0,
                 rms_norm_eps=1e-6, max_position_embeddings=32768)
DRY_RUN_LAYOUT = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512)
STEPS = ("env", "models", "grpo-trl", "plan-1_5b", "plan-1_5b-no-entropy", "tiny", "tiny-qlora", "tiny-grpo",
         "grpo-trl-fp32")
STEP_LIMIT_S = {"env": 60, "models": 120, "grpo-trl": 240, "plan-1_5b": 180, "plan-1_5b-no-entropy": 120, "tiny": 150,
                "tiny-qlora": 150, "tiny-grpo": 150, "grpo-trl-fp32": 150}  # a hang costs one step


def env() -> dict:
    e = dict(os.environ)
    e.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    e["PYTHONPATH"] = os.pathsep.join(p for p in (e.get("PYTHONPATH"), str(ROOT)) if p)
    return e


def step_commands(out: Path, dry_run: bool) -> dict[str, list[list[str]]]:
    py = sys.executable
    device, dry = ("cpu", ["--dry-run"]) if dry_run else ("cuda", [])
    bench_est = [py, "benchmarks/bench_estimators.py", "trl", "--shape", "tiny" if dry_run else "0.5b", "--device", device,
                 "--threads", "4"]
    return {
        "env": [["nvidia-smi"], [py, "-c", "import torch, transformers, accelerate, peft, trl, bitsandbytes, pydantic; "
                                 "print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0), "
                                 "transformers.__version__, accelerate.__version__, peft.__version__, trl.__version__, "
                                 "bitsandbytes.__version__, pydantic.__version__)"]],
        "models": [[py, "benchmarks/bench_vs_trl.py", "models"]],
        "grpo-trl": [bench_est + ["--precision", "native", "--updates", "5", "--rounds", "2"]],
        "plan-1_5b": [[py, __file__, "plan-1_5b", "--out", str(out)] + dry],
        # the memory history of the second update: what is alive at the peak (memory-peak.txt)
        "plan-1_5b-no-entropy": [[py, __file__, "plan-1_5b", "--out", str(out), "--tag", "no-entropy", "--trace",
                                  "--set", "ppo.entropy_coef=0"] + dry],
        "tiny": [[py, __file__, "tiny", "--out", str(out)]],
        "tiny-qlora": [[py, __file__, "tiny", "--out", str(out), "--tag", "qlora"]],  # 4-bit on CUDA
        "tiny-grpo": [[py, __file__, "tiny", "--out", str(out), "--tag", "grpo"]],
        "grpo-trl-fp32": [bench_est + ["--precision", "fp32", "--updates", "5", "--rounds", "1"]],
    }


def run_steps(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget
    tiny = Path(os.environ.get("PPO_TINY_MODELS", ""))
    if tiny.is_dir() and not (ROOT / "models" / "tiny").exists():
        (ROOT / "models").mkdir(exist_ok=True)
        shutil.copytree(tiny, ROOT / "models" / "tiny")
    commands = step_commands(out, args.dry_run)
    with (out / "log.txt").open("a") as log:
        for name in args.steps.split(","):
            for command in commands[name]:
                left = deadline - time.monotonic()
                if left < 20:
                    print(f"== {name}: skipped, {left:.0f} s of the budget left", file=log, flush=True)
                    break
                print(f"== {name}: {' '.join(command)} ({left:.0f} s left)", file=log, flush=True)
                started = time.monotonic()
                proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=ROOT,
                                        start_new_session=True)  # its own group: a timeout ends its children too
                try:
                    rc = proc.wait(timeout=min(left, STEP_LIMIT_S[name]))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    rc = "timeout"
                print(f"== {name}: rc {rc} in {time.monotonic() - started:.0f} s", file=log, flush=True)
    results = ROOT / ".cache" / "bench" / "results" / "estimator-trl.jsonl"
    if results.exists():
        shutil.copy(results, out / "estimator-trl.jsonl")
        report = subprocess.run([sys.executable, "-c", "import sys; sys.argv=['x']; sys.path.insert(0, 'benchmarks'); "
                                 "import bench_estimators as b; b.trl_report()"],
                                capture_output=True, text=True, env=env(), cwd=ROOT)
        (out / "grpo-trl.md").write_text(report.stdout + report.stderr[-2000:])


def _save_result(out: Path, key: str, value: dict) -> None:
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results[key] = value
    path.write_text(json.dumps(results, indent=1))


def _train(recipe_path: Path, *overrides: str) -> Path:
    from ppo_cli.commands.train import run
    from ppo_cli.recipe_loading import load_recipe

    return run(load_recipe(recipe_path, list(overrides)), recipe_path=recipe_path, overwrite=True).run_dir


def plan_1_5b(args) -> None:
    """The 1.5B recipe's memory: `ppo plan` against the run, on random weights in the real layouts."""
    import torch
    import yaml
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, RobertaConfig, RobertaForSequenceClassification

    from ppo_cli.commands.plan import run as plan
    from ppo_cli.recipe_loading import load_recipe

    device = "cpu" if args.dry_run else "cuda"
    layout = {**QWEN_1_5B, **(DRY_RUN_LAYOUT if args.dry_run else {})}
    base = ROOT / ".cache" / ("gpu-check-dry" if args.dry_run else "gpu-check")
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models" / "tiny" / "policy")  # ids past its vocabulary decode to ""
    policy, classifier = base / "qwen2.5-1.5b-random", base / "roberta-sentiment-random"
    if not (policy / "config.json").exists():
        config = Qwen2Config(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                             dtype="bfloat16", **layout)
        torch.manual_seed(0)
        with torch.device(device):
            Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(policy)
        tokenizer.save_pretrained(policy)
        labels = {0: "negative", 1: "neutral", 2: "positive"}
        config = RobertaConfig(num_labels=3, id2label=labels, label2id={v: k for k, v in labels.items()},
                               pad_token_id=tokenizer.pad_token_id)  # roberta-base's widths
        RobertaForSequenceClassification(config).save_pretrained(classifier)
        tokenizer.save_pretrained(classifier)
        if device == "cuda":  # the run's peak is the run's own, not the build's
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    recipe = yaml.safe_load((ROOT / "recipes" / "qwen1_5b_sentiment.yaml").read_text())
    recipe["policy"]["path"] = str(policy)
    recipe["reward"]["components"][0]["path"] = str(classifier)
    recipe["output_dir"] = str(base / "runs")
    recipe["train"].update(total_updates=3, log_every=1)
    recipe["train"]["device"] = device
    recipe_path = base / "qwen1_5b_sentiment_random.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    estimate = plan(load_recipe(recipe_path, args.set), device=device).estimate
    with memory_trace(Path(args.out), device if args.trace else "off") as trace:
        run_dir = _train(recipe_path, *args.set)
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    result = {**trace, "phase_peaks_gb": [{k: v for k, v in m.items() if k.startswith("memory/")} for m in metrics],"plan_total_gb": estimate.total_gb, "plan_static_gb": estimate.static_gb, "plan_update_gb": estimate.update_gb,
              "plan_rollout_gb": estimate.rollout_gb, "plan_lines": [dataclasses.asdict(line) for line in estimate.lines],
              "measured_peak_gb": summary.get("peak_memory_gb"), "summary": summary,
              "step_s": [m.get("time/step_s") for m in metrics], "rollout_s": [m.get("time/rollout_s") for m in metrics]}
    print(json.dumps(result, indent=1), flush=True)
    _save_result(Path(args.out), "-".join(filter(None, ("plan-1_5b", args.tag))), {"overrides": args.set, **result})


@contextlib.contextmanager
def memory_trace(out: Path, device: str):
    """CUDA memory allocated when the first update starts (the static part), and the allocator's history
    over the second update: the allocations alive at its peak, grouped by where they were made
    (memory-peak.txt), the snapshot itself gzipped beside it."""
    import torch

    from ppo_cli import trainer

    found: dict = {}
    if device != "cuda":
        yield found
        return
    step, calls = trainer.train_step, []

    def traced_step(state):
        calls.append(1)
        if len(calls) == 1:
            found["allocated_at_first_update_gb"] = torch.cuda.memory_allocated() / 1e9
        if len(calls) != 2:
            return step(state)
        found["allocated_before_traced_update_gb"] = torch.cuda.memory_allocated() / 1e9
        torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
        try:
            return step(state)
        finally:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            with gzip.open(out / "snapshot-1_5b.pickle.gz", "wb") as f:
                pickle.dump(snapshot, f)
            try:
                (out / "memory-peak.txt").write_text(peak_report(snapshot, found["allocated_before_traced_update_gb"]))
            except Exception as err:  # the report is a reading aid: the snapshot is there to redo it
                found["peak_report_error"] = repr(err)

    trainer.train_step = traced_step
    try:
        yield found
    finally:
        trainer.train_step = step


def _site(frames: list[dict]) -> str:
    """Where an allocation was made: the innermost library frame and the innermost ppo_cli frame."""
    def short(f):
        return f"{'/'.join(f['filename'].split('/')[-2:])}:{f['line']} {f['name']}"
    ours = next((short(f) for f in frames if "ppo_cli/" in f["filename"]), "?")
    lib = next((short(f) for f in frames if any(k in f["filename"] for k in ("peft/", "transformers/", "bitsandbytes/",
                                                                            "torch/nn/", "accelerate/"))), "")
    return f"{ours} <- {lib}" if lib else ours


def peak_report(snapshot: dict, baseline_gb: float) -> str:
    """Replay the traced allocations; at the highest total, the live ones grouped by site, largest first."""
    alive: dict[int, tuple[int, str]] = {}
    stacks: dict[str, list[dict]] = {}
    total = best = 0
    best_alive: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][0]:
        action = event["action"]
        if action == "alloc":
            site = _site(event.get("frames", []))
            stacks.setdefault(site, event.get("frames", []))
            alive[event["addr"]] = (event["size"], site)
            total += event["size"]
            if total > best:
                best, best_alive = total, dict(alive)
        elif action == "free_completed":
            size = alive.pop(event["addr"], (event["size"], ""))[0]
            total -= size  # a block from before the trace lowers the total below the baseline
    by_site: dict[str, list[int]] = {}
    for size, site in best_alive.values():
        by_site.setdefault(site, []).append(size)
    lines = [f"baseline (allocated when the traced update began) {baseline_gb:.3f} GB; traced peak above it "
             f"{best / 1e9:.3f} GB; live at the peak, by site:"]
    for site, sizes in sorted(by_site.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{sum(sizes) / 1e9:8.3f} GB {len(sizes):5d} x  {site}")
    for site, _ in sorted(by_site.items(), key=lambda kv: -sum(kv[1]))[:8]:
        lines.append(f"\nstack of {site}:")
        lines += [f"    {f['filename']}:{f['line']} {f['name']}" for f in stacks[site][:40]]
    return "\n".join(lines) + "\n"


def tiny(args) -> None:
    """recipes/tiny_sentiment.yaml (or tiny_<tag>.yaml) as shipped, on the GPU (train.device auto)."""
    recipe = ROOT / "recipes" / f"tiny_{args.tag or 'sentiment'}.yaml"
    run_dir = _train(recipe, f"output_dir={ROOT / '.cache' / 'gpu-check' / 'runs'}")
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    name = "-".join(filter(None, ("tiny", args.tag)))
    shutil.copy(run_dir / "metrics.jsonl", Path(args.out) / f"{name}-metrics.jsonl")
    result = {"summary": summary, "scores": [m.get("objective/scores") for m in metrics],
              "step_s": [m.get("time/step_s") for m in metrics], "files": sorted(p.name for p in run_dir.iterdir())}
    print(json.dumps(result, indent=1), flush=True)
    _save_result(Path(args.out), name, result)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", default="steps", choices=("steps", "plan-1_5b", "tiny"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=480, help="seconds for all the steps together")
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--set", action="append", default=[], help="plan-1_5b: a recipe override, as ppo train --set")
    ap.add_argument("--tag", default="", help="plan-1_5b: the result's name in results.json")
    ap.add_argument("--trace", action="store_true", help="plan-1_5b: the allocator's history of the second update")
    ap.add_argument("--dry-run", action="store_true", help="plan-1_5b on the CPU, the layout cut to 2 narrow layers: "
                    "checks this script, not the GPU")
    args = ap.parse_args(argv)
    {"steps": run_steps, "plan-1_5b": plan_1_5b, "tiny": tiny}[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
