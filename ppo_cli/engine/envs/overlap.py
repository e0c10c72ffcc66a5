"""environment.overlap: which episodes sample together, and the thread the environments step on.

Without overlap a batch is one wave: every running episode samples its turn, then every one steps. With it,
two waves, the batch's first half (rounded up) and its second half, alternate in a fixed order: wave 1
samples, wave 2 samples while wave 1's environments step, wave 1's steps are waited for and it samples
again while wave 2's step, and so on (multi_turn.MultiTurnSampler.sample). Whether to overlap comes from
the recipe and the environment class, never from a timing, so a seed gives the same episodes.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

from ppo_cli.recipe import EnvironmentConfig

Message = dict[str, Any]


def steps_overlap_sampling(environment: EnvironmentConfig, environment_class=None) -> bool:
    """environment.overlap resolved. ``auto``: true only for a type python class that declares its steps slow
    (a class attribute ``slow_steps = True``), false otherwise. From the recipe and the class alone, never from a
    timing, so a seed gives the same episodes. Why not on by default: two half batches sample each turn, which
    costs up to twice a full batch's time where sampling does not grow with the batch (a small model, a GPU)."""
    if environment.overlap == "auto":
        return environment.type == "python" and getattr(environment_class, "slow_steps", False) is True
    return environment.overlap


def waves(batch_size: int, overlap: bool) -> list[list[int]]:
    """The rows of a batch as the waves that sample together: with overlap the first half (rounded up) and the
    second half, whose steps run while the other samples; without, one wave of every row. Empty waves dropped."""
    half = (batch_size + 1) // 2 if overlap else batch_size
    return [rows for rows in (list(range(half)), list(range(half, batch_size))) if rows]


@dataclass
class WaveRun:
    """Where one wave is: its rows still to sample (emptied once it is done), turns sampled, the rows of its
    last turn and their ids, the messages stepped and the steps in flight (a concurrent future)."""

    rows: list[int]
    turns: int = 0
    sampled: list[int] = field(default_factory=list)
    last: dict[int, list[int]] = field(default_factory=dict)
    stepped: dict[int, Message] = field(default_factory=dict)
    stepping: Any = None


class StepRunner:
    """An event loop in a daemon thread of its own: the environments' coroutines run there, while the calling
    thread samples. ``submit`` returns a concurrent future; ``wait`` its result (or what it raised)."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="ppo-env-steps")
        self.thread.start()
        self.pending: set = set()

    def submit(self, coroutine):
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        self.pending.add(future)
        return future

    def wait(self, future):
        try:
            return future.result()
        finally:
            self.pending.discard(future)

    def run(self, coroutine):
        return self.wait(self.submit(coroutine))

    def stop(self, closing) -> None:
        """Steps still in flight (the batch stopped early: an error) cancelled, then ``closing`` run, then the
        loop stopped. A sync call past its deadline is abandoned in its own daemon thread (calls.call_bounded)."""
        try:
            for future in list(self.pending):
                future.cancel()
            self.run(closing)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join()
            self.loop.close()
