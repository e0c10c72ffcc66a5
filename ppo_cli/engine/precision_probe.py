"""Time one of the model's Linear layers in float32 and under bf16 autocast, once per machine.

Whether bf16 autocast is faster on a CPU is not a property of its flags (two CPUs with AVX512-BF16 went
opposite ways: docs/benchmarks.md, "Speed per CPU"), so ``train.mixed_precision: auto`` asks the
machine: this module measures, ``precision.py`` decides. The answer is cached in a small JSON file keyed
by everything it depends on (CPU model and its bf16/AMX flags, torch version, thread count, the layer
shapes, the probe's version), so a machine probes each shape once.

The float32 and bf16 repeats alternate so that a burst of load on a busy machine slows both sides
alike, and an answer measured while the load left fewer idle cores than torch's threads is kept only
PROVISIONAL_S, since load still moves the ratio across precision.py's margin (docs/benchmarks.md,
"The probe under load"; benchmarks/bench_probe_load.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable

import torch

CACHE_ENV = "PPO_CLI_CACHE_DIR"
CACHE_FILE = "precision_probe.json"
# The flags that decide how fast bf16 runs on x86 (oneDNN's bf16 kernels use these).
RELEVANT_FLAGS = ("avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_tile")
UPDATE_ROWS = 256  # tokens in one update micro-batch row block: compute-bound like the update's matmuls
DECODE_ROWS = 4  # a decode step: one token per sequence, memory-bound like generation
# Fewer rows for wide models so the probe stays short (its cost: docs/benchmarks.md, "Speed per CPU"),
# but not below 64: fewer rows would make the matmul memory-bound.
MAX_UPDATE_FLOPS = 2e9
REPEATS = 5
PROBE_VERSION = 2  # in the cache key: entries of the probe that ran all float32 repeats first are measured again
# Load this process adds itself before it probes (imports, reading the model config) and that the
# probe can live with: above it, a probe with as many threads as cores waits on other processes.
LOAD_SLACK = 0.5
PROVISIONAL_S = 600.0  # how long a busy machine's answer is reused: by one run's processes and its launcher


@dataclass(frozen=True)
class Machine:
    """What a speed figure was measured on."""

    cpu: str  # the CPU's model name (/proc/cpuinfo), or platform.processor()
    flags: tuple[str, ...]  # its RELEVANT_FLAGS

    def describe(self) -> str:
        return f"{self.cpu} ({', '.join(self.flags) or 'no bf16/AMX flags'})"


def machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> Machine:
    """This machine's CPU model name and its bf16/AMX-relevant flags."""
    name, flags = "", set()
    with contextlib.suppress(OSError):
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return Machine(name or platform.processor() or platform.machine() or "unknown CPU",
                   tuple(f for f in RELEVANT_FLAGS if f in flags))


def machine_record() -> dict:
    """What the benchmark scripts record beside every speed figure: the CPU, its bf16/AMX flags, cores, torch
    and the GPU where there is one."""
    here = machine()
    record = {"cpu": here.cpu, "cpu_flags": list(here.flags), "cores": os.cpu_count(), "torch": torch.__version__}
    if torch.cuda.is_available():  # a GPU figure names its card
        record["gpu"] = torch.cuda.get_device_name(0)
    return record


@dataclass(frozen=True)
class ProbeResult:
    """Milliseconds per probe step (one update-shaped + one decode-shaped Linear forward), best of REPEATS."""

    fp32_update_ms: float
    bf16_update_ms: float
    fp32_decode_ms: float
    bf16_decode_ms: float
    update_flops: float  # 2 x rows x hidden x intermediate: the update-shaped forward's multiply-adds x 2
    cpu: str

    @property
    def fp32_ms(self) -> float:
        return self.fp32_update_ms + self.fp32_decode_ms

    @property
    def bf16_ms(self) -> float:
        return self.bf16_update_ms + self.bf16_decode_ms

    def peak_flops(self, mixed_precision: str) -> float:
        """FLOP/s of the update-shaped matmul in ``mixed_precision`` ('no' or 'bf16'): the measured peak MFU divides by."""
        ms = self.bf16_update_ms if mixed_precision == "bf16" else self.fp32_update_ms
        return self.update_flops / (ms / 1e3)


def update_rows(hidden: int, intermediate: int) -> int:
    """UPDATE_ROWS, halved until the update-shaped forward costs at most MAX_UPDATE_FLOPS (at least 64 rows)."""
    rows = UPDATE_ROWS
    while rows > 64 and 2 * rows * hidden * intermediate > MAX_UPDATE_FLOPS:
        rows //= 2
    return rows


