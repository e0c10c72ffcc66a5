"""Sampling's LoRA layers in two tensor ops each instead of peft's six: inside generate() (engine/generate.py).

peft's ``lora.Linear.forward`` computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: it casts x
to the adapter's float32, autocast casts it back for each product, then a product, a multiply and an add,
with peft's bookkeeping in Python around them. At a decoding step (16 rows at the GRPO bench shape) each
op is a few microseconds of work and more of overhead: SmolLM2's 210 adapted layers made sampling 20%
slower than the same model with the adapter off (AMD EPYC, 2 threads). Here each plain LoRA layer computes

    x_c = x in the compute dtype (autocast's, else the adapter's)       once, for both products
    out = base(x)                                                       (B, T, out)
    out += scaling * (x_c @ A^T) @ B^T                                  one addmm_ into out

with A and B cast to the compute dtype once per generate() call (the weights do not change while it
samples). The same products: in float32 to the order of summation, under autocast to one bf16 rounding
of the sum where peft rounds the adapter's product, then the sum. Sampled tokens' log-probs
(generate_with_logprobs) are this forward's, so they describe the distribution the tokens came from.

A layer keeps peft's forward when it is anything else: a quantized or sharded base (bitsandbytes,
FSDP's DTensors, ZeRO-3's empty partitions), a variant (DoRA), a bias on lora_B, dropout left on,
more than one active adapter, merged; and at any call with gradients on, with the adapter disabled,
with another adapter active, or under another autocast state than the one it was entered with.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from ppo_cli.engine.shared_prompts import whole_local_weights

ENABLED = True  # benchmarks/bench_lean_lora.py switches it off for its A/B


@contextlib.contextmanager
def lean_lora(model: nn.Module):
    """Inside, every plain LoRA Linear of ``model`` (see the module docstring) computes in two ops."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    layers = [m for m in model.modules() if type(m) is LoraLinear and _plain_lora_linear(m)] if ENABLED else []
    for layer in layers:
        _install(layer)
    try:
        yield len(layers)
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


def _plain_lora_linear(module: nn.Module) -> bool:
    """``module``: a peft lora.Linear."""
    if module.merged or module.disable_adapters:
        return False
    if len(module.active_adapters) != 1:
        return False
    (name,) = module.active_adapters
    if name not in module.lora_A or name in getattr(module, "lora_variant", {}) or module.use_dora.get(name, False):
        return False
    base, lora_A, lora_B = module.base_layer, module.lora_A[name], module.lora_B[name]
    dropout = module.lora_dropout[name]
    if type(base) is not nn.Linear or type(lora_A) is not nn.Linear or type(lora_B) is not nn.Linear:
        return False
    if lora_A.bias is not None or lora_B.bias is not None:
        return False
    if not (isinstance(dropout, nn.Identity) or (isinstance(dropout, nn.Dropout) and dropout.p == 0.0)):
        return False
    return whole_local_weights(module)


def _install(layer: nn.Module) -> None:
    (name,) = layer.active_adapters
    weight_A, weight_B = layer.lora_A[name].weight, layer.lora_B[name].weight
    device = weight_A.device.type
    autocast = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else weight_A.dtype
    A = weight_A.detach().to(dtype)  # (r, in)
    B_t = weight_B.detach().to(dtype).t()  # (r, out)
    scaling = float(layer.scaling[name])
    base = layer.base_layer
    peft_forward = type(layer).forward

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if (args or kwargs or layer.disable_adapters or layer.merged or torch.is_grad_enabled()
                or layer.active_adapters != [name] or torch.is_autocast_enabled(device) != autocast):
            return peft_forward(layer, x, *args, **kwargs)
        x_c = x.to(dtype)
        out = F.linear(x_c if autocast else x, base.weight, base.bias)
        h = F.linear(x_c, A)
        flat = out.view(-1, out.shape[-1])
        if out.dtype == dtype:
            flat.addmm_(h.view(-1, h.shape[-1]), B_t, alpha=scaling)
            return out
        # a base in another dtype than the adapter, without autocast (a bf16 model's float32 adapter):
        # peft adds in the adapter's dtype and casts the sum back
        return torch.addmm(flat.to(dtype), h.view(-1, h.shape[-1]), B_t, alpha=scaling).to(out.dtype).view_as(out)

    layer.forward = forward
