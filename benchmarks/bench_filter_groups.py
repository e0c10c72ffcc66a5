#!/usr/bin/env python
"""Does DAPO's dynamic sampling (ppo.filter_groups) pay for its extra sampling on a 0/1 reward? GRPO on the
tiny models with and without it: held-out accuracy after a fixed number of updates, against the episodes
generated (sampled and scored) to get there, over a few seeds.

    python benchmarks/bench_filter_groups.py run --task positive --seeds 0-3 --updates 20
    python benchmarks/bench_filter_groups.py run --task math --seeds 0 --updates 2 --arms off,filter
    python benchmarks/bench_filter_groups.py report

Tasks (both 0/1 rewards, held-out prompts for the accuracy):
  positive  recipes/tiny_grpo.yaml's review prompts; reward 1 when the response holds a positive word
            (``says_something_positive`` below, ppo_cli.examples.rewards' word list), else 0.
  math      recipes/tiny_math.yaml with grpo (4 completions); reward 1 for the right number (math-verify).
            The tiny review LM never answers one: every group scores all 0, which is what filter_groups
            does on a task the policy cannot do yet.

Each arm: 4 prompts x 4 completions per update, one mini-batch, the recipe's other settings;
``filter`` adds ppo.filter_groups with max_filter_rounds 3; ``off-2x`` is ``off`` with twice the updates,
about the episodes ``filter`` samples. A run is a fresh `ppo train` process, one
after another; wall and CPU seconds are the run's own (summary.json, metrics.jsonl) on whatever machine
runs it: on a shared machine, compare arms run in the same session only. Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "runs" / "bench_filter_groups"
# arm -> (its --set overrides, its updates as a multiple of --updates): "off-2x" samples about as many
# episodes as "filter" does (it measured about 2 rounds per update on the positive task).
ARMS = {"off": ([], 1), "filter": (["ppo.filter_groups=true", "ppo.max_filter_rounds=3"], 1), "off-2x": ([], 2)}
COMMON = ["ppo.rollout_batch_size=4", "ppo.mini_batch_size=16", "ppo.micro_batch_size=16", "generation.num_generations=4",
          "reward.missing_eos_penalty=null", "train.sample_every=0", "train.num_threads=1"]


def says_something_positive(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 when the response holds a word of ppo_cli.examples.rewards.POSITIVE, else 0.0."""
    from ppo_cli.examples.rewards import _WORD, POSITIVE

    return [float(any(w in POSITIVE for w in _WORD.findall(r.lower()))) for r in responses]


def task_sets(task: str, models: Path) -> tuple[Path, list[str]]:
    if task == "positive":
        here = Path(__file__).resolve()
        return ROOT / "recipes" / "tiny_grpo.yaml", [
            f"policy.path={models / 'policy'}",
            f"reward.components=[{{type: function, function: '{here}:says_something_positive'}}]",
            f"data.prompts={ROOT / 'recipes/prompts/reviews.txt'}", f"data.eval_prompts={ROOT / 'recipes/prompts/reviews_eval.txt'}",
        ]
    return ROOT / "recipes" / "tiny_math.yaml", [
        f"policy.path={models / 'policy'}", "ppo.advantage=grpo", "value.kind=none", "ppo.ppo_epochs=2",
        f"data.prompts={ROOT / 'recipes/data/tiny_math.jsonl'}", f"data.eval_prompts={ROOT / 'recipes/data/tiny_math_eval.jsonl'}",
    ]


def run(task: str, seeds: list[int], updates: int, arms: list[str]) -> None:
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.model_cache import built_tiny_models

    recipe, sets = task_sets(task, built_tiny_models())
    for seed in seeds:
        for arm in arms:
            extra, times = ARMS[arm]
            name = f"{task}-{arm}-s{seed}"
            args = [*sets, *COMMON, *extra, f"seed={seed}", f"train.total_updates={updates * times}", f"name={name}",
                    f"output_dir={OUT}"]
            cmd = [sys.executable, "-m", "ppo_cli", "train", str(recipe), "--overwrite",
                   *[a for s in args for a in ("--set", s)]]
            env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
            print(name, json.dumps(summarize(OUT / name)))


def summarize(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    generated = sum(m.get("filter/generated_episodes", 0) or 0 for m in metrics) or metrics[-1]["episode"]
    return {
        "before": summary["before"]["score"], "after": summary["after"]["score"], "generated_episodes": generated,
        "trained_episodes": metrics[-1]["episode"], "rounds": [m.get("filter/rounds", 1) for m in metrics],
        "frac_reward_zero_std": statistics.mean(m["frac_reward_zero_std"] for m in metrics),
        "cpu_s": sum(m["time/step_cpu_s"] for m in metrics), "wall_s": sum(m["time/step_s"] for m in metrics),
    }


def report() -> None:
    rows: dict[tuple[str, str], list[dict]] = {}
    for run_dir in sorted(OUT.glob("*-s*")):
        if (run_dir / "summary.json").exists():
            task, rest = run_dir.name.split("-", 1)
            arm = rest.rsplit("-", 1)[0]
            rows.setdefault((task, arm), []).append(summarize(run_dir))
    print("| task | arm | seeds | held-out accuracy before -> after | generated episodes | trained episodes | "
          "frac_reward_zero_std | CPU s |")
    print("|---|---|---|---|---|---|---|---|")
    for (task, arm), runs in sorted(rows.items()):
        mean = lambda key: statistics.mean(r[key] for r in runs)  # noqa: E731
        print(f"| {task} | {arm} | {len(runs)} | {mean('before'):.3f} -> {mean('after'):.3f} "
              f"({', '.join(format(r['after'], '.3f') for r in runs)}) | {mean('generated_episodes'):.0f} | "
              f"{mean('trained_episodes'):.0f} | {mean('frac_reward_zero_std'):.2f} | {mean('cpu_s'):.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    go = sub.add_parser("run")
    go.add_argument("--task", choices=("positive", "math"), default="positive")
    go.add_argument("--seeds", default="0-1", help="e.g. 0-1 or 0,3")
    go.add_argument("--updates", type=int, default=20)
    go.add_argument("--arms", default=",".join(ARMS), help=f"some of {', '.join(ARMS)}")
    sub.add_parser("report")
    args = parser.parse_args()
    if args.command == "run":
        lo, _, hi = args.seeds.partition("-")
        seeds = list(range(int(lo), int(hi) + 1)) if hi else [int(s) for s in args.seeds.split(",")]
        run(args.task, seeds, args.updates, args.arms.split(","))
    else:
        report()


if __name__ == "__main__":
    main()
