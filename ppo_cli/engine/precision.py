"""Mixed precision (train.mixed_precision): which one a run uses, and the autocast it computes under.

Mixed precision keeps the weights, optimizer states, log-softmax, losses and GAE in float32 and runs
the matmuls and attention of the forward passes in bf16/fp16 (torch.autocast). The update gets it
from accelerate (the prepared model's forward runs under autocast); the rollout's forwards (old and
reference log-probs, values) and generation run under ``autocast_context`` with the same settings,
so the first PPO ratio stays 1.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ppo_cli.engine.models import resolve_dtype
from ppo_cli.engine.precision_probe import ProbeResult, cached_probe
from ppo_cli.errors import UsageError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# bf16 must beat float32 by this much at the probe: autocast also casts activations and runs the
# non-matmul ops around each Linear, which the probe's one Linear does not see.
BF16_MARGIN = 0.9


@dataclass(frozen=True)
class PrecisionChoice:
    """train.mixed_precision resolved: ``value`` ('no', 'bf16' or 'fp16') for ``setting``, and why."""

    setting: str  # as the recipe says: 'auto', 'no', 'bf16' or 'fp16'
    value: str
    reason: str  # why 'auto' became ``value`` ('' for an explicit setting)
    probe: ProbeResult | None = None  # the CPU probe's timings (also run for an explicit setting: MFU's peak)

    def describe(self) -> str:
        """e.g. 'mixed precision auto -> no (probe: fp32 8.8 ms, bf16 14.5 ms per step on AMD EPYC)'."""
        head = f"mixed precision {self.setting}" + (f" -> {self.value}" if self.setting == "auto" else "")
        why = [self.reason] if self.reason and self.reason != "probe" else []
        if self.probe is not None:
            p = self.probe
            why.append(f"probe: fp32 {p.fp32_ms:.1f} ms, bf16 {p.bf16_ms:.1f} ms per step on {p.cpu}")
        return head + (f" ({'; '.join(why)})" if why else "")


def choose_mixed_precision(setting: str, device_type: str, weights_dtype: torch.dtype, launcher: str | None = None,
                           cuda_bf16: bool = False, probe: ProbeResult | None = None,
                           resumed: str | None = None) -> PrecisionChoice:
    """The one rule for train.mixed_precision ``setting`` ('auto' or a value); pure: facts in, choice out.

    An explicit setting wins. 'auto' takes the launcher's choice when there is one (``launcher``); a
    resumed run keeps what its checkpoint's run chose (``resumed``: the probe may answer otherwise now,
    on a busier machine or with another thread count, and the resumed updates must compute as the
    first ones did); leaves
    half-precision weights alone (they are pure bf16/fp16 already); on CUDA takes bf16 when the device
    supports it (``cuda_bf16``); on CPU takes bf16 only when the ``probe`` measured it faster than float32
    by BF16_MARGIN at the model's widths ('no' without a probe: float32 is exact).
    """
    choice = lambda value, reason: PrecisionChoice(setting, value, reason, probe)  # noqa: E731
    if setting != "auto":
        return choice(setting, "")
    if launcher is not None:
        return choice(launcher, "the launcher's --mixed_precision")
    if resumed is not None:
        return choice(resumed, "as the run being resumed chose it")
    if weights_dtype != torch.float32:
        return choice("no", f"the weights are {str(weights_dtype).removeprefix('torch.')} already")
    if device_type == "cuda":
        return choice("bf16", "the GPU supports bf16") if cuda_bf16 else choice("no", "the GPU lacks bf16")
    if device_type == "cpu" and probe is not None:
        return choice("bf16" if probe.bf16_ms <= BF16_MARGIN * probe.fp32_ms else "no", "probe")
    return choice("no", "not measured")


def resolve_mixed_precision(setting: str, device: torch.device, weights_dtype: torch.dtype,
                            launcher: str | None = None, widths: tuple[int, int] | None = None,
                            resumed: str | None = None) -> PrecisionChoice:
    """choose_mixed_precision with the facts of this machine: CUDA's bf16 support, and on CPU the probe
    at ``widths`` (hidden, intermediate), read from the cache or measured once (not for a resumed run's
    'auto', which ``resumed`` decides)."""
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    measure = device.type == "cpu" and widths is not None and not (setting == "auto" and resumed is not None)
    probe = cached_probe(*widths) if measure else None
    return choose_mixed_precision(setting, device.type, weights_dtype, launcher, cuda_bf16, probe, resumed)


def model_widths(path: str, trust_remote_code: bool = False, revision: str | None = None) -> tuple[int, int] | None:
    """(hidden, intermediate) from a model's config.json; None when it cannot be read (the load reports why)."""
    from transformers import AutoConfig

    from ppo_cli.gguf_cache import gguf_config
    from ppo_cli.model_refs import is_gguf

    try:
        if is_gguf(path):  # the config is in the file's metadata
            config = gguf_config(path)
        else:
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError, ImportError):
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(text, "hidden_size", None)
    if hidden is None:
        return None
    return hidden, getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden


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


def probe_widths(recipe, device: torch.device) -> tuple[int, int] | None:
    """The policy's (hidden, intermediate) for the CPU probe (None off CPU). Sets train.num_threads first,
    so that the probe measures with the threads training will use."""
    if device.type != "cpu":
        return None
    if recipe.train.num_threads:
        torch.set_num_threads(recipe.train.num_threads)
    pol = recipe.policy
    return model_widths(pol.path, pol.trust_remote_code, pol.revision)


def recipe_precision(recipe, device: torch.device, launcher: str | None = None) -> PrecisionChoice:
    """train.mixed_precision of ``recipe`` resolved for ``device`` (probed at the policy's widths on CPU)."""
    weights_dtype = resolve_dtype(recipe.policy.dtype, device)
    return resolve_mixed_precision(recipe.train.mixed_precision, device, weights_dtype, launcher,
                                   probe_widths(recipe, device))


def recipe_mixed_precision(recipe, device: torch.device, launcher: str | None = None) -> str:
    """'no', 'bf16' or 'fp16': recipe_precision's value."""
    return recipe_precision(recipe, device, launcher).value
