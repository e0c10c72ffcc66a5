"""Running out of memory or disk, said as one line: where it happened and what to change.

An allocation failure is not a bug of ours: the recipe asked for more memory than the machine has.
``phase`` names the part of training that ran out; ``advice_from_plan`` adds what ``ppo plan``
expected and the first change that brings its estimate under the machine's memory.
"""

from __future__ import annotations

import contextlib
import errno
import shlex
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


def advice_from_plan(err: OutOfMemory, recipe, recipe_path: Path | None, device) -> OutOfMemory:
    """``err`` with what ``ppo plan`` expected and the `ppo train` line of the first change that fits."""
    from ppo_cli.commands import plan

    try:
        result = plan.run(recipe, device=device.type)
    except PpoError:
        return err
    memory = machine_memory_gb(device)
    peak = result.estimate.total_gb
    detail = f"{err.detail}; ppo plan expects a peak of {peak:.1f} GB" + (f" on {memory:.1f} GB" if memory else "")
    budget_option = f" --gpu-memory {memory:.0f}" if memory and device.type == "cuda" else ""
    hint = f"run `ppo plan {recipe_path or 'RECIPE'}{budget_option}` for what each role needs and the changes that would fit"
    if memory is not None:
        # The estimate is within about 25% of measured peaks: ask for room below the machine's memory.
        budget = min(memory, peak) * 0.75
        fitting = [s for s in plan.suggestions(result.settings, plan.model_shapes(recipe), budget) if s.fits]
        if fitting:
            command = ["ppo", "train", str(recipe_path or "RECIPE"), *plan.set_args(fitting[0].overrides)]
            hint = f"{fitting[0].change}: {shlex.join(command)}"
    return OutOfMemory(err.phase, detail, hint=hint)


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
