#!/usr/bin/env python
"""Sampling's LoRA layers in two ops on bases packed once (engine/lean_lora.py, engine/packed_linear.py)
against the same without the packing and against peft's forward, same process, in turn: the GRPO bench recipe's sampling (SmolLM2-135M-Instruct, LoRA r16 all-linear, frozen
weights stored as a run stores them, `mixed_precision` as the recipe resolves it on this CPU) of 4 prompts
x 4 completions x 48 tokens forced (no stop token), after one warm-up call each.

    python benchmarks/bench_lean_lora.py [RECIPE] [--calls 4] [--threads 2] [--set section.key=value ...]

Modes: ``packed`` (what generate() does), ``lean`` (packed_linear switched off), ``peft`` (both off).
``--set train.mixed_precision=no`` times the float32 path (which packs nothing). Prints wall and process CPU seconds per call
(min / median). Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import statistics
import time

from sampling_bench import DEFAULT_RECIPE, sampling_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=str(DEFAULT_RECIPE))
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], help="section.key=value overrides of the recipe")
    args = parser.parse_args()

    import torch

    from ppo_cli.engine import lean_lora, packed_linear

    engine, prompts = sampling_engine(args.recipe, args.set, args.threads, trained_adapter=True)

    def sampling():
        torch.manual_seed(0)
        with engine.autocast():
            engine.generate(prompts)

    modes = ("packed", "lean", "peft")
    seconds = {mode: [] for mode in modes}
    for call in range(args.calls + 1):  # call 0 warms up
        for mode in (modes if call % 2 == 0 else modes[::-1]):
            lean_lora.ENABLED = mode != "peft"
            packed_linear.ENABLED = mode == "packed"
            wall, cpu = time.perf_counter(), time.process_time()
            sampling()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(f"call {call} sampling {mode}: {wall:.2f} s wall, {cpu:.2f} CPU s", flush=True)
            if call > 0:
                seconds[mode].append((wall, cpu))
    print(f"{args.threads} threads; min / median of {args.calls} calls")
    for mode, pairs in seconds.items():
        walls, cpus = [w for w, _ in pairs], [c for _, c in pairs]
        print(f"sampling {mode:6s} wall {min(walls):.2f} / {statistics.median(walls):.2f}   "
              f"CPU {min(cpus):.2f} / {statistics.median(cpus):.2f}")


if __name__ == "__main__":
    main()
