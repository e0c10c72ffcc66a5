"""Several processes through accelerate: which process this is, and the few collectives PPO needs.

Launch with `accelerate launch -m ppo_cli train RECIPE` (or `ppo train RECIPE --num-processes N`).
Each process samples its own slice of the prompts; statistics that PPO normalises by (advantage and
reward whitening) and every logged metric are computed over the global batch; only the main process
writes files. With one process every collective is the identity, so single-process runs are unchanged.
"""

from __future__ import annotations

import os

import torch

from ppo_cli.launch import RECIPE_DECIDES


class Distributed:
    def __init__(self, device_name: str = "auto", mixed_precision: str = "no",
                 weights_dtype: torch.dtype = torch.float32):
        """``mixed_precision``: train.mixed_precision ('auto' is resolved here, see engine/precision.py);
        ``weights_dtype``: the policy's, for 'auto' (half-precision weights get no autocast)."""
        from accelerate import Accelerator

        from ppo_cli.engine.precision import check_mixed_precision, resolve_mixed_precision

        # On a CPU-only machine accelerate needs cpu=True to pick gloo for several processes.
        cpu = device_name == "cpu" or not torch.cuda.is_available()
        device = torch.device("cpu" if cpu else "cuda")
        precision = resolve_mixed_precision(mixed_precision, device, weights_dtype, launcher_mixed_precision())
        check_mixed_precision(precision, device)
        forget_other_precision(precision)
        self.accelerator = Accelerator(cpu=cpu, mixed_precision=precision)
        # Kept here: accelerator.mixed_precision reads the process-wide state, which a later
        # Accelerator in this process may change (forget_other_precision). DeepSpeed: its config's.
        self.mixed_precision = self.accelerator.mixed_precision

    @classmethod
    def for_recipe(cls, recipe) -> "Distributed":
        """The run's processes and precision as ``recipe`` (train.device, train.mixed_precision) asks."""
        from ppo_cli.engine.models import resolve_device, resolve_dtype

        weights_dtype = resolve_dtype(recipe.policy.dtype, resolve_device(recipe.train.device))
        return cls(recipe.train.device, recipe.train.mixed_precision, weights_dtype)

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def wait(self) -> None:
        self.accelerator.wait_for_everyone()

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        return self.accelerator.reduce(tensor.clone(), reduction="sum")

    def mean_of(self, value: float) -> float:
        """The mean of a per-process number over all processes."""
        if self.world_size == 1:
            return value
        return float(self.reduce_sum(torch.tensor(value, dtype=torch.float64, device=self.device))) / self.world_size

    def any(self, flag: bool) -> bool:
        if self.world_size == 1:
            return flag
        return bool(self.reduce_sum(torch.tensor(float(flag), device=self.device)) > 0)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate (B, ...) tensors of every process along dim 0 (padding dim 1 when it differs)."""
        if self.world_size == 1:
            return tensor
        if tensor.dim() > 1:
            tensor = self.accelerator.pad_across_processes(tensor, dim=1)
        return self.accelerator.gather(tensor.contiguous())

    def gather_objects(self, obj) -> list:
        """[obj of process 0, obj of process 1, ...] on every process."""
        if self.world_size == 1:
            return [obj]
        from accelerate.utils import gather_object

        return gather_object([obj])


def forget_other_precision(mixed_precision: str) -> None:
    """Let a new Accelerator take ``mixed_precision`` although an earlier one in this process chose another.

    accelerate keeps its settings in a process-wide singleton (AcceleratorState) and refuses a second
    Accelerator with another precision. Each run of ours builds its own Accelerator, and the tests,
    benchmarks and notebooks run several in one process. Clearing only AcceleratorState keeps the
    process state (PartialState: ranks, process group); models prepared earlier keep the autocast
    they were prepared with (accelerate builds it at prepare time).
    """
    from accelerate.state import AcceleratorState

    current = AcceleratorState._shared_state.get("_mixed_precision")
    if current is not None and current != mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)


def launcher_mixed_precision() -> str | None:
    """The precision an accelerate launcher set for this process (`accelerate launch --mixed_precision`,
    or the config of `ppo train --accelerate-config FILE`), or None when nobody launched it so. Our own
    `ppo train --num-processes N` leaves the choice to the recipe (launch.py sets RECIPE_DECIDES)."""
    if os.environ.get(RECIPE_DECIDES):
        return None
    value = os.environ.get("ACCELERATE_MIXED_PRECISION")
    return value.lower() if value else None

