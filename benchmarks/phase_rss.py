"""Resident memory and time phase by phase: a thread samples this process's RSS while hooks name the phase.

Standard library only, so that both ppo_cli's venv and TRL's import it (benchmarks/bench_vs_trl_grpo.py).
Never imported by ppo_cli or its tests.

A phase is a label (``loading``, ``sampling``, ...) set by wrapping the functions that do it
(``wrap_method``) or by ``enter``. The sampler thread reads /proc/self/statm every ``interval_s`` (torch
releases the GIL in its kernels, so it runs during them) and keeps, per (update, phase), the largest
RSS seen and the RSS when the phase last ended. A spike shorter than the interval can slip between
samples; the kernel's own high-water mark (VmHWM) cannot: when VmHWM grew while a phase ran, that
phase's peak is VmHWM exactly, and it is taken instead of the samples. Each phase's wall and process
CPU seconds are summed between the hooks' marks.
"""

from __future__ import annotations

import functools
import os
import threading
import time

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def hwm_bytes() -> int:
    """The process's peak RSS so far (VmHWM), bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class PhaseTracer:
    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.update = 0  # 0: before the first update (loading)
        self.phase = "loading"
        self.peaks: dict[tuple[int, str], int] = {}
        self.ends: dict[tuple[int, str], int] = {}
        self.seconds: dict[tuple[int, str], list[float]] = {}  # [wall, cpu]
        self._since = (time.perf_counter(), time.process_time())
        self._hwm_at_entry = hwm_bytes()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._note(rss_bytes())
            time.sleep(self.interval_s)

    def _note(self, rss: int) -> None:
        with self._lock:
            key = (self.update, self.phase)
            if rss > self.peaks.get(key, 0):
                self.peaks[key] = rss

    def enter(self, phase: str) -> str:
        """Make ``phase`` current; returns the phase it replaces."""
        rss, hwm = rss_bytes(), hwm_bytes()
        now = (time.perf_counter(), time.process_time())
        with self._lock:
            key, previous = (self.update, self.phase), self.phase
            spent = self.seconds.setdefault(key, [0.0, 0.0])
            spent[0] += now[0] - self._since[0]
            spent[1] += now[1] - self._since[1]
            self._since = now
            self.peaks[key] = max(self.peaks.get(key, 0), rss, hwm if hwm > self._hwm_at_entry else 0)
            self.ends[key] = rss
            self.phase, self._hwm_at_entry = phase, hwm
            new = (self.update, phase)
            self.peaks[new] = max(self.peaks.get(new, 0), rss)
        return previous

    def next_update(self) -> None:
        self.enter("other")
        with self._lock:
            self.update += 1
            self.phase = "other"

    def wrap_method(self, owner, name: str, phase: str, unless: tuple[str, ...] = ()) -> None:
        """Replace ``owner.name`` (a class or module attribute) by a wrapper that runs it as ``phase``
        (and restores the phase it interrupted); not where the current phase is in ``unless``."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if self.phase in unless:
                return original(*args, **kwargs)
            previous = self.enter(phase)
            try:
                return original(*args, **kwargs)
            finally:
                self.enter(previous)

        setattr(owner, name, wrapper)

    def hook_optimizer_steps(self) -> None:
        """Every torch optimizer's step, whichever tool calls it, as ``optimizer step``."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        state = {}
        register_optimizer_step_pre_hook(lambda *a: state.__setitem__("previous", self.enter("optimizer step")))
        register_optimizer_step_post_hook(lambda *a: self.enter(state.pop("previous", "other")))

    def stop(self) -> None:
        self.enter(self.phase)
        self._stop.set()
        self._thread.join()

    def table(self) -> dict:
        """{update: {phase: {"peak_gb", "end_gb", "wall_s", "cpu_s"}}}, JSON-ready (updates as strings)."""
        out: dict[str, dict] = {}
        for (update, phase), peak in sorted(self.peaks.items()):
            wall, cpu = self.seconds.get((update, phase), (0.0, 0.0))
            out.setdefault(str(update), {})[phase] = {"peak_gb": peak / 1e9,
                                                       "end_gb": self.ends.get((update, phase), 0) / 1e9,
                                                       "wall_s": wall, "cpu_s": cpu}
        return out
