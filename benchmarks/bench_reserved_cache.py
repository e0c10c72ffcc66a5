#!/usr/bin/env python
"""Sampling's KV cache reserved for the call (engine/reserved_cache.py) against transformers' own
DynamicCache, same process, in turn: the GRPO bench recipe's sampling (SmolLM2-135M-Instruct, LoRA r16
all-linear, frozen weights stored as a run stores them, `mixed_precision` as the recipe resolves it on
this CPU) of 4 prompts x 4 completions x 48 tokens forced (no stop token), after one warm-up call each.
Each pair of calls is seeded alike and must sample the same tokens.

    python benchmarks/bench_reserved_cache.py [RECIPE] [--calls 12] [--threads 2] [--set section.key=value ...]

Prints each pair's wall-time ratio (reserved / dynamic), its median, and wall and process CPU seconds
per call (min / median). Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import statistics
import time

from sampling_bench import DEFAULT_RECIPE, sampling_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=str(DEFAULT_RECIPE))
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="section.key=value overrides of the recipe")
    args = parser.parse_args()

    import torch

    from ppo_cli.engine import reserved_cache

    engine, prompts = sampling_engine(args.recipe, args.set, args.threads)

    modes = ("reserved", "dynamic")
    seconds = {mode: [] for mode in modes}
    for call in range(args.calls + 1):  # call 0 warms up
        tokens = []
        for mode in (modes if call % 2 == 0 else modes[::-1]):
            reserved_cache.ENABLED = mode == "reserved"
            torch.manual_seed(call)
            wall, cpu = time.perf_counter(), time.process_time()
            with engine.autocast():
                tokens.append(engine.generate(prompts).response_ids)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if call > 0:
                seconds[mode].append((wall, cpu))
        assert all(t.equal(tokens[0]) for t in tokens), f"call {call}: the two caches sampled different tokens"
    ratios = [r[0] / d[0] for r, d in zip(seconds["reserved"], seconds["dynamic"])]
    print(f"{args.threads} threads; wall ratio reserved / dynamic per call: "
          f"{' '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f}")
    for mode, pairs in seconds.items():
        walls, cpus = [w for w, _ in pairs], [c for _, c in pairs]
        print(f"sampling {mode:8s} wall {min(walls):.2f} / {statistics.median(walls):.2f}   "
              f"CPU {min(cpus):.2f} / {statistics.median(cpus):.2f}")


if __name__ == "__main__":
    main()
