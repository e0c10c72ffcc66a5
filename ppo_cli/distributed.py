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


# --- FSDP2: parameters, gradients and optimizer states sharded across the processes -------------
#
# Asked for by an accelerate config with `distributed_type: FSDP` and `fsdp_version: 2`
# (recipes/accelerate/fsdp.yaml). Everything here is a no-op for one process and for DDP, so those
# paths are unchanged. What PPO needs besides accelerate's prepare:
#  - frozen whole models (the full fine-tune's reference copy, a frozen value model that may be the
#    reward model's) stay out of the sharded module: they are called directly, outside its forward;
#  - the rollout calls the causal LM directly (generate, log-probs, values), so FSDP's root forward
#    hook never runs and parameters outside a wrapped block would stay sharded: rollout_parameters()
#    gathers those, and each block gathers its own in its forward (train.fsdp_rollout: per_block), or
#    it gathers them all once (gathered: one all-gather per block per rollout, the whole policy held);
#  - checkpoints and final/ hold the full, gathered state of what trains (collectives: every process
#    calls them); a LoRA run gathers its adapters and head, never the frozen base.


def fsdp_requested() -> bool:
    """Did `accelerate launch` (its config or flags) ask for FSDP?"""
    import os

    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def enable_fsdp_on_cpu(accelerator) -> None:
    """Turn on the FSDP the launch config asked for, on a machine without CUDA.

    accelerate 1.15 (state.py) switches to FSDP only for GPU-like devices: with cpu=True (gloo) it
    stays MULTI_CPU and silently ignores the config's FSDP section, so each process would train a
    whole copy (DDP). PyTorch's FSDP2 itself runs on CPU over gloo, so set the state as accelerate
    does on GPUs. FSDP1 (fsdp_version: 1) is not supported by ppo_cli.
    """
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* variables accelerate launch sets
    check_fsdp_version(plugin.fsdp_version)
    if accelerator.num_processes > 1:
        from accelerate.state import PartialState

        accelerator.state.fsdp_plugin = plugin
        accelerator.state.distributed_type = DistributedType.FSDP
        # Every AcceleratorState() copies PartialState's fields over its own; accelerate keeps both
        # in step the same way at the end of AcceleratorState.__init__.
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def check_fsdp_version(version: int) -> None:
    if version != 2:
        from ppo_cli.errors import UsageError

        raise UsageError(f"the accelerate config asks for FSDP version {version}; ppo_cli supports FSDP2 only",
                         hint="set fsdp_config.fsdp_version: 2 (see recipes/accelerate/fsdp.yaml)")


def fsdp_mixed_precision_policy(mixed_precision: str):
    """FSDP2's MixedPrecisionPolicy for train.mixed_precision as resolved ('no', 'bf16', 'fp16').

    Under bf16/fp16 each unit's parameters are all-gathered in that dtype (half the bytes of float32 per
    gathered block and per all-gather), which is the dtype autocast would compute their matmuls in anyway;
    gradients are reduce-scattered in float32 into float32 shards, so the sharded parameters (a LoRA
    run's adapters: its master weights), their gradients and the optimizer states stay float32. 'no'
    casts nothing. accelerate 1.15 gives GPU runs (param_dtype, reduce_dtype, output_dtype) all in the
    half dtype, and CPU runs (enable_fsdp_on_cpu) no policy at all: this one replaces both.
    Forward inputs are not cast (cast_forward_inputs): the forwards run under autocast, which casts what
    the matmuls read, and the root's inputs include a frozen critic's float32 features that the value
    head reads in float32, as under DDP.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    if compute is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32, cast_forward_inputs=False)


def shard_in_float32(module: torch.nn.Module) -> None:
    """FSDP2 over ``module`` as a unit of its own that gathers its parameters as stored (float32).

    For the value head: values_from_hidden runs it in float32 inside the autocast forward (bf16 rounds
    values of +-10 by ~0.04); gathered in bf16 with the root unit, its weight would be bf16 there.
    Call before the optimizer is made: fully_shard replaces the module's parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fully_shard(module, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))


def _take_sharded_parameters(optimizer) -> list:
    """Remove the parameters already sharded (DTensors: shard_in_float32's value head) from ``optimizer``'s
    groups; [(group index, position, parameter)]. accelerate 1.15's prepare swaps each optimizer parameter
    for its sharded one by matching data pointers, which fails for DTensors (an empty shard's pointer is 0,
    so weight and bias collide; measured: "A parameter in the optimizer couldn't be switched to its
    sharded version"); these need no swap, so they sit out the prepare and go back after."""
    from torch.distributed.tensor import DTensor

    taken = []
    for index, group in enumerate(optimizer.param_groups):
        taken += [(index, position, p) for position, p in enumerate(group["params"]) if isinstance(p, DTensor)]
        group["params"] = [p for p in group["params"] if not isinstance(p, DTensor)]
    return taken


