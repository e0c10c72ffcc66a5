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
of the sum where peft rounds the adapter's product, then the sum.

Under bf16 autocast, where generate() packs (engine/packed_linear.py: a CPU whose oneDNN computes bf16,
``pack_rows`` > 0), the base and the adapter are one product on a weight laid out once per call:

    h = x_c @ A^T                                                       (B, T, r)
    out = [x_c, h] @ [W, scaling B]^T + b                               (B, T, in + r) @ (in + r, out)

so at a step each layer is a small product, a concatenation and one packed product: the base's and the
adapter's terms accumulate together in float32 and the sum is rounded to bf16 once (peft rounds the
base's product, the adapter's, and the sum). scaling B is rounded to bf16 as one number, exactly
scaling times bf16(B) when scaling is a power of two (the default r 16, alpha 32: scaling 2).
Siblings that read one input (q, k and v; gate and up: SIBLINGS) are one such product together, their
A's stacked and their B's on the diagonal (_install_joined): 4 packed products a layer instead of 7.

Sampled tokens' log-probs (generate_with_logprobs) are this forward's, so they describe the
distribution the tokens came from.

A layer keeps peft's forward when it is anything else: a quantized or sharded base (bitsandbytes,
FSDP's DTensors, ZeRO-3's empty partitions), a variant (DoRA), a bias on lora_B, dropout left on,
more than one active adapter, merged; and at any call with gradients on, with the adapter disabled,
with another adapter active, or under another autocast state than the one it was entered with.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ppo_cli.engine.packed_linear import packed_product
from ppo_cli.engine.shared_prompts import whole_local_weights

ENABLED = True  # benchmarks/bench_lean_lora.py switches it off for its A/B
# Layers of one parent that the model's forward calls on the same input, by the names transformers'
# decoders give them: packed as one product (any other layer is a group of one). Should a model call
# them on different inputs after all, the group splits (see _install_joined).
SIBLINGS = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


@contextlib.contextmanager
def lean_lora(model: nn.Module, pack_rows: int = 0):
    """Inside, every plain LoRA Linear of ``model`` (see the module docstring) computes in two ops.
    ``pack_rows`` > 0 (packed_linear.packing_pays said so): under bf16 autocast, base and adapter in one
    product on their weights laid out once, for steps of about that many rows, siblings that read the
    same input (q, k and v; gate and up) in one product together."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    named = [(name, m) for name, m in model.named_modules() if type(m) is LoraLinear and _plain_lora_linear(m)]
    named = named if ENABLED else []
    packs = (pack_rows > 0 and torch.is_autocast_enabled("cpu")
             and torch.get_autocast_dtype("cpu") == torch.bfloat16)
    siblings: dict[tuple, list[nn.Module]] = {}
    for name, layer in named:
        if packs and layer.base_layer.weight.device.type == "cpu":
            parent, _, leaf = name.rpartition(".")
            siblings.setdefault((parent, SIBLINGS.get(leaf, leaf)), []).append(layer)
        else:
            layer.forward = _guarded(layer, _lean_forward(layer))
    for group in siblings.values():
        _install_joined(group, pack_rows)
    try:
        yield len(named)
    finally:
        for _, layer in named:
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


def _guarded(layer: nn.Module, lean: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``layer``'s forward: ``lean(x)``, or peft's own where the call is not the one it was entered for
    (arguments besides x, gradients on, the adapter switched or merged, another autocast state)."""
    (name,) = layer.active_adapters
    device = layer.lora_A[name].weight.device.type
    autocast = torch.is_autocast_enabled(device)
    peft_forward = type(layer).forward

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if (args or kwargs or layer.disable_adapters or layer.merged or torch.is_grad_enabled()
                or layer.active_adapters != [name] or torch.is_autocast_enabled(device) != autocast):
            return peft_forward(layer, x, *args, **kwargs)
        return lean(x)

    return forward


