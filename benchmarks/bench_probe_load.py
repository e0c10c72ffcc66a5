#!/usr/bin/env python
"""The precision probe's update-shaped timings under load: its old order against its alternating one.

    python benchmarks/bench_probe_load.py [--threads 2] [--rounds 150] [--busy] [--shape 96 384]

Each round times Linear(hidden -> intermediate) on 256 rows in float32 and under bf16 autocast, best of
REPEATS each, twice: all float32 repeats before all bf16 ones (the probe before version 2), then the two
alternating (``interleaved_best_ms``, the probe now). ``--busy`` runs a busy-loop process beside it for
the duration (the load of another job on the machine). Prints, per order, how the fp32/bf16 ratio
spreads over the rounds: below 1.11 ``auto`` takes float32 (precision.py's 10% margin). Contended
timings by design: ratios from one process, never speed figures. Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from ppo_cli.engine.precision_probe import REPEATS, interleaved_best_ms, machine_record


def steps(hidden: int, intermediate: int) -> dict:
    layer = torch.nn.Linear(hidden, intermediate, bias=False)
    x = torch.randn(256, hidden)

    def timed(enabled: bool) -> float:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            started = time.perf_counter()
            layer(x)
            return time.perf_counter() - started

    return {"fp32": lambda: timed(False), "bf16": lambda: timed(True)}


def summary(name: str, ratios: list[float]) -> str:
    ratios = sorted(ratios)
    return (f"{name}: fp32/bf16 median {ratios[len(ratios) // 2]:.2f}, min {ratios[0]:.3g}, max {ratios[-1]:.3g}; "
            f"below 1.11 (auto -> fp32) in {sum(r < 1.11 for r in ratios)} of {len(ratios)}, "
            f"above 2 in {sum(r > 2 for r in ratios)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--busy", action="store_true", help="a busy-loop process beside the probe")
    parser.add_argument("--shape", type=int, nargs=2, default=[96, 384], metavar=("HIDDEN", "INTERMEDIATE"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        print({**machine_record(), "threads": args.threads, "busy_loop": args.busy, "load1": os.getloadavg()[0]})
        timed = steps(*args.shape)
        ratios: dict[str, list[float]] = {"fp32 first": [], "alternating": []}
        for _ in range(args.rounds):
            blocked = {name: interleaved_best_ms({name: step}, REPEATS)[name] for name, step in timed.items()}
            ratios["fp32 first"].append(blocked["fp32"] / blocked["bf16"])
            turns = interleaved_best_ms(timed, REPEATS)
            ratios["alternating"].append(turns["fp32"] / turns["bf16"])
        for name, values in ratios.items():
            print(summary(name, values))
        print(f"load1 after: {os.getloadavg()[0]:.2f}")
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


if __name__ == "__main__":
    main()
