"""Several processes through accelerate: which process this is, and the few collectives PPO needs.

Launch with `accelerate launch -m ppo_cli train RECIPE` (or `ppo train RECIPE --num-processes N`).
Each process samples its own slice of the prompts; statistics that PPO normalises by (advantage and
reward whitening) and every logged metric are computed over the global batch; only the main process
writes files. With one process every collective is the identity, so single-process runs are unchanged.
"""

from __future__ import annotations

import contextlib
import os

import torch


class Distributed:
    def __init__(self, device_name: str = "auto"):
        from accelerate import Accelerator

        if launched_with_deepspeed():
            self.accelerator = Accelerator(**deepspeed_accelerator_kwargs())
            load_models_whole(self.accelerator.state.deepspeed_plugin)
            return
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

    @property
    def uses_deepspeed(self) -> bool:
        return self.accelerator.state.deepspeed_plugin is not None

    def full_parameters(self):
        """A context (entered by every process) in which the policy's parameters are whole on each
        process: generation, evaluation and saving then run as on one process. Only ZeRO-3 shards them."""
        return full_parameters(self.accelerator)

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


# --- DeepSpeed (accelerate launch with distributed_type: DEEPSPEED) --------------------------------


def launched_with_deepspeed() -> bool:
    """`accelerate launch` with a DeepSpeed config sets this for every process it starts."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def deepspeed_accelerator_kwargs() -> dict:
    """Accelerator arguments under DeepSpeed. cpu=True would turn DeepSpeed off (accelerate 1.15,
    state.py), and without CUDA accelerate finds no backend and runs one process: on CPU, name gloo
    (DeepSpeed's CPU accelerator talks over gloo when oneCCL is not installed)."""
    if torch.cuda.is_available():
        return {}
    from accelerate.utils import InitProcessGroupKwargs

    return {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}


def load_models_whole(plugin) -> None:
    """accelerate registers its DeepSpeed config with transformers whatever zero3_init_flag says, and
    under ZeRO-3 from_pretrained then partitions every model it loads, including the frozen reward and
    reference models that no DeepSpeed engine gathers (measured: "Padding_idx must be within
    num_embeddings" in the reward model's embedding). ppo_cli loads every model whole; prepare() shards
    the policy and critic."""
    from ppo_cli.errors import UsageError

    if plugin.zero3_init_flag:
        raise UsageError("zero3_init_flag: true in the accelerate config is not supported: the frozen reference "
                         "and reward models must load whole on every process",
                         hint="set zero3_init_flag: false (prepare() still shards the policy under ZeRO-3), as in "
                              "recipes/accelerate/deepspeed_zero3.yaml")
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


def deepspeed_batch_settings(micro_batch_size: int, world_size: int, max_grad_norm: float | None) -> dict:
    """The DeepSpeed config values PPO fixes itself. accelerate fills "auto" batch sizes from a
    DataLoader, and ppo_cli prepares none, so they come from the recipe. ppo_cli accumulates
    micro-batches itself (and tells DeepSpeed where a mini-batch ends), so DeepSpeed's own
    accumulation is 1. DeepSpeed clips inside its step: clip as optim.max_grad_norm says (0 = never)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "train_batch_size": micro_batch_size * world_size,
        "gradient_clipping": float(max_grad_norm or 0.0),
    }


def configure_deepspeed(accelerator, micro_batch_size: int, max_grad_norm: float | None) -> None:
    """Write deepspeed_batch_settings into the DeepSpeed plugin's config before ``prepare()``; a
    no-op without DeepSpeed. The recipe wins over values the accelerate config wrote."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return
    plugin.deepspeed_config.update(deepspeed_batch_settings(micro_batch_size, accelerator.num_processes, max_grad_norm))
    # accelerate copies the plugin's accumulation steps into its own; keep both at 1.
    accelerator.gradient_accumulation_steps = 1


def deepspeed_zero_stage(accelerator) -> int:
    plugin = accelerator.state.deepspeed_plugin
    return 0 if plugin is None else int(plugin.zero_stage or 0)


def full_parameters(accelerator):
    """ZeRO-3: gather the whole model on every process and lift DeepSpeed's per-layer fetch hooks
    for the duration (DeepSpeed's unwrap_model_for_generation, as TRL does); else nothing to do."""
    wrapped = getattr(accelerator, "deepspeed_engine_wrapped", None)
    if deepspeed_zero_stage(accelerator) < 3 or wrapped is None:
        return contextlib.nullcontext()
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

    return unwrap_model_for_generation(wrapped.engine)


def mark_accumulation_boundary(accelerator, is_last_micro_batch: bool) -> None:
    """Under DeepSpeed, accelerator.backward() also steps the optimizer whenever accelerate's
    sync_gradients is set; PPO steps once per mini-batch, after its last micro-batch. (The same
    private setter transformers' Trainer uses.) A no-op without DeepSpeed."""
    if accelerator.state.deepspeed_plugin is not None:
        accelerator.gradient_state._set_sync_gradients(is_last_micro_batch)