def _lean_forward(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """base(x) + scaling (x_c A^T) B^T, with A and B cast to the compute dtype now."""
    (name,) = layer.active_adapters
    weight_A, weight_B = layer.lora_A[name].weight, layer.lora_B[name].weight
    device = weight_A.device.type
    autocast = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else weight_A.dtype
    A = weight_A.detach().to(dtype)  # (r, in)
    B_t = weight_B.detach().to(dtype).t()  # (r, out)
    scaling = float(layer.scaling[name])
    base = layer.base_layer

    def lean(x: torch.Tensor) -> torch.Tensor:
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

    return lean


def _install_joined(layers: list[nn.Module], pack_rows: int) -> None:
    """Sibling layers (one parent, named in SIBLINGS) as one packed bf16 product under autocast:

        h = x_c @ [A_1; ...; A_k]^T                                     (B, T, R), R = r_1 + ... + r_k
        [y_1, ..., y_k] = [x_c, h] @ [[W_1, s_1 B_1, 0, ...], ..., [W_k, ..., 0, s_k B_k]]^T + [b_1, ..., b_k]

    computed at the first sibling's call and sliced for the others, as long as they read the same
    tensor (``is``, unchanged since). Should a sibling read another input before every sibling has read
    the last one, the group is split: from then on each computes alone (the unpacked lean forward).
    The zero blocks add exact zeros to a float32 accumulation: each y_i is its own sum, rounded once."""
    dtype = torch.bfloat16
    names = [layer.active_adapters[0] for layer in layers]
    A_all = torch.cat([layer.lora_A[name].weight.detach().to(dtype) for layer, name in zip(layers, names)])
    ranks = [layer.lora_A[name].weight.shape[0] for layer, name in zip(layers, names)]
    blocks, biases, bounds, rank_at, out_at = [], [], [], 0, 0
    for layer, name, rank in zip(layers, names, ranks):
        base = layer.base_layer
        scaled_B = torch.zeros(base.out_features, A_all.shape[0], dtype=dtype)
        scaled_B[:, rank_at:rank_at + rank] = (layer.lora_B[name].weight.detach() * float(layer.scaling[name])).to(dtype)
        blocks.append(torch.cat([base.weight.detach().to(dtype), scaled_B], dim=1))
        biases.append(base.bias.detach().to(dtype) if base.bias is not None else torch.zeros(base.out_features, dtype=dtype))
        bounds.append((out_at, out_at + base.out_features))
        rank_at, out_at = rank_at + rank, out_at + base.out_features
    with_bias = any(layer.base_layer.bias is not None for layer in layers)
    product = packed_product(torch.cat(blocks), torch.cat(biases) if with_bias else None, pack_rows)
    del blocks
    shared = _SharedInput(len(layers))

    for index, layer in enumerate(layers):
        start, end = bounds[index]
        alone: list[Callable[[torch.Tensor], torch.Tensor]] = []  # the unpacked forward, made at a split

        def lean(x: torch.Tensor, layer=layer, index=index, alone=alone, start=start, end=end) -> torch.Tensor:
            if not shared.split and not shared.holds(x) and shared.unread():
                shared.split = True  # a sibling reads another input: each computes alone from here
            if shared.split:
                if not alone:
                    alone.append(_lean_forward(layer))
                return alone[0](x)
            if not shared.holds(x):
                x_c = x.to(dtype)
                shared.keep(x, product(torch.cat([x_c, F.linear(x_c, A_all)], dim=-1)))
            shared.read.add(index)
            return shared.out[..., start:end]

        layer.forward = _guarded(layer, lean)


class _SharedInput:
    """The last input a group of siblings computed for, its joined output, and which siblings took theirs."""

    def __init__(self, members: int):
        self.members, self.split = members, False
        self.x: torch.Tensor | None = None
        self.version = -1
        self.out: torch.Tensor | None = None
        self.read: set[int] = set()

    def holds(self, x: torch.Tensor) -> bool:
        return self.x is x and self.version == x._version

    def unread(self) -> bool:
        return self.x is not None and len(self.read) < self.members

    def keep(self, x: torch.Tensor, out: torch.Tensor) -> None:
        self.x, self.version, self.out, self.read = x, x._version, out, set()
