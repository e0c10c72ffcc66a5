"""FSDP2 under mixed precision: parameters gathered in the compute dtype, gradients, shards and optimizer
states float32 (ppo_cli/distributed.py fsdp_mixed_precision_policy). The slow test trains 2 real gloo
processes with train.mixed_precision bf16 and looks at the gathered weights inside the forwards."""

import math
import os
import socket

import pytest
import torch

from ppo_cli.distributed import fsdp_mixed_precision_policy


@pytest.mark.parametrize("mixed_precision, gathered", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_fsdp_policy_gathers_in_the_compute_dtype_and_reduces_gradients_in_float32(mixed_precision, gathered):
    policy = fsdp_mixed_precision_policy(mixed_precision)
    assert policy.param_dtype is gathered
    assert policy.reduce_dtype is torch.float32  # gradients reduce-scattered into float32 shards
    assert policy.output_dtype is None  # the forward's outputs as the forward computed them
    assert policy.cast_forward_inputs is False  # autocast casts what the matmuls read; a frozen critic's features stay float32


def test_fsdp_policy_without_mixed_precision_casts_nothing():
    policy = fsdp_mixed_precision_policy("no")
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (None, None, None)


SMALL = {"ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 2, "ppo.micro_batch_size": 1, "ppo.ppo_epochs": 1,
         "generation.max_new_tokens": 6, "data.eval_prompts": "null", "train.mixed_precision": "bf16"}
PROMPTS = ["The movie was", "This phone is", "I think the book was", "Overall"]


def _dtypes_seen(kinds: dict, seen: dict):
    """A forward hook on every module: the dtype of each of its own parameters that is whole at that
    moment (FSDP2 swaps a unit's gathered tensors in for its DTensor shards for the forward), by kind.
    Global hooks run before a module's own, so a unit's parameters are still gathered here, before
    FSDP's post-forward hook reshards them (and not yet in a global pre-hook)."""
    from torch.distributed.tensor import DTensor

    def hook(module, args, output):
        for param in module.parameters(recurse=False):
            if not isinstance(param, DTensor):
                seen.setdefault(kinds.get(id(module), "other"), set()).add(param.dtype)
    return hook


def _rank(rank: int, port: int, models: str, out_dir: str, out) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "ACCELERATE_USE_FSDP": "true",
                       "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
                       "HF_HUB_OFFLINE": "1"})
    from pathlib import Path

    from torch.distributed.tensor import DTensor

    from ppo_cli.commands import plan
    from ppo_cli.distributed import Distributed
    from ppo_cli.engine.engine import load_engine
    from ppo_cli.plan_memory import GB
    from ppo_cli.recipe_loading import load_recipe
    from ppo_cli.train_setup import init_state
    from ppo_cli.trainer import train_step
    from tests.conftest import ROOT, tiny_overrides

    torch.manual_seed(0)
    recipe = load_recipe(ROOT / "recipes/tiny_sentiment.yaml", tiny_overrides(Path(models), Path(out_dir), **SMALL))
    dist = Distributed.for_recipe(recipe)
    engine = load_engine(recipe, dist.device, dist.mixed_precision)
    ac = engine.actor_critic
    reward_model = engine.reward.scorers[0][2].model
    kinds = {id(m): "adapter" if "lora_" in name else "policy" for name, m in ac.policy.named_modules()}
    kinds.update({id(m): "reward" for m in reward_model.modules()})
    kinds[id(ac.value_head)] = "value head"
    seen: dict = {}
    handle = torch.nn.modules.module.register_module_forward_hook(_dtypes_seen(kinds, seen))
    state = init_state(engine, PROMPTS * 2, dist)
    adapters = {name: p for name, p in state.model.named_parameters() if "lora_" in name}
    before = {name: p.to_local().detach().clone() for name, p in adapters.items()}
    metrics, _ = train_step(state)
    handle.remove()
    moved = max((p.to_local() - before[name]).abs().max().item() for name, p in adapters.items() if p.to_local().numel())
    optimizer = getattr(state.optimizer, "optimizer", state.optimizer)
    moments = {s["exp_avg"].dtype for s in optimizer.state.values()}
    result = {"seen": {k: sorted(str(d) for d in v) for k, v in seen.items()}, "loss": metrics["loss/policy_avg"],
              "skipped": metrics["skipped"], "moved": moved, "adapter_dtypes": sorted({str(p.dtype) for p in adapters.values()}),
              "adapters_sharded": all(isinstance(p, DTensor) for p in adapters.values()),
              "moments": sorted(str(d) for d in moments)}
    if rank == 0:
        # the plan for this recipe, 2 processes, FSDP: its gathered figures against the bytes the forwards held
        from ppo_cli.engine.critics import VALUE_ADAPTER

        # the policy's weights and its adapter (the value adapter is the critic's line), DTensors: global sizes
        n_all = sum(p.numel() for name, p in ac.policy.named_parameters() if f".{VALUE_ADAPTER}." not in name)
        lines = {line.part: line.gb * GB for line in plan.run(recipe, device="cpu", processes=2, sharding="fsdp").estimate.lines}
        result.update(n_all=n_all, plan_block=lines["one layer gathered (update)"],
                      plan_rollout=lines["policy gathered for generation"], layers=len(ac.policy.base_model.model.model.layers))
    out[rank] = result
    dist.wait()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_fsdp_bf16_run_gathers_in_bf16_keeps_float32_masters_and_trains(tiny_models, tmp_path):
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(port, str(tiny_models), str(tmp_path), out), nprocs=2, join=True)
    for rank in (0, 1):
        result = out[rank]
        # inside every forward (rollout, scoring, update) the gathered weights are bf16; the value head float32
        assert result["seen"]["policy"] == ["torch.bfloat16"]
        assert result["seen"]["adapter"] == ["torch.bfloat16"]
        assert result["seen"]["reward"] == ["torch.bfloat16"]
        assert result["seen"]["value head"] == ["torch.float32"]
        # the shards (LoRA's master weights) and AdamW's moments stay float32
        assert result["adapters_sharded"] and result["adapter_dtypes"] == ["torch.float32"]
        assert result["moments"] == ["torch.float32"]
        assert result["skipped"] == 0 and math.isfinite(result["loss"])
        assert result["moved"] > 0  # this process's half of the adapters took a step
    plan = out[0]
    # the plan's one gathered layer: the policy's weights and adapters / layers, at 2 B (bf16), not 4
    assert plan["plan_block"] == pytest.approx(plan["n_all"] * 2 / plan["layers"], rel=1e-3)
