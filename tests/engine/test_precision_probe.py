"""The CPU probe behind train.mixed_precision auto: what it measures, and its per-machine cache."""

import json
from types import SimpleNamespace

import pytest
import torch

from ppo_cli.engine import precision_probe
from ppo_cli.engine.precision_probe import (
    Machine,
    ProbeResult,
    cache_key,
    cached_probe,
    interleaved_best_ms,
    machine,
    quiet,
    run_probe,
    update_rows,
)


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """A fresh cache directory; no load average, so every probe is trusted (this machine's load would not be)."""
    monkeypatch.setenv("PPO_CLI_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(precision_probe, "load_average", lambda: None)
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


def test_steps_take_turns_and_each_keeps_its_best():
    order = []

    def step(name, seconds):
        times = iter(seconds)
        return lambda: order.append(name) or next(times)

    best = interleaved_best_ms({"fp32": step("fp32", [9.0, 0.004, 0.001, 0.003]),
                                "bf16": step("bf16", [9.0, 0.002, 0.005, 0.006])}, repeats=3)
    assert order == ["fp32", "bf16"] * 4  # one warm-up each (9 s, not counted), then three turns
    assert best == pytest.approx({"fp32": 1.0, "bf16": 2.0})


def test_run_probe_alternates_float32_and_bf16_step_by_step():
    # A clock that advances by these milliseconds between its calls: each timed call reads it twice.
    warm_up, first, second = [50, 50, 50, 50], [4, 1, 8, 2], [3, 5, 6, 7]
    ticks, now = [], 0.0
    for ms in warm_up + first + second:
        ticks += [now, now + ms / 1e3]
        now += ms / 1e3
    clock = iter(ticks)
    result = run_probe(96, 384, repeats=2, clock=lambda: next(clock))
    # Turns of (fp32 update, bf16 update, fp32 decode, bf16 decode): each keeps the better of its two.
    # All fp32 repeats first would have given 1, 2, 6, 3.
    timings = (result.fp32_update_ms, result.bf16_update_ms, result.fp32_decode_ms, result.bf16_decode_ms)
    assert timings == pytest.approx((3.0, 1.0, 6.0, 2.0))


@pytest.mark.parametrize("threads, load, cores, expected", [
    (2, 0.3, 2, True),  # idle 2-core machine, torch on both cores
    (2, 1.0, 2, False),  # one core busy elsewhere: a 2-thread matmul waits for its descheduled thread
    (1, 1.0, 2, True),  # one thread on the core left over
    (1, 3.5, 2, False),
    (8, 7.5, 16, True),
    (2, None, 2, True),  # no load average (Windows): trusted, as before
])
def test_quiet_when_the_load_leaves_the_threads_their_cores(threads, load, cores, expected):
    assert quiet(threads, load, cores) is expected


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


def test_a_busy_machine_answer_is_kept_only_provisionally(cache, monkeypatch):
    # The machine the old probe's entries came from: 2 threads on 2 cores, with other work on them.
    monkeypatch.setattr(precision_probe, "load_average", lambda: 3.5)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(precision_probe.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(precision_probe, "time", SimpleNamespace(time=lambda: 1000.0))
    busy = ProbeResult(44.0, 0.105, 0.012, 0.029, update_flops=1e9, cpu="Test CPU")
    assert cached_probe(96, 384, lambda *_: busy) == busy  # this run uses it
    stored = json.loads(cache.read_text())[cache_key(96, 384)]
    assert stored["provisional_until"] == 1000.0 + precision_probe.PROVISIONAL_S
    # The run's other processes, probing a moment later, take the same answer...
    probe = CountingProbe()
    assert cached_probe(96, 384, probe) == busy and probe.calls == []
    # ...and a run after PROVISIONAL_S on a quiet machine measures again and keeps that for good.
    monkeypatch.setattr(precision_probe, "time", SimpleNamespace(time=lambda: 1000.0 + 601))
    monkeypatch.setattr(precision_probe, "load_average", lambda: 0.2)
    assert cached_probe(96, 384, probe).fp32_update_ms == 8.0 and probe.calls == [(96, 384)]
    assert "provisional_until" not in json.loads(cache.read_text())[cache_key(96, 384)]
    assert cached_probe(96, 384, probe).fp32_update_ms == 8.0 and len(probe.calls) == 1


def test_an_entry_of_the_first_probe_version_is_measured_again(cache):
    old_key = json.loads(cache_key(96, 384))
    del old_key["probe"]  # version 1 keys had no probe version
    old = ProbeResult(44.0, 0.105, 0.012, 0.029, update_flops=18874368.0, cpu="Test CPU")
    cache.write_text(json.dumps({json.dumps(old_key, sort_keys=True): old.__dict__}))
    probe = CountingProbe()
    assert cached_probe(96, 384, probe).fp32_update_ms == 8.0
    assert probe.calls == [(96, 384)]
    assert json.loads(cache_key(96, 384))["probe"] == 2
