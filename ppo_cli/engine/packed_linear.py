"""bf16 weight products with the weight laid out once per generate() call, not at every decoding step.

On a CPU, ``F.linear`` in bfloat16 hands oneDNN a plain (out, in) weight, which oneDNN first reorders
into its blocked layout and then multiplies: at a decoding step (16 rows at the GRPO bench shape) the
reorder, a full pass over the weight, costs about as much as the product. The weights a generate()
call multiplies by do not change while it samples, so here each is reordered once
(``torch.ops.mkldnn._reorder_linear_weight``, what inductor's freezing does) and every step runs the
product alone (``torch.ops.mkldnn._linear_pointwise``):

    y = x @ W^T + b      x (..., in) bf16, W (out, in) bf16, b (out,) bf16 or None -> y (..., out) bf16

The same oneDNN kernel on the same numbers: equal to ``F.linear`` bit for bit (tests/engine/
test_packed_linear.py). Measured on an AMD EPYC with avx512_bf16, 2 threads, SmolLM2's 30 layers of
7 products at 16 rows: 21.4 against 34.6 ms a step; the 0.5B shape's 24 layers: 72.5 against 115.1 ms
(benchmarks/bench_lean_lora.py measures it in sampling). The price is a second copy of each packed
weight while generate() runs (``ppo plan`` counts it) and one reorder per call, the saving of about
three steps: a call that may decode fewer than MIN_STEPS tokens does not pack.

Only where oneDNN computes bf16 natively (``torch.ops.mkldnn._is_mkldnn_bf16_supported``) and only for
CPU tensors: float32 products gain nothing from MKL's packed sgemm here (measured: slower).
"""

from __future__ import annotations

from typing import Callable

import torch

ENABLED = True  # benchmarks/bench_lean_lora.py switches it off for its A/B
MIN_STEPS = 16  # a call that may decode fewer tokens keeps F.linear: the reorder costs about three steps' saving


def packing_pays(device: torch.device | str, max_new_tokens: int) -> bool:
    """Whether generate() on ``device`` for up to ``max_new_tokens`` steps packs its bf16 products (each
    layer then packs only a product it computes in bf16)."""
    return (ENABLED and torch.device(device).type == "cpu" and max_new_tokens >= MIN_STEPS
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packed_product(weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> F.linear(x, weight, bias)`` for bf16 ``x``, with ``weight`` (out, in) reordered now.
    ``weight`` and ``bias`` are cast to bf16 first (autocast's cast, so the same numbers); ``rows``: the
    rows a step multiplies, oneDNN's hint for its layout."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), rows)
    packed_bias = None if bias is None else bias.detach().to(torch.bfloat16)

    def product(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, packed_bias, "none", [], "")

    return product
