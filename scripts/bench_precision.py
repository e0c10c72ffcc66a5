#!/usr/bin/env python
"""fp32 against bf16 autocast (train.mixed_precision): seconds per PPO update, in one process.

    python scripts/bench_precision.py [--models .cache/bench/0.5b] [--repeats 3] [--full]

One engine (float32 weights) and two training states over it, one prepared by an Accelerator with
mixed_precision 'no', one with 'bf16'; their updates (generation + rollout forwards + reward + 4 PPO
epochs of forward/backward + optimizer steps) alternate, the order swapped every round, after one
warm-up update each. Prints the median seconds of the rollout, the update and the whole step per
precision, their fp32 / bf16 ratios, and each precision's val/ratio_first_minibatch. Both states
train the same weights, so the rounds see nearly the same policy.

The models are the 0.5B shape of `python scripts/bench_vs_trl.py models` (Qwen2-0.5B layout, random
weights: the timing depends on the shape only). Never imported by ppo_cli or its tests.
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=Path, default=ROOT / ".cache" / "bench" / "0.5b")
    ap.add_argument("--prompts", type=Path, default=ROOT / ".cache" / "bench" / "prompts.txt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    args = ap.parse_args()

    import torch

    from ppo_cli.distributed import Distributed
    from ppo_cli.engine.data import read_recipe_prompts
    from ppo_cli.engine.session import load_engine
    from ppo_cli.trainer import init_state, train_step

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


if __name__ == "__main__":
    main()
