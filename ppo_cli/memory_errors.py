"""Running out of memory or disk, said as one line: where it happened and what to change.

An allocation failure is not a bug of ours: the recipe asked for more memory than the machine has.
``phase`` names the part of training that ran out; `ppo train` adds what ``ppo plan`` expected
and the first change that brings its estimate under the machine's memory (commands/train.py).
"""

from __future__ import annotations

import contextlib
import errno
import sys
from pathlib import Path

from ppo_cli.errors import CheckpointError, PpoError, first_line

_ALLOCATOR_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory", "failed to allocate")


class OutOfMemory(PpoError):
    """An allocation failed (CUDA or the CPU allocator) during ``phase``."""

    def __init__(self, phase: str, detail: str = "", hint: str | None = None):
        self.phase, self.detail = phase, detail
        super().__init__(f"out of memory while {phase}{': ' + detail if detail else ''}", hint=hint)


def is_out_of_memory(err: BaseException) -> bool:
    if isinstance(err, MemoryError):
        return True
    torch = sys.modules.get("torch")  # no torch loaded: no torch allocation failed
    if torch is not None and isinstance(err, torch.OutOfMemoryError):  # CUDA and other accelerators
        return True
    return isinstance(err, RuntimeError) and any(m in str(err).lower() for m in _ALLOCATOR_MESSAGES)


@contextlib.contextmanager
def phase(name: str):
    """Turn an allocation failure inside the block into OutOfMemory(``name``)."""
    try:
        yield
    except OutOfMemory:
        raise
    except BaseException as err:
        if is_out_of_memory(err):
            raise OutOfMemory(name, first_line(err)) from err
        raise


def machine_memory_gb(device) -> float | None:
    """The memory the run could have had: the GPU's, or the machine's RAM on CPU."""
    import torch

    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


@contextlib.contextmanager
def disk_space_for(target: Path, keeps: str):
    """Turn a full disk while writing ``target`` into one line saying what is still intact."""
    try:
        yield
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CheckpointError(
                f"no space left on the device while writing {target}; {keeps}",
                hint=f"free space on {target.parent} (or lower train.keep_checkpoints), then `ppo train RECIPE --resume`",
            ) from err
        raise