def interleaved_best_ms(steps: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Each step's best of ``repeats`` timings (each step returns its own seconds), in milliseconds.

    The steps take turns (a, b, a, b, ...) after one warm-up call each (oneDNN picks and caches its
    kernel on the first call), so a burst of load on the machine slows every step alike instead of all
    the repeats of one of them."""
    for step in steps.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(step())
    return {name: min(seconds) * 1e3 for name, seconds in times.items()}


@torch.no_grad()
def run_probe(hidden: int, intermediate: int, repeats: int = REPEATS, clock=time.perf_counter) -> ProbeResult:
    """Time Linear(hidden -> intermediate) on CPU in float32 and under bf16 autocast, the two alternating.

    Update-shaped: ``update_rows`` tokens, the weight cast inside the timing (the update's forward casts
    each weight once per micro-batch). Decode-shaped: DECODE_ROWS tokens against a bf16 copy of the
    weight made once. The clock reads inside the autocast region, as before: its entry is not timed.
    """
    generator = torch.Generator().manual_seed(0)
    rows = update_rows(hidden, intermediate)
    layer = torch.nn.Linear(hidden, intermediate, bias=False, device="meta")
    # Constant weights: matmul time does not depend on the values, and random init of a 7B-wide layer
    # would cost more than the probe. A leaf that requires grad, as autocast caches casts only of those.
    layer.weight = torch.nn.Parameter(torch.full((intermediate, hidden), 0.01))
    x_update = torch.randn(rows, hidden, generator=generator)
    x_decode = torch.randn(DECODE_ROWS, hidden, generator=generator)

    # Generation casts each weight once and reuses the copy for every token: the decode step in bf16
    # gets the cast copy, which autocast's own cast then leaves alone.
    weight_bf16 = layer.weight.detach().to(torch.bfloat16)

    def timed(enabled: bool, call) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            started = clock()
            call()
            return clock() - started

    best = interleaved_best_ms({
        "fp32_update_ms": lambda: timed(False, lambda: layer(x_update)),
        "bf16_update_ms": lambda: timed(True, lambda: layer(x_update)),
        "fp32_decode_ms": lambda: timed(False, lambda: layer(x_decode)),
        "bf16_decode_ms": lambda: timed(True, lambda: torch.nn.functional.linear(x_decode, weight_bf16)),
    }, repeats)
    return ProbeResult(**best, update_flops=2.0 * rows * hidden * intermediate, cpu=machine().cpu)


def quiet(threads: int, load: float | None, cores: int) -> bool:
    """Whether a probe with ``threads`` torch threads had its cores to itself: the 1-minute ``load``
    average (None where the OS has none: trusted) plus the threads fit in ``cores`` (+ LOAD_SLACK)."""
    return load is None or load + threads <= cores + LOAD_SLACK


def load_average() -> float | None:
    """The 1-minute load average (runnable processes, this one included), None on Windows."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cache_dir() -> Path:
    """$PPO_CLI_CACHE_DIR, else $XDG_CACHE_HOME/ppo_cli, else ~/.cache/ppo_cli."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ppo_cli"


def cache_key(hidden: int, intermediate: int) -> str:
    """Everything the probe's answer depends on."""
    here = machine()
    return json.dumps({"cpu": here.cpu, "flags": list(here.flags), "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "shape": [hidden, intermediate],
                       "probe": PROBE_VERSION}, sort_keys=True)


def cached_probe(hidden: int, intermediate: int, probe=None) -> ProbeResult:
    """``probe(hidden, intermediate)`` (run_probe), measured once per cache_key, then read from the cache file.

    An answer measured on a busy machine (``quiet`` says no) is stored for PROVISIONAL_S only. The file is
    locked while probing, so the processes of one multi-process run probe once and agree.
    """
    path = cache_dir() / CACHE_FILE
    key = cache_key(hidden, intermediate)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        _lock(lock)
        entries = _read(path)
        entry = entries.get(key)
        if isinstance(entry, dict) and entry.get("provisional_until", float("inf")) > time.time():
            return ProbeResult(**{f.name: entry[f.name] for f in fields(ProbeResult)})
        result = (probe or run_probe)(hidden, intermediate)
        entries[key] = asdict(result)
        if not quiet(torch.get_num_threads(), load_average(), os.cpu_count() or 1):
            entries[key]["provisional_until"] = time.time() + PROVISIONAL_S
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=1))
        tmp.replace(path)
        return result


def _read(path: Path) -> dict:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # absent or damaged: probe again and rewrite it
    return entries if isinstance(entries, dict) else {}


def _lock(file) -> None:
    try:
        import fcntl
    except ImportError:  # Windows: no lock; at worst two processes probe
        return
    fcntl.flock(file, fcntl.LOCK_EX)