def _put_back_parameters(optimizer, taken: list) -> None:
    """Inverse of _take_sharded_parameters, each parameter at its place (positions ascending per group)."""
    for index, position, param in taken:
        optimizer.param_groups[index]["params"].insert(position, param)


def _is_frozen_model(module: torch.nn.Module) -> bool:
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel) and not any(p.requires_grad for p in module.parameters())


@contextlib.contextmanager
def without_frozen_models(module: torch.nn.Module):
    """Detach whole frozen transformers models from ``module``'s tree for the block (put back after)."""
    detached = []
    stack = [module]
    while stack:
        parent = stack.pop()
        for name, child in list(parent.named_children()):
            if _is_frozen_model(child):
                detached.append((parent, name, child))
                del parent._modules[name]
            else:
                stack.append(child)
    try:
        yield
    finally:
        for parent, name, child in reversed(detached):
            parent._modules[name] = child


def _fsdp_units(model: torch.nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered_parameters(model: torch.nn.Module, per_block: bool = False):
    """Every FSDP unit of ``model`` unsharded (full parameters on every process) for the block.

    Collective: every process enters it. Inside, forwards of the model's parts need no communication
    (a process may run one alone, e.g. the main process's evaluation).

    ``per_block``: only the root unit (what no block holds: embeddings, final norm, value head) is
    unsharded; each block all-gathers its weights in its own forward and frees them after. Every
    process must then run the same forwards: generate() runs in step (transformers' synced_gpus,
    which it turns on for a model marked as FSDP-managed) until every process has finished.
    """
    from ppo_cli.engine.generate import DECODE_IN_STEP

    units = [model] if per_block else _fsdp_units(model)
    # FSDP2 takes the first module to run forward as its root; the rollout runs the blocks before any
    # forward of the root, so settle the root first (torch 2.13: private, no public equivalent).
    model._get_fsdp_state()._lazy_init()
    # Blocks reshard after their forward by default (set_reshard_after_forward): keep them whole
    # until the block ends. Each unit's previous setting, to put back.
    reshards = [any(group._reshard_after_forward for group in unit._get_fsdp_state()._fsdp_param_groups)
                for unit in units]
    if per_block:
        # FSDP allocates a unit's gathered tensors at its first unshard; a first unshard inside the
        # rollout's torch.inference_mode (a value model's forward) would make them inference tensors,
        # which the update's all-gathers could not write into. Allocate them here, one unit at a time.
        for unit in _fsdp_units(model):
            unit.unshard()
            unit.reshard()
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    managed = _marked_fsdp_managed(model) if per_block else []
    try:
        yield
    finally:
        for module in managed:
            delattr(module, DECODE_IN_STEP)  # the attribute _marked_fsdp_managed set
        for unit, reshard in zip(units, reshards):
            unit.reshard()
            unit.set_reshard_after_forward(reshard, recurse=False)


def _marked_fsdp_managed(model: torch.nn.Module) -> list:
    """Mark the transformers models under ``model`` so that generate() steps in sync across processes
    (engine/generate.py passes synced_gpus for a marked model). Returns the modules marked."""
    from transformers import PreTrainedModel

    from ppo_cli.engine.generate import DECODE_IN_STEP

    marked = [m for m in model.modules() if isinstance(m, PreTrainedModel) and not hasattr(m, DECODE_IN_STEP)]
    for module in marked:
        setattr(module, DECODE_IN_STEP, True)
    return marked


# --- FSDP2: frozen reward models sharded too ----------------------------------------------------
#
# A reward model is frozen and only scores, but whole it is as large as the policy on every process
# (at the 0.5B shape 1.43 of the 3.95 GB each process peaked at, docs/benchmarks.md). Sharded block
# by block like the policy, each process holds 1/N of it and one block whole while scoring. Its
# forwards are then collectives: every process runs as many as the process with the most batches.


def reward_model_blocks(model: torch.nn.Module) -> list:
    """The decoder blocks of ``model``: its modules of the classes transformers lists in
    ``_no_split_modules`` (what accelerate's transformer-based wrap policy wraps); [] if none."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    return [module for module in model.modules() if type(module).__name__ in names]


def shard_frozen_model(model: torch.nn.Module, mixed_precision: str = "no") -> bool:
    """FSDP2 over each block of ``model`` and the model itself (the root: embeddings, final norm, head),
    gathering in the compute dtype of ``mixed_precision`` (fsdp_mixed_precision_policy). False, and the
    model left whole, where no block class is known."""
    from torch.distributed.fsdp import fully_shard

    blocks = reward_model_blocks(model)
    if not blocks:
        return False
    policy = fsdp_mixed_precision_policy(mixed_precision)
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    # Gathered buffers are allocated at a unit's first unshard: here, outside any inference_mode,
    # as gathered_parameters does for the policy.
    for unit in _fsdp_units(model):
        unit.unshard()
        unit.reshard()
    return True


class InStepScorer:
    """A reward-model scorer (engine/rewards/model.py ModelScorer) whose model is sharded: each call runs
    as many forwards as the process with the most batches (one-token forwards for the batches this
    process lacks, their outputs dropped), then reshards the root, which FSDP2 keeps whole after a
    forward. ``most_over_processes``: int -> the largest of that int over the processes (collective)."""

    def __init__(self, scorer, most_over_processes):
        self.scorer, self.most_over_processes = scorer, most_over_processes

    def __getattr__(self, name):  # everything else is the scorer's (component, model, texts, ...)
        return getattr(self.scorer, name)

    def __call__(self, prompts: list, responses: list[str]) -> list[float]:
        size = self.scorer.component.batch_size
        batches = -(-len(responses) // size)
        most = self.most_over_processes(batches)  # before any forward: each forward's all-gathers pair up across processes
        values = self.scorer(prompts, responses)
        model = self.scorer.model
        token = torch.zeros((1, 1), dtype=torch.long, device=self.scorer.device)
        with torch.no_grad():
            for _ in range(most - batches):
                model(input_ids=token, attention_mask=torch.ones_like(token))
        model.reshard()
        return values

    def take_part_without_rows(self) -> None:
        """A process with nothing to score (an empty share of the held-out prompts) still runs the forwards."""
        self([], [])


def _shares_weights_with(model: torch.nn.Module, actor_critic) -> bool:
    """Is ``model`` (or its backbone) part of the actor-critic (the frozen critic reads the reward model)?"""
    backbone = getattr(actor_critic, "value_backbone", None)
    return backbone is not None and (backbone is model or backbone is getattr(model, "base_model", None))


def full_state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Gathered whole and moved to CPU on the main process (others get an empty dict).
    return StateDictOptions(full_state_dict=True, cpu_offload=True)


class ShardingMixin:
    """Distributed's FSDP2 methods; each one the identity (or None) without sharding."""

    @property
    def shards_parameters(self) -> bool:
        return bool(self.accelerator.is_fsdp2)

    def prepare(self, model: torch.nn.Module, optimizer, *, cpu_malloc_tuning: bool):
        """accelerator.prepare(model, optimizer); with FSDP, frozen whole models stay unsharded.
        ``cpu_malloc_tuning``: the engine's option (EngineOptions): FSDP on CPU then tunes glibc malloc."""
        if not self.shards_parameters:
            return self.accelerator.prepare(model, optimizer)
        # Gathers in the compute dtype, gradients reduced in float32, on CPU as on GPUs.
        self.accelerator.state.fsdp_plugin.mixed_precision_policy = fsdp_mixed_precision_policy(self.mixed_precision)
        already_sharded = _take_sharded_parameters(optimizer)
        with without_frozen_models(model):
            prepared = self.accelerator.prepare(model, optimizer)
        _put_back_parameters(optimizer, already_sharded)
        if self.device.type == "cpu" and cpu_malloc_tuning:
            from ppo_cli.engine.malloc import release_freed_memory, return_freed_memory

            return_freed_memory()  # each block's gathered weights, freed after its forward and backward
            release_freed_memory()  # the whole weights each process loaded, now sharded
        return prepared

    def shard_reward_models(self, reward, actor_critic) -> int:
        """FSDP with several processes: shard each frozen reward model of ``reward`` (a RewardStack) block
        by block and score through InStepScorer; a quantized one, one without known blocks, or one whose
        backbone is the frozen critic's stays whole. Call before prepare() (which hands the freed whole
        weights back). Returns the models sharded."""
        if not self.shards_parameters or self.world_size == 1:
            return 0
        from transformers import PreTrainedModel

        from ppo_cli.engine.models import is_quantized

        sharded = 0
        for index, (name, weight, scorer) in enumerate(reward.scorers):
            model = getattr(scorer, "model", None)
            if (not isinstance(model, PreTrainedModel) or is_quantized(model) or _shares_weights_with(model, actor_critic)
                    or any(p.requires_grad for p in model.parameters())
                    or not shard_frozen_model(model, self.mixed_precision)):
                continue
            reward.scorers[index] = (name, weight, InStepScorer(scorer, self.max_of))
            sharded += 1
        return sharded

    def keep_value_head_in_float32(self, actor_critic) -> None:
        """FSDP whose gathers are cast (bf16/fp16): shard the actor-critic's value head first, as a float32
        unit of its own (shard_in_float32), so prepare() leaves it be. A no-op otherwise. Call before
        making the optimizer."""
        head = actor_critic.value_head
        if head is None or not self.shards_parameters or self.mixed_precision not in ("bf16", "fp16"):
            return
        shard_in_float32(head)
        actor_critic.list_trainable_again()

    def max_of(self, value: int) -> int:
        """The largest of a per-process integer over all processes (collective)."""
        if self.world_size == 1:
            return value
        import torch.distributed as torch_dist

        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.MAX)
        return int(tensor.item())

    def full_parameters(self, model: torch.nn.Module):
        """A context (entered by every process) in which ``model``'s parameters are whole on each
        process, so generation, evaluation and saving run as on one process: FSDP2 unshards its units,
        ZeRO-3 gathers the DeepSpeed engine's model; DDP, ZeRO-2 and one process shard nothing."""
        if self.shards_parameters:
            return gathered_parameters(model)
        return zero3_gathered(self.accelerator)

    def rollout_parameters(self, model: torch.nn.Module, fsdp_rollout: str = "gathered"):
        """full_parameters for the rollout, which every process runs in step: under FSDP with
        ``fsdp_rollout`` per_block, only what the blocks do not hold is gathered (see gathered_parameters)."""
        if self.shards_parameters and self.world_size > 1:
            return gathered_parameters(model, per_block=fsdp_rollout == "per_block")
        return self.full_parameters(model)

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor | None:
        """accelerator.clip_grad_norm_, the total norm as a plain tensor (FSDP returns a DTensor)."""
        norm = self.accelerator.clip_grad_norm_(parameters, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def full_model_state(self, model: torch.nn.Module, trained_only: bool = False) -> dict | None:
        """FSDP: the full state dict (names as in the unwrapped model) on the main process, {} on the
        others; None without sharding (save from the modules). Collective. ``trained_only``: only the
        parameters that train (a LoRA run's adapters and head: the frozen base is never gathered);
        the savers read frozen whole models from their modules. Frozen whole models are left out."""
        if not self.shards_parameters:
            return None
        import dataclasses

        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        options = dataclasses.replace(full_state_options(), ignore_frozen_params=trained_only)
        with without_frozen_models(model):
            return get_model_state_dict(model, options=options)

    def full_optimizer_state(self, model: torch.nn.Module, optimizer) -> dict | None:
        """FSDP: the full optimizer state, keyed by parameter name, on the main process; None without
        sharding (optimizer.state_dict() is already whole). Collective."""
        if not self.shards_parameters:
            return None
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, _unwrap_optimizer(optimizer), options=full_state_options())

    def load_full_optimizer_state(self, model: torch.nn.Module, optimizer, state: dict) -> None:
        """Inverse of full_optimizer_state: every process passes the whole state and keeps its shard."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, _unwrap_optimizer(optimizer), state,
                                 options=StateDictOptions(full_state_dict=True))


def _unwrap_optimizer(optimizer):
    """The torch optimizer under accelerate's AcceleratedOptimizer."""
    return getattr(optimizer, "optimizer", optimizer)


