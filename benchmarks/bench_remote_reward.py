#!/usr/bin/env python
"""Time per update with the reward from an HTTP server that answers after 200 ms, against the same
reward as a local Python function.

    python benchmarks/bench_remote_reward.py [--shape tiny|smollm2] [--repeats 6] [--delay 0.2]
                                             [--batch-size 8] [--concurrency 4]

--shape tiny: the tiny function-reward recipe (recipes/tiny_function_reward.yaml, rollout batch 32,
24 new tokens) on the tiny models, rewarded by recipes/rewards/short_positive.py. --shape smollm2:
recipes/smollm2_concise.yaml (SmolLM2-135M-Instruct with LoRA, 16 chat prompts, 96 new tokens) on
the real model in .cache/smollm2-0.1.2 (scripts/fetch_smollm2.py), rewarded by its
recipes/rewards/concise.py. One engine and one training state; each repeat runs one update with the
recipe's function and one with type http, served on loopback by tests/fixtures/reward_servers.py's
RewardServer, which scores with the same function after sleeping ``--delay`` seconds per request;
the order alternates between repeats. Requests for the rows that finish early go out while the rest
are still sampled (engine/rewards/stream.py), the others before the rollout's log-prob and value
forwards, so the delay is hidden behind both. Prints the median seconds per update and per rollout
of each, their ratio, how long the rollout still waited for the server after its forwards (the
latency not hidden), how many requests went out during sampling, the same batch scored alone (the
latency to hide), and the CPU.

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
    parser.add_argument("--shape", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds the server takes per request")
    parser.add_argument("--batch-size", type=int, default=8, help="completions per request (the component's batch_size)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (max_concurrency)")
    args = parser.parse_args()

    import torch

    from ppo_cli.engine.rewards import stack
    from ppo_cli.engine.rewards.stack import RewardStack
    from ppo_cli.engine.engine import load_engine
    from ppo_cli.recipe_loading import load_recipe
    from ppo_cli.train_setup import init_state
    from ppo_cli.trainer import train_step
    from tests.fixtures.model_cache import built_tiny_models
    from tests.fixtures.reward_servers import RewardServer

    from ppo_cli.engine.rewards.function import load_reward_function

    waits: list[float] = []  # seconds the rollout waited on the server after its forwards
    during: list[int] = []  # requests sent while the batch was still being sampled
    results = stack.PendingScores.results

    def timed_results(self):
        started = time.perf_counter()
        try:
            return results(self)
        finally:
            if self.future is not None or self.stream is not None:
                waits.append(time.perf_counter() - started)
                during.append(self.stream.sent_while_sampling if self.stream is not None else 0)

    stack.PendingScores.results = timed_results
    server = RewardServer().start()
    server.delay_s = args.delay
    if args.shape == "tiny":
        recipe_path, function = ROOT / "recipes" / "tiny_function_reward.yaml", "recipes/rewards/short_positive.py:reward"
        sets = [f"policy.path={built_tiny_models() / 'policy'}", f"data.prompts={ROOT / 'recipes/prompts/reviews.txt'}"]
    else:
        recipe_path, function = ROOT / "recipes" / "smollm2_concise.yaml", "recipes/rewards/concise.py:concise"
        sets = [f"policy.path={ROOT / '.cache' / 'smollm2-0.1.2'}", f"data.prompts={ROOT / 'recipes/prompts/chat_questions.jsonl'}"]
    function = str(ROOT / function)
    server.reward = load_reward_function(function)  # the server scores as the local function does
    http = (f"[{{type: http, url: '{server.score_url}', batch_size: {args.batch_size}, "
            f"max_concurrency: {args.concurrency}, timeout_s: 30}}]")
    with tempfile.TemporaryDirectory() as out:
        sets += [f"output_dir={out}", "data.eval_prompts=null", f"reward.components=[{{type: function, function: '{function}'}}]"]
        recipe = load_recipe(recipe_path, sets)
        http_recipe = load_recipe(recipe_path, sets + [f"reward.components={http}"])
        torch.manual_seed(0)
        engine = load_engine(recipe)
        stacks = {"function": engine.reward,
                  "http": RewardStack(http_recipe.reward, engine.device, recipe.data.system_prompt)}
        from ppo_cli.engine.data import read_recipe_prompts

        state = init_state(engine, read_recipe_prompts(recipe.data).prompts)
        for name in stacks:  # warm-up: first-call costs (imports, the first client) out of the comparison
            engine.reward = stacks[name]
            train_step(state)
        waits.clear(), during.clear()
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
                print(f"repeat {repeat} {name}: {times[name][-1]:.2f} s per update, rollout "
                      f"{rollouts[name][-1]:.2f} s", flush=True)  # partial figures if the run is cut short
        alone = []
        n = recipe.episodes_per_update
        for _ in range(args.repeats):
            started = time.perf_counter()
            stacks["http"].score(["The movie was"] * n, ["great fun"] * n, [True] * n, [3] * n)
            alone.append(time.perf_counter() - started)
    server.stop()
    med = {name: statistics.median(values) for name, values in times.items()}
    roll = {name: statistics.median(values) for name, values in rollouts.items()}
    print(f"shape {args.shape}; CPU: {cpu_name()}, {torch.get_num_threads()} threads; server delay {args.delay:g} s per request, "
          f"batch_size {args.batch_size}, max_concurrency {args.concurrency}, {args.repeats} repeats")
    print("| reward | s per update (median) | s per rollout (median) |")
    print("|---|---|---|")
    for name in ("function", "http"):
        print(f"| {name} | {med[name]:.2f} | {roll[name]:.2f} |")
    print(f"http / function per update: {med['http'] / med['function']:.2f}x "
          f"(rollout {roll['http'] / roll['function']:.2f}x)")
    print(f"http: waited {statistics.median(waits[:args.repeats]):.3f} s (median) after the forwards; requests sent "
          f"while sampling per rollout: {during[:args.repeats]}; the same {n} completions scored alone take "
          f"{statistics.median(alone):.3f} s")


if __name__ == "__main__":
    main()
