"""Several processes through accelerate: which process this is, and the few collectives PPO needs.

Launch with `accelerate launch -m ppo_cli train RECIPE` (or `ppo train RECIPE --num-processes N`).
Each process samples its own slice of the prompts; statistics that PPO normalises by (advantage and
reward whitening) and every logged metric are computed over the global batch; only the main process
writes files. With one process every collective is the identity, so single-process runs are unchanged.
"""

from __future__ import annotations

import torch


class Distributed:
    def __init__(self, device_name: str = "auto"):
        from accelerate import Accelerator

        # On a CPU-only machine accelerate needs cpu=True to pick gloo for several processes.
        cpu = device_name == "cpu" or not torch.cuda.is_available()
        self.accelerator = Accelerator(cpu=cpu)

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
