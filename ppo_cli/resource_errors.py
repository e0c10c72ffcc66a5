"""Running out of memory or disk, said as one line: where it happened and what to change.

An allocation failure is not a bug of ours: the recipe asked for more memory than the machine has.
``phase`` names the part of training that ran out; `ppo train` adds what ``ppo plan`` expected
and the first change that brings its estimate under the machine's memory (commands/train.py).
"""

from __future__ import annotations

import contextlib
import errno
import shutil
import sys
from pathlib import Path

from ppo_cli.errors import RESUME, CheckpointError, PpoError, first_line

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


# Below this much free space a failed write is taken for a full disk: a writer that failed for another
# reason leaves the disk as it was, while one that ran out fills it to the last block.
LOW_FREE_BYTES = 64 * 2**20
_FULL = "disk full"
_TOO_LARGE = "file too large"
_WRITE_ERRNOS = {errno.ENOSPC: _FULL, errno.EDQUOT: _FULL, errno.EFBIG: _TOO_LARGE}
# torch.save's zip writer drops the errno: "[enforce fail at inline_container.cc:672] . unexpected pos
# 576 vs 534" caused by "basic_ios::clear: iostream error".
_TORCH_WRITER_FAILURES = ("inline_container.cc", "PytorchStreamWriter", "iostream error")


def _chain(err: BaseException) -> list[BaseException]:
    chain = []
    while err is not None and err not in chain:
        chain.append(err)
        err = err.__cause__ or err.__context__
    return chain


def _file_size_limit() -> int | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def write_failure(err: BaseException, directory: Path) -> str | None:
    """``_FULL`` or ``_TOO_LARGE`` when ``err`` is a write under ``directory`` that ran out of room; else None."""
    chain = _chain(err)
    for e in chain:
        if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS:
            return _WRITE_ERRNOS[e.errno]
        for code, why in _WRITE_ERRNOS.items():
            if f"(os error {code})" in str(e):  # safetensors (Rust): "No space left on device (os error 28)"
                return why
    if not any(isinstance(e, RuntimeError) and any(m in str(e) for m in _TORCH_WRITER_FAILURES) for e in chain):
        return None
    from ppo_cli.runs import nearest_existing

    if shutil.disk_usage(nearest_existing(directory)).free < LOW_FREE_BYTES:
        return _FULL
    return _TOO_LARGE if _file_size_limit() is not None else None


@contextlib.contextmanager
def disk_space_for(target: Path, keeps: str):
    """Turn a full disk (or a file size limit) while writing ``target`` into one line saying what is
    still intact. Enter it inside the block that deletes a half-written ``target``: the free space is
    read while the partial files still fill the disk."""
    try:
        yield
    except Exception as err:  # safetensors raises its own SafetensorError
        why = write_failure(err, target.parent)
        if why == _FULL:
            from ppo_cli.runs import nearest_existing

            free = shutil.disk_usage(nearest_existing(target.parent)).free
            raise CheckpointError(
                f"disk full while writing {target} ({free / 2**20:.1f} MB free); {keeps}",
                hint=f"free space on {target.parent} (or lower train.keep_checkpoints), then `{RESUME}`",
            ) from err
        if why == _TOO_LARGE:
            limit = _file_size_limit()
            cause = f"the file size limit ({limit} bytes, ulimit -f)" if limit is not None else "the file system's largest file"
            raise CheckpointError(
                f"file too large while writing {target}: over {cause}; {keeps}",
                hint="raise the limit (ulimit -f unlimited) or set output_dir on another file system, then "
                     f"`{RESUME}`",
            ) from err
        raise
