#!/usr/bin/env python
"""The glibc heap tuning's price in memory, update by update (issue 33 item 4).

    python benchmarks/heap_phases.py --malloc mapped|trim|keep|off [--updates 3] [--threads 1] [--set section.key=value ...]

Runs bench_vs_trl_grpo.py's ``ours`` (the SmolLM2 GRPO shape, phase_rss.py naming the phases) in this
process with the heap as ``--malloc`` says: ``mapped`` is what `ppo train` does where the kernel grants
transparent huge pages on request and the update is checkpointed (engine/malloc.heap_mapped: blocks of
2 MiB or more mapped on huge pages); ``trim`` what it does elsewhere where its rule keeps the tuning
(engine/malloc.keep_freed_memory, and release_freed_memory once per update, after the update's
optimizer steps; torch's huge-page switch THP_MEM_ALLOC_ENABLE=0 here); ``keep`` the tuning without
that trim (ppo_cli before 2026-11-28's item 4); ``off`` neither (glibc's own thresholds).
Appends a record to .cache/bench/results/heap-phases.jsonl and prints the peak per update and phase.
Run each setting in a fresh process: the peak is the process's. Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_trl_grpo as bench  # noqa: E402  (beside this file)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--malloc", choices=("mapped", "trim", "keep", "off"), default="trim")
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    import os

    from ppo_cli.engine import malloc

    # before torch loads: torch reads its huge-page switch at its first allocation
    if args.malloc != "mapped":
        os.environ[malloc.TORCH_THP_SWITCH] = "0"
    elif not (malloc.ask_torch_for_huge_pages() or malloc.large_blocks_on_huge_pages()):
        sys.exit(f"--malloc mapped: the kernel's THP mode is {malloc.transparent_huge_pages()!r} (madvise or always needed)")
    import ppo_cli.engine.engine as engine_module
    import ppo_cli.trainer as trainer_module

    if args.malloc == "off":
        engine_module.tune_for_training = lambda gradient_checkpointing: None
    if args.malloc in ("off", "keep"):
        trainer_module.release_freed_memory = lambda: None
    bench.RESULTS = bench.ROOT / ".cache" / "bench" / "results" / "heap-phases.jsonl"
    tag = f"heap-{args.malloc}" + "".join("-" + s.split(".")[-1].replace("=", "-") for s in args.set)  # a run name
    bench.cmd_ours(argparse.Namespace(updates=args.updates, threads=args.threads, seed=0, tag=tag,
                                      mixed_precision=None, set=args.set))
    record = json.loads(bench.RESULTS.read_text().splitlines()[-1])
    for update, phases in record["phases"].items():
        print(update, {p: round(v["peak_gb"], 2) for p, v in phases.items()}, flush=True)


if __name__ == "__main__":
    main()