class Distributed(ShardingMixin):
    def __init__(self, device_name: str = "auto", mixed_precision: str = "no",
                 weights_dtype: torch.dtype = torch.float32, widths: tuple[int, int] | None = None,
                 collective_timeout_s: int | None = None, resumed_precision: str | None = None):
        """``mixed_precision``: train.mixed_precision ('auto' is resolved here, see engine/precision.py;
        ``resumed_precision``: what a resumed run's checkpoint recorded, which 'auto' keeps);
        ``weights_dtype``: the policy's, for 'auto' (half-precision weights get no autocast); ``widths``:
        the policy's (hidden, intermediate), where the CPU probe measures (None: no probe);
        ``collective_timeout_s``: the process group's timeout (train.collective_timeout_s), None: the backend's."""
        from accelerate import Accelerator

        from ppo_cli.engine.precision import PrecisionChoice, check_mixed_precision, resolve_mixed_precision

        # On a CPU-only machine accelerate needs cpu=True to pick gloo for several processes.
        cpu = device_name == "cpu" or not torch.cuda.is_available()
        if launched_with_deepspeed():
            init_processes(False, collective_timeout_s, **deepspeed_init_kwargs())
            # DeepSpeed casts the engine's model itself, as its accelerate config says (mixed_precision).
            self.accelerator = Accelerator(**deepspeed_accelerator_kwargs())
            load_models_whole(self.accelerator.state.deepspeed_plugin)
            self.mixed_precision = self.accelerator.mixed_precision
            self.precision = PrecisionChoice(mixed_precision, self.mixed_precision, "the DeepSpeed config")
            return
        init_processes(cpu, collective_timeout_s)
        device = torch.device("cpu" if cpu else "cuda")
        self.precision = resolve_mixed_precision(mixed_precision, device, weights_dtype, launcher_mixed_precision(), widths,
                                                 resumed_precision)
        check_mixed_precision(self.precision.value, device)
        forget_other_precision(self.precision.value)
        self.accelerator = Accelerator(cpu=cpu, mixed_precision=self.precision.value)
        if cpu and fsdp_requested():
            enable_fsdp_on_cpu(self.accelerator)
        # Kept here: accelerator.mixed_precision reads the process-wide state, which a later
        # Accelerator in this process may change (forget_other_precision). DeepSpeed: its config's.
        self.mixed_precision = self.accelerator.mixed_precision

    @classmethod
    def for_recipe(cls, recipe, resumed_precision: str | None = None) -> "Distributed":
        """The run's processes and precision as ``recipe`` (train.device, train.mixed_precision) asks, and a
        resumed run's checkpoint (``resumed_precision``) for 'auto'."""
        from ppo_cli.engine.models import resolve_device, resolve_dtype
        from ppo_cli.engine.precision import probe_widths

        device = resolve_device(recipe.train.device)
        return cls(recipe.train.device, recipe.train.mixed_precision, resolve_dtype(recipe.policy.dtype, device),
                   probe_widths(recipe, device), recipe.train.collective_timeout_s, resumed_precision)

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
            # accelerate pads by adding the pad value to zeros, which turns a bool tensor into int64 on
            # the processes that pad only: the all-gather would then mix dtypes (gloo aborts the run).
            tensor = self.accelerator.pad_across_processes(tensor, dim=1).to(tensor.dtype)
        return self.accelerator.gather(tensor.contiguous())

    def gather_objects(self, obj) -> list:
        """[obj of process 0, obj of process 1, ...] on every process."""
        if self.world_size == 1:
            return [obj]
        from accelerate.utils import gather_object

        return gather_object([obj])


