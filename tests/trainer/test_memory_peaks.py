"""Per-phase CUDA peaks: absent off CUDA, and the run's peak kept across the phases' resets."""

import pytest
import torch

from ppo_cli import memory_peaks


def test_phase_peak_off_cuda_writes_nothing():
    metrics = {}
    with memory_peaks.phase_peak(torch.device("cpu"), metrics, "memory/update_peak_gb"):
        torch.ones(1000)
    assert metrics == {}


def test_phase_peak_keeps_the_run_peak(monkeypatch):
    """A fake counter: 5 GB before the phase, reset, 2 GB in it: the phase reads 2, the run's peak stays 5."""
    counter = {"peak": 5e9}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda index=None: counter["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda index=None: counter.update(peak=0))
    monkeypatch.setattr(memory_peaks, "_run_peak_bytes", {})
    metrics = {}
    with memory_peaks.phase_peak(torch.device("cuda"), metrics, "memory/rollout_peak_gb"):
        counter["peak"] = 2e9
    assert metrics == {"memory/rollout_peak_gb": pytest.approx(2.0)}
    assert memory_peaks.run_peak_bytes() == 5e9
    counter["peak"] = 6e9  # a later peak past every phase's
    assert memory_peaks.run_peak_bytes() == 6e9
