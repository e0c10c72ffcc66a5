"""Weights in and out of modules: the part of a gathered state dict under a prefix, safetensors files
loaded into a built module. Shared by the checkpoint (policy, value head) and the critics (critic/)."""

from __future__ import annotations

from pathlib import Path

import torch

from ppo_cli.errors import CheckpointError


def part_of(state: dict | None, prefix: str) -> dict | None:
    """The entries of ``state`` under ``prefix``, named relative to it; None when there are none (a
    frozen whole model, left out of the gathered state: read it from its modules)."""
    if state is None:
        return None
    part = {name[len(prefix):]: tensor for name, tensor in state.items() if name.startswith(prefix)}
    return part or None


def load_safetensors_into(module: torch.nn.Module, files: list[Path]) -> None:
    from safetensors.torch import load_file

    state = {}
    for file in files:
        state.update(load_file(file))
    result = module.load_state_dict(state, strict=False)
    tied = {name for name in result.missing_keys if name.endswith("lm_head.weight")}
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise CheckpointError(
            f"checkpoint weights do not fit the model (missing {sorted(result.missing_keys)[:3]}, "
            f"unexpected {sorted(result.unexpected_keys)[:3]})",
            hint="resume with the recipe the run was started with",
        )
