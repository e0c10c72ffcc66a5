"""Peak CUDA memory per phase of an update (the rollout, the update), without losing the run's peak.

torch keeps one peak counter per device; a phase resets it and reads it back, and the run's peak is
the largest of what each phase read and the counter now. Off CUDA nothing is measured (the resident
set's peak cannot be reset), and the metrics are absent rather than zero.
"""

from __future__ import annotations

import contextlib

import torch

_run_peak_bytes: dict[int, int] = {}  # device index -> the largest peak read before a reset


@contextlib.contextmanager
def phase_peak(device: torch.device, metrics: dict[str, float], key: str):
    """Write the block's peak allocated CUDA memory, in GB, to ``metrics[key]``."""
    if device.type != "cuda":
        yield
        return
    index = device.index or 0
    _run_peak_bytes[index] = max(_run_peak_bytes.get(index, 0), torch.cuda.max_memory_allocated(index))
    torch.cuda.reset_peak_memory_stats(index)
    try:
        yield
    finally:
        peak = torch.cuda.max_memory_allocated(index)
        _run_peak_bytes[index] = max(_run_peak_bytes[index], peak)
        metrics[key] = peak / 1e9


def run_peak_bytes(index: int = 0) -> int:
    """The run's peak allocated CUDA memory on device ``index`` so far, phases reset or not."""
    return max(_run_peak_bytes.get(index, 0), torch.cuda.max_memory_allocated(index))
