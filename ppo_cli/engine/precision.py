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


def cpu_has_native_bf16() -> bool:
    """Does this CPU compute bf16 in hardware (AVX512-BF16 or AMX)? There bf16 autocast made a 0.5B-shape
    PPO update 1.67x faster (docs/benchmarks.md, "Mixed precision"); elsewhere oneDNN emulates bf16."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # private, hence the fallbacks
    return any(getattr(cpu, name, lambda: False)() for name in checks)


def resolve_mixed_precision(setting: str, device: torch.device, weights_dtype: torch.dtype,
                            launcher: str | None = None) -> str:
    """'no', 'bf16' or 'fp16' for train.mixed_precision ``setting`` ('auto' or one of those).

    An explicit setting wins. 'auto' takes the launcher's choice when there is one; else, for float32
    weights (half-precision weights are pure bf16/fp16 already), bf16 on a CUDA device that supports it
    and on a CPU with hardware bf16, and 'no' elsewhere.
    """
    if setting != "auto":
        return setting
    if launcher is not None:
        return launcher
    if weights_dtype != torch.float32:
        return "no"
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    if device.type == "cpu":
        return "bf16" if cpu_has_native_bf16() else "no"
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
