#!/usr/bin/env python
"""Time per update with the reward from an HTTP server that answers after 200 ms, against the same
reward as a local Python function.

    python benchmarks/bench_remote_reward.py [--repeats 6] [--delay 0.2] [--batch-size 8] [--concurrency 4]

The tiny function-reward recipe (recipes/tiny_function_reward.yaml, rollout batch 32, 24 new tokens)
on the tiny models. One engine and one training state; each repeat runs one update with the
function (recipes/rewards/short_positive.py) and one with type http, served on loopback by
tests/reward_servers.py's RewardServer, which scores with the same function after sleeping
``--delay`` seconds per request; the order alternates between repeats. The requests go out before
the rollout's log-prob and value forwards (RewardStack.start), so part of the delay is hidden behind
them. Prints the median seconds per update and per rollout of each, their ratio, how long the
rollout still waited for the server after its forwards (the latency not hidden), the same batch
scored alone (the latency to hide), and the CPU.

Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def tiny_models() -> Path:
    """The tiny models scripts/make_tiny_models.py built, where the tests' fixture keeps them."""
    import hashlib
    import subprocess

    digest = hashlib.sha256((ROOT / "scripts" / "make_tiny_models.py").read_bytes()).hexdigest()[:12]
    out = ROOT / ".cache" / f"tiny-models-{digest}"
    if not (out / "policy" / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_models.py"), "--out", str(out)], check=True)
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds the server takes per request")
    parser.add_argument("--batch-size", type=int, default=8, help="completions per request (the component's batch_size)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (max_concurrency)")
    args = parser.parse_args()

    import torch

    from ppo_cli.engine import rewards
    from ppo_cli.engine.rewards import RewardStack
    from ppo_cli.engine.engine import load_engine
    from ppo_cli.recipe_loading import load_recipe
    from ppo_cli.trainer import init_state, train_step
    from tests.reward_servers import RewardServer

    waits: list[float] = []  # seconds the rollout waited on the server after its forwards
    results = rewards.PendingScores.results

    def timed_results(self):
        started = time.perf_counter()
        try:
            return results(self)
        finally:
            if self.future is not None:
                waits.append(time.perf_counter() - started)

    rewards.PendingScores.results = timed_results
    server = RewardServer().start()
    server.delay_s = args.delay
    models = tiny_models()
    function = f"{ROOT / 'recipes/rewards/short_positive.py'}:reward"
    http = (f"[{{type: http, url: '{server.score_url}', batch_size: {args.batch_size}, "
            f"max_concurrency: {args.concurrency}, timeout_s: 30}}]")
    with tempfile.TemporaryDirectory() as out:
        sets = [f"policy.path={models / 'policy'}", f"output_dir={out}", "data.eval_prompts=null",
                f"data.prompts={ROOT / 'recipes/prompts/reviews.txt'}", f"reward.components=[{{type: function, function: '{function}'}}]"]
        recipe = load_recipe(ROOT / "recipes" / "tiny_function_reward.yaml", sets)
        http_recipe = load_recipe(ROOT / "recipes" / "tiny_function_reward.yaml", sets + [f"reward.components={http}"])
        torch.manual_seed(0)
        engine = load_engine(recipe)
        stacks = {"function": engine.reward,
                  "http": RewardStack(http_recipe.reward, engine.device, recipe.data.system_prompt)}
        from ppo_cli.engine.data import read_recipe_prompts

        state = init_state(engine, read_recipe_prompts(recipe.data).prompts)
        engine.reward = stacks["function"]
        train_step(state)  # warm-up: first-call costs out of the comparison
        times = {name: [] for name in stacks}
        rollouts = {name: [] for name in stacks}
        for repeat in range(args.repeats):
            order = ("function", "http") if repeat % 2 == 0 else ("http", "function")
            for name in order:
                engine.reward = stacks[name]
                started = time.perf_counter()
                metrics, _ = train_step(state)
                times[name].append(time.perf_counter() - started)
                rollouts[name].append(metrics["time/rollout_s"])
        alone = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            stacks["http"].score(["The movie was"] * 32, ["great fun"] * 32, [True] * 32, [3] * 32)
            alone.append(time.perf_counter() - started)
    server.stop()
    med = {name: statistics.median(values) for name, values in times.items()}
    roll = {name: statistics.median(values) for name, values in rollouts.items()}
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; server delay {args.delay:g} s per request, "
          f"batch_size {args.batch_size}, max_concurrency {args.concurrency}, {args.repeats} repeats")
    print("| reward | s per update (median) | s per rollout (median) |")
    print("|---|---|---|")
    for name in ("function", "http"):
        print(f"| {name} | {med[name]:.2f} | {roll[name]:.2f} |")
    print(f"http / function per update: {med['http'] / med['function']:.2f}x "
          f"(rollout {roll['http'] / roll['function']:.2f}x)")
    print(f"http: waited {statistics.median(waits[:args.repeats]):.3f} s (median) after the forwards; the same "
          f"32 completions scored alone take {statistics.median(alone):.3f} s")


if __name__ == "__main__":
    main()
