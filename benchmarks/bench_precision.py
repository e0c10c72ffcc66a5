#!/usr/bin/env python
"""fp32 against bf16 autocast (train.mixed_precision): seconds per PPO update, in one process.

    python benchmarks/bench_precision.py speed [--models .cache/bench/0.5b] [--repeats 3] [--full]
    python benchmarks/bench_precision.py curves [--tiny-models models/tiny] [--seeds 0 1 2 3 4] [--last 10]

One engine (float32 weights) and two training states over it, one prepared by an Accelerator with
mixed_precision 'no', one with 'bf16'; their updates (generation + rollout forwards + reward + 4 PPO
epochs of forward/backward + optimizer steps) alternate, the order swapped every round, after one
warm-up update each. Prints the median seconds of the rollout, the update and the whole step per
precision, their fp32 / bf16 ratios, and each precision's val/ratio_first_minibatch. Both states
train the same weights, so the rounds see nearly the same policy.

The models are the 0.5B shape of `python benchmarks/bench_vs_trl.py models` (Qwen2-0.5B layout, random
weights: the timing depends on the shape only).

``curves``: the tiny task (recipes/tiny_sentiment.yaml as shipped, models from scripts/make_tiny_models.py)
trained with train.mixed_precision no and bf16 for each seed, one `ppo train` process per run; prints
the mean reward (objective/scores) over the whole run and over the last updates, and the held-out
score after training, each as the mean over seeds +- its standard error. Curves are deterministic
per seed (CPU load changes the time only). Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = ("no", "bf16")
PHASES = ("time/rollout_s", "time/update_s", "time/step_s")


def recipe_for(models: Path, args):
    from ppo_cli.recipe_loading import validate_recipe

    return validate_recipe({
        "name": "bench-precision", "seed": 0, "output_dir": str(ROOT / ".cache" / "bench" / "runs"),
        "policy": {"path": str(models / "policy"), "dtype": "float32",
                   "lora": None if args.full else {"r": 16, "alpha": 32, "target_modules": "all-linear"}},
        "value": {"kind": "head"},
        "reward": {"components": [{"type": "model", "path": str(models / "reward"), "batch_size": 64}]},
        "data": {"prompts": str(args.prompts), "max_prompt_tokens": 32},
        "generation": {"max_new_tokens": args.tokens},
        "ppo": {"rollout_batch_size": args.batch, "mini_batch_size": args.batch, "micro_batch_size": args.batch,
                "ppo_epochs": 4},
        "optim": {"lr": 1e-4 if args.full else 3e-3},
        "train": {"total_updates": 1000, "device": "cpu", "num_threads": args.threads, "mixed_precision": "no"},
    })


def speed(args) -> None:
    import torch

    from ppo_cli.distributed import Distributed
    from ppo_cli.engine.data import read_recipe_prompts
    from ppo_cli.engine.engine import load_engine
    from ppo_cli.train_setup import init_state
    from ppo_cli.trainer import train_step

    recipe = recipe_for(args.models, args)
    prompts = read_recipe_prompts(recipe.data).prompts
    engine = load_engine(recipe, torch.device("cpu"), "no")
    states = {}
    for precision in PRECISIONS:
        engine.mixed_precision = precision
        states[precision] = init_state(engine, prompts, Distributed("cpu", precision))

    times = {p: {phase: [] for phase in PHASES} for p in PRECISIONS}
    first_ratio = {p: [] for p in PRECISIONS}
    for round_ in range(args.repeats + 1):
        order = PRECISIONS if round_ % 2 == 0 else PRECISIONS[::-1]
        for precision in order:
            engine.mixed_precision = precision
            torch.manual_seed(round_)
            metrics, _ = train_step(states[precision])
            first_ratio[precision].append(metrics["val/ratio_first_minibatch"])
            if round_:  # the first round is a warm-up
                for phase in PHASES:
                    times[precision][phase].append(metrics[phase])
            print(f"round {round_} {precision}: " + ", ".join(f"{k} {metrics[k]:.2f}" for k in PHASES), flush=True)

    shape = "full" if args.full else "LoRA"
    print(f"\n{shape}, batch {args.batch} x {args.tokens} tokens, {args.threads} threads, "
          f"median of {args.repeats} after 1 warm-up")
    print("| phase | fp32 s | bf16 autocast s | fp32 / bf16 |")
    print("|---|---|---|---|")
    for phase in PHASES:
        fp32, bf16 = (statistics.median(times[p][phase]) for p in PRECISIONS)
        print(f"| {phase.split('/')[1].removesuffix('_s')} | {fp32:.2f} | {bf16:.2f} | {fp32 / bf16:.2f} |")
    for precision in PRECISIONS:
        ratios = ", ".join(f"{r:.4f}" for r in first_ratio[precision])
        print(f"val/ratio_first_minibatch {precision}: {ratios}")


def run_tiny(models: Path, out: Path, seed: int, precision: str) -> tuple[list[dict], dict]:
    import json
    import subprocess
    import sys

    import yaml

    recipe = yaml.safe_load((ROOT / "recipes" / "tiny_sentiment.yaml").read_text())
    for component in recipe["reward"]["components"]:
        if component["type"] == "classifier":
            component["path"] = str(models / "reward")
        else:
            component["function"] = str(ROOT / component["function"])
    recipe["policy"]["path"] = str(models / "policy")
    recipe["data"]["prompts"] = str(ROOT / recipe["data"]["prompts"])
    recipe["data"]["eval_prompts"] = str(ROOT / recipe["data"]["eval_prompts"])
    recipe.update(name=f"tiny-s{seed}-{precision}", seed=seed, output_dir=str(out))
    recipe["train"].update(mixed_precision=precision, sample_every=0)
    path = out / f"{recipe['name']}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    subprocess.run([sys.executable, "-m", "ppo_cli", "train", str(path), "--overwrite"], check=True,
                   stdout=subprocess.DEVNULL)
    run = out / recipe["name"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return metrics, json.loads((run / "summary.json").read_text())


def mean_and_stderr(values: list[float]) -> str:
    mean = statistics.fmean(values)
    stderr = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0
    return f"{mean:.2f} +- {stderr:.2f}"


def curves(args) -> None:
    out = ROOT / ".cache" / "bench" / "precision-curves"
    out.mkdir(parents=True, exist_ok=True)
    rows = {p: {"run": [], "last": [], "after": [], "ratio": [], "seconds": []} for p in PRECISIONS}
    for i, seed in enumerate(args.seeds):
        for precision in PRECISIONS if i % 2 == 0 else PRECISIONS[::-1]:
            metrics, summary = run_tiny(args.tiny_models, out, seed, precision)
            assert summary["mixed_precision"] == precision, summary["mixed_precision"]
            scores = [m["objective/scores"] for m in metrics]
            row = rows[precision]
            row["run"].append(statistics.fmean(scores))
            row["last"].append(statistics.fmean(scores[-args.last:]))
            row["after"].append(summary["after"]["score"])
            row["ratio"].append(max(abs(m["val/ratio_first_minibatch"] - 1) for m in metrics if "val/ratio_first_minibatch" in m))
            row["seconds"].append(summary["seconds"])
            print(f"seed {seed} {precision}: mean score {row['run'][-1]:.2f}, last {args.last} "
                  f"{row['last'][-1]:.2f}, held-out after {row['after'][-1]:.2f}, "
                  f"max |first ratio - 1| {row['ratio'][-1]:.1e}", flush=True)
    print(f"\ntiny_sentiment.yaml, seeds {' '.join(map(str, args.seeds))}: mean over seeds +- standard error")
    print(f"| precision | score, whole run | score, last {args.last} updates | held-out score after | "
          "max abs(first ratio - 1) |")
    print("|---|---|---|---|---|")
    for precision in PRECISIONS:
        row = rows[precision]
        name = "fp32 (no)" if precision == "no" else "bf16 autocast"
        print(f"| {name} | {mean_and_stderr(row['run'])} | {mean_and_stderr(row['last'])} | "
              f"{mean_and_stderr(row['after'])} | {max(row['ratio']):.1e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sp = sub.add_parser("speed", help="seconds per PPO update at the 0.5B shape, fp32 vs bf16 autocast")
    sp.add_argument("--models", type=Path, default=ROOT / ".cache" / "bench" / "0.5b")
    sp.add_argument("--prompts", type=Path, default=ROOT / ".cache" / "bench" / "prompts.txt")
    sp.add_argument("--repeats", type=int, default=3)
    sp.add_argument("--batch", type=int, default=8)
    sp.add_argument("--tokens", type=int, default=24)
    sp.add_argument("--threads", type=int, default=2)
    sp.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    cp = sub.add_parser("curves", help="the tiny task's reward, fp32 vs bf16 autocast, over seeds")
    cp.add_argument("--tiny-models", type=Path, default=ROOT / "models" / "tiny")
    cp.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    cp.add_argument("--last", type=int, default=10, help="updates at the end to average")
    args = ap.parse_args()
    from ppo_cli.engine.precision_probe import machine_record

    print(f"machine: {machine_record()}", flush=True)  # every figure below was measured on it
    (speed if args.command == "speed" else curves)(args)


if __name__ == "__main__":
    main()