def init_processes(cpu: bool, timeout_s: int | None, **kwargs) -> None:
    """Join the process group (a no-op for one process, or once joined) with ``timeout_s`` as every
    collective's timeout. Accelerator's InitProcessGroupKwargs cannot carry it: accelerate passes on
    only values that differ from its defaults (NCCL's 600 s), so 600 would leave gloo at its 1800 s.
    The Accelerator built next finds the process state made here and keeps it."""
    from datetime import timedelta

    from accelerate.state import PartialState

    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    PartialState(cpu=cpu, **kwargs)


# --- DeepSpeed (accelerate launch with distributed_type: DEEPSPEED) --------------------------------


def launched_with_deepspeed() -> bool:
    """`accelerate launch` with a DeepSpeed config sets this for every process it starts."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def deepspeed_init_kwargs() -> dict:
    """The process group's backend under DeepSpeed: gloo on CPU (deepspeed_accelerator_kwargs)."""
    return {} if torch.cuda.is_available() else {"backend": "gloo"}


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


def zero3_gathered(accelerator):
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


# --- mixed precision: accelerate's process-wide state ----------------------------------------------


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
    """bf16 or fp16 when an accelerate launcher asked for it (`accelerate launch --mixed_precision`, the
    config of `ppo train --accelerate-config FILE`), else None. The launcher's 'no' reads as "not set":
    accelerate writes 'no' when nothing was asked (its default, and our own `--num-processes` launch),
    so it cannot tell the recipe's 'auto' anything."""
    value = (os.environ.get("ACCELERATE_MIXED_PRECISION") or "no").lower()
    return None if value == "no" else value
