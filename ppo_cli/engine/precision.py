"""Mixed precision (train.mixed_precision): which one a run uses, and the autocast it computes under.

Mixed precision keeps the weights, optimizer states, log-softmax, losses and GAE in float32 and runs
the matmuls and attention of the forward passes in bf16/fp16 (torch.autocast). The update gets it
from accelerate (the prepared model's forward runs under autocast); the rollout's forwards (old and
reference log-probs, values) and generation run under ``autocast_context`` with the same settings,
so the first PPO ratio stays 1.
"""

from __future__ import annotations

import contextlib

import torch

from ppo_cli.errors import UsageError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_mixed_precision(setting: str, device: torch.device, weights_dtype: torch.dtype,
                            launcher: str | None = None) -> str:
    """'no', 'bf16' or 'fp16' for train.mixed_precision ``setting`` ('auto' or one of those).

    An explicit setting wins. 'auto' takes the launcher's choice when there is one; else it is bf16 on
    a CUDA device that supports it, with float32 weights (half-precision weights are pure bf16/fp16
    already), and 'no' elsewhere: on CPU, even with hardware bf16 (AVX512-BF16), bf16 autocast made a
    PPO update slower, not faster (docs/benchmarks.md, "Mixed precision").
    """
    if setting != "auto":
        return setting
    if launcher is not None:
        return launcher
    if device.type == "cuda" and weights_dtype == torch.float32 and torch.cuda.is_bf16_supported():
        return "bf16"
    return "no"


def check_mixed_precision(mixed_precision: str, device: torch.device) -> None:
    """Refuse what accelerate would silently not do: it autocasts fp16 on accelerators only."""
    if mixed_precision == "fp16" and device.type == "cpu":
        raise UsageError(
            "train.mixed_precision 'fp16' needs a GPU: accelerate does not autocast to float16 on CPU",
            hint="use train.mixed_precision: bf16 (or auto) on CPU",
        )
    if mixed_precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError(
            f"train.mixed_precision 'bf16' is not supported by {torch.cuda.get_device_name(device)}",
            hint="use train.mixed_precision: fp16 (or auto) on this GPU",
        )


def autocast_context(mixed_precision: str, device: torch.device):
    """The autocast accelerate's prepared model runs its forward under (a no-op for 'no')."""
    if mixed_precision == "no":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[mixed_precision])


def full_precision(device: torch.device):
    """Leave autocast for a small float32 computation inside an autocast region (the value head)."""
    return torch.autocast(device_type=device.type, enabled=False)


def recipe_mixed_precision(recipe, device: torch.device, launcher: str | None = None) -> str:
    """train.mixed_precision of ``recipe`` resolved for ``device`` ('auto' made concrete)."""
    from ppo_cli.engine.models import resolve_dtype

    weights_dtype = resolve_dtype(recipe.policy.dtype, device)
    return resolve_mixed_precision(recipe.train.mixed_precision, device, weights_dtype, launcher)
