"""The CPU probe behind train.mixed_precision auto: what it measures, and its per-machine cache."""

import json

import pytest
import torch

from ppo_cli.engine import precision_probe
from ppo_cli.engine.precision_probe import Machine, ProbeResult, cached_probe, machine, run_probe, update_rows


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PPO_CLI_CACHE_DIR", str(tmp_path))
    return tmp_path / "precision_probe.json"


class CountingProbe:
    def __init__(self):
        self.calls = []

    def __call__(self, hidden, intermediate):
        self.calls.append((hidden, intermediate))
        return ProbeResult(8.0, 14.0, 0.8, 0.5, update_flops=2.0 * 256 * hidden * intermediate, cpu="Test CPU")


def test_real_probe_returns_positive_timings_and_the_update_flops():
    result = run_probe(96, 384)
    timings = (result.fp32_update_ms, result.bf16_update_ms, result.fp32_decode_ms, result.bf16_decode_ms)
    assert all(t > 0 for t in timings)
    assert result.update_flops == 2 * 256 * 96 * 384
    assert result.peak_flops("no") == pytest.approx(result.update_flops / (result.fp32_update_ms / 1e3))


def test_probe_step_adds_the_update_and_decode_shapes_and_peak_uses_the_update_shape():
    result = ProbeResult(8.0, 4.0, 1.0, 0.5, update_flops=1e9, cpu="Test CPU")
    assert (result.fp32_ms, result.bf16_ms) == (9.0, 4.5)
    assert (result.peak_flops("no"), result.peak_flops("bf16")) == (1.25e11, 2.5e11)  # 1e9 FLOPs / 8 ms, / 4 ms


def test_update_rows_shrink_for_wide_models_but_not_below_64():
    assert update_rows(896, 4864) == 128  # 256 rows would be 2.2 GFLOPs, above MAX_UPDATE_FLOPS (2e9)
    assert update_rows(96, 384) == 256
    assert update_rows(8192, 28672) == 64


def test_cache_is_reused_and_the_probe_runs_once(cache):
    probe = CountingProbe()
    first = cached_probe(96, 384, probe)
    assert cached_probe(96, 384, probe) == first
    assert probe.calls == [(96, 384)]
    assert len(json.loads(cache.read_text())) == 1
    cached_probe(128, 512, probe)  # another shape is another entry
    assert probe.calls == [(96, 384), (128, 512)]


@pytest.mark.parametrize("change", ["cpu", "flags", "torch", "threads"])
def test_cache_misses_when_the_machine_or_torch_changes(cache, monkeypatch, change):
    probe = CountingProbe()
    here = Machine("Test CPU", ("avx512f", "avx512_bf16"))
    monkeypatch.setattr(precision_probe, "machine", lambda: here)
    cached_probe(96, 384, probe)
    if change == "cpu":
        monkeypatch.setattr(precision_probe, "machine", lambda: Machine("Other CPU", here.flags))
    elif change == "flags":
        monkeypatch.setattr(precision_probe, "machine", lambda: Machine(here.cpu, here.flags + ("amx_bf16",)))
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", "99.0.0")
    else:
        monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    cached_probe(96, 384, probe)
    assert len(probe.calls) == 2


def test_a_damaged_cache_file_is_measured_again(cache):
    cache.write_text("{not json")
    probe = CountingProbe()
    cached_probe(96, 384, probe)
    assert probe.calls == [(96, 384)] and len(json.loads(cache.read_text())) == 1


def test_machine_reads_the_cpu_name_and_only_the_bf16_relevant_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum\n"
                       "flags\t\t: fpu sse avx512f avx512_bf16 avx512_fp16 avx_vnni\n"
                       "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Platinum\nflags\t\t: fpu\n")
    assert machine(cpuinfo) == Machine("Intel(R) Xeon(R) Platinum", ("avx512f", "avx512_bf16", "avx512_fp16", "avx_vnni"))
    assert machine(cpuinfo).describe() == "Intel(R) Xeon(R) Platinum (avx512f, avx512_bf16, avx512_fp16, avx_vnni)"
