#!/usr/bin/env python
"""Peak resident memory of a short `ppo train`, with the glibc heap tuning on or off.

    python benchmarks/peak_rss.py RECIPE [--malloc on|keep|off] [--set KEY=VALUE ...]

Runs `ppo train RECIPE --set ...` in this process (the CLI's own code path: recipe, plan-driven
choices, engine, trainer) and prints one JSON line: the recipe, the overrides, the malloc setting,
the peak RSS (``ru_maxrss``, GB), the wall and the process CPU seconds. ``--malloc off`` replaces
engine/malloc.tune_for_training and the trainer's once-per-update release_freed_memory with nothing before
the engine loads (glibc's own thresholds), whatever the rule says; ``keep`` only the trim (the tuning as
it was before issue 33 item 4); ``on`` (default) leaves the run's own choice. Run each setting in a fresh
process: the peak is the process's. Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--malloc", choices=("on", "keep", "off"), default="on")
    parser.add_argument("--set", dest="sets", action="append", default=[])
    args = parser.parse_args()
    from ppo_cli.engine import malloc

    malloc.ask_torch_for_huge_pages()  # as `ppo`'s entry point does, before torch loads
    import ppo_cli.engine.engine as engine_module

    import ppo_cli.trainer as trainer_module

    if args.malloc == "off":
        engine_module.tune_for_training = lambda gradient_checkpointing: None
    if args.malloc in ("keep", "off"):
        trainer_module.release_freed_memory = lambda: None
    from ppo_cli.cli import main as cli_main

    argv = ["train", args.recipe, "--overwrite"] + [a for s in args.sets for a in ("--set", s)]
    started, cpu_started = time.perf_counter(), time.process_time()
    sys.argv = ["ppo", *argv]
    code = 0
    try:
        cli_main()
    except SystemExit as exit_:
        code = exit_.code or 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux -> GB
    print(json.dumps({"recipe": args.recipe, "sets": args.sets, "malloc": args.malloc, "exit": code,
                      "peak_rss_gb": round(peak, 3), "wall_s": round(time.perf_counter() - started, 1),
                      "cpu_s": round(time.process_time() - cpu_started, 1)}))


if __name__ == "__main__":
    main()
