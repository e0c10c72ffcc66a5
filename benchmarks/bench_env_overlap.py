#!/usr/bin/env python
"""Does environment.overlap hide a slow environment behind sampling? Wall time per rollout of tiny-tools
(tests/fixtures/tiny_tools.py) in episodes with a simulated user whose every step sleeps (``SlowUser``
below: a remote game or an LLM-backed user, say), overlap off against on, in one process, alternating.

    python benchmarks/bench_env_overlap.py --delays 0,0.3 --prompts 2 --repeats 3
    python benchmarks/bench_env_overlap.py --delays 0,0.5,2 --prompts 16 --repeats 2

Each rollout: --prompts prompts of recipes/data/tiny_tools.jsonl x 8 episodes (generation.num_generations),
--turns assistant turns at most, every step sleeping each of --delays seconds in turn (max_concurrency 256: the steps of
one turn run at once, so a turn's steps take about one delay). Off: sample all, then step all, per turn.
On: two waves of half the episodes, one's steps running while the other samples. The same torch seed
before every rollout. Prints seconds per rollout for each and the ratio on / off, first with steps that
take no time (what sampling in two half batches costs), then the other delays; on a shared machine compare
numbers of one invocation only. Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class SlowUser:
    """A python environment whose every step takes ``delay`` seconds, then asks for another try."""

    slow_steps = True  # environment.overlap: auto turns overlap on (the runs below set it either way)

    def __init__(self, delay: float = 0.3):
        self.delay = delay

    def reset(self, row, seed):
        return None

    def step(self, message):
        time.sleep(self.delay)
        return {"observation": "Check it once more.", "reward": None, "done": False}


def make_sampler(recipe, policy, tokenizer):
    from ppo_cli.engine.engine import make_sampler as engine_sampler
    import torch

    stop_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return engine_sampler(recipe, torch.device("cpu"), policy, tokenizer=tokenizer, stop_token_id=stop_token_id,
                          pad_token_id=tokenizer.pad_token_id, mixed_precision="no")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--delays", default="0,0.3", help="seconds each environment step sleeps, comma-separated")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per rollout (x 8 episodes)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3, help="rollouts per setting, alternating off / on")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppo_cli.recipe_loading import load_recipe
    from tests.fixtures.model_cache import built_tiny_tools

    torch.set_num_threads(1)  # as recipes/tiny_tools.yaml's train.num_threads
    models = built_tiny_tools() / "policy"
    tokenizer = AutoTokenizer.from_pretrained(models)
    policy = AutoModelForCausalLM.from_pretrained(models, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in (ROOT / "recipes/data/tiny_tools.jsonl").read_text().splitlines()[: args.prompts]]
    prompts = [row["prompt"] for row in rows for _ in range(8)]
    print(f"{len(prompts)} episodes, up to {args.turns} turns, torch threads 1; seconds per rollout, median of "
          f"{args.repeats} (turns sampled)")
    # Delay 0: what splitting the batch in two costs the sampling alone (two half-batch generates a turn).
    for delay in (float(d) for d in args.delays.split(",")):
        samplers = {}
        for overlap in ("false", "true"):
            environment = (f"{{type: python, class: '{Path(__file__).resolve()}:SlowUser', kwargs: {{delay: {delay}}}, "
                           f"max_turns: {args.turns}, max_episode_tokens: 200, max_concurrency: 256, overlap: {overlap}}}")
            recipe = load_recipe(ROOT / "recipes/tiny_tools.yaml", [f"policy.path={models}", f"environment={environment}"])
            samplers[overlap] = make_sampler(recipe, policy, tokenizer)
        seconds: dict[str, list[float]] = {"false": [], "true": []}
        turns: dict[str, int] = {}
        for _ in range(args.repeats):
            for overlap, sampler in samplers.items():
                torch.manual_seed(0)
                started = time.perf_counter()
                with torch.no_grad():
                    result = sampler.sample(policy, None, None, prompts=prompts)
                seconds[overlap].append(time.perf_counter() - started)
                turns[overlap] = sum(r.turns for r in result.episodes)
        off, on = statistics.median(seconds["false"]), statistics.median(seconds["true"])
        print(f"step {delay:g} s: overlap off {off:.2f} s ({turns['false']}), on {on:.2f} s ({turns['true']}), "
              f"on / off {on / off:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
