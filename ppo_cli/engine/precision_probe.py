"""Time one of the model's Linear layers in float32 and under bf16 autocast, once per machine.

Whether bf16 autocast is faster on a CPU is not a property of its flags: an AMD EPYC with AVX512-BF16
ran a 0.5B-shape PPO update 1.67x faster in bf16, an Intel Xeon with AVX512-BF16 (no AMX) 1.68x
slower. So ``train.mixed_precision: auto`` asks the machine: this module measures, ``precision.py``
decides. The answer is cached in a small JSON file keyed by everything it depends on (CPU model and
its bf16/AMX flags, torch version, thread count, the layer shapes), so a machine probes each shape once.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CACHE_ENV = "PPO_CLI_CACHE_DIR"
CACHE_FILE = "precision_probe.json"
# The flags that decide how fast bf16 runs on x86 (oneDNN's bf16 kernels use these).
RELEVANT_FLAGS = ("avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_tile")
UPDATE_ROWS = 256  # tokens in one update micro-batch row block: compute-bound like the update's matmuls
DECODE_ROWS = 4  # a decode step: one token per sequence, memory-bound like generation
# Fewer rows for wide models so the probe stays short (0.3 s at 0.5B widths on 2 cores; about 2 s at
# 7B widths, once per machine), but not below 64: fewer rows would make the matmul memory-bound.
MAX_UPDATE_FLOPS = 2e9
REPEATS = 5


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


def _best_ms(step, repeats: int) -> float:
    step()  # warm-up: oneDNN picks and caches its kernel on the first call
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


@torch.no_grad()
def run_probe(hidden: int, intermediate: int, repeats: int = REPEATS) -> ProbeResult:
    """Time Linear(hidden -> intermediate) on CPU in float32 and under bf16 autocast.

    Update-shaped: ``update_rows`` tokens, autocast entered per call (the update's forward casts each
    weight once per micro-batch). Decode-shaped: DECODE_ROWS tokens inside one autocast region (generation
    casts each weight once and reuses the copy for every token).
    """
    generator = torch.Generator().manual_seed(0)
    rows = update_rows(hidden, intermediate)
    layer = torch.nn.Linear(hidden, intermediate, bias=False, device="meta")
    # Constant weights: matmul time does not depend on the values, and random init of a 7B-wide layer
    # would cost more than the probe. A leaf that requires grad, as autocast caches casts only of those.
    layer.weight = torch.nn.Parameter(torch.full((intermediate, hidden), 0.01))
    x_update = torch.randn(rows, hidden, generator=generator)
    x_decode = torch.randn(DECODE_ROWS, hidden, generator=generator)

    def update(enabled: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            layer(x_update)

    def decode_ms(enabled: bool) -> float:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
            return _best_ms(lambda: layer(x_decode), repeats)

    return ProbeResult(
        fp32_update_ms=_best_ms(lambda: update(False), repeats),
        bf16_update_ms=_best_ms(lambda: update(True), repeats),
        fp32_decode_ms=decode_ms(False), bf16_decode_ms=decode_ms(True),
        update_flops=2.0 * rows * hidden * intermediate, cpu=machine().cpu,
    )


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
                       "threads": torch.get_num_threads(), "shape": [hidden, intermediate]}, sort_keys=True)


def cached_probe(hidden: int, intermediate: int, probe=None) -> ProbeResult:
    """``probe(hidden, intermediate)`` (run_probe), measured once per cache_key, then read from the cache file.

    The file is locked while probing, so the processes of one multi-process run probe once and agree.
    """
    path = cache_dir() / CACHE_FILE
    key = cache_key(hidden, intermediate)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        _lock(lock)
        entries = _read(path)
        if key in entries:
            return ProbeResult(**entries[key])
        result = (probe or run_probe)(hidden, intermediate)
        entries[key] = asdict(result)
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
