"""``ppo plan``'s units: bytes per value, the estimate's lines, activations per token and layer.

The leaf both plan_memory.py (the estimate) and each critic kind (engine/critics.py, its own part) count
with. Pure arithmetic on plain numbers; ``shape`` is a memory.ModelShape (hidden, intermediate,
total_params, linear_params). No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
DTYPE_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0}
# bitsandbytes: nf4 with double quantization = 4 bits + an 8-bit absmax per 64 values + a float32
# per 256 absmax blocks; LLM.int8 = 1 byte + a float32 scale per output row (~0 per parameter).
QUANT_BYTES = {"4bit": 0.5 + 1 / 64 + 4 / (64 * 256), "8bit": 1.0}


@dataclass
class Line:
    role: str
    part: str
    gb: float
    how: str
    phase: str = "static"  # static | update | rollout | runtime


def activation_floats_per_token_layer(shape, trains_weights: bool, lora_r: int, seq_len: int) -> float:
    """Values the backward needs per token and decoder layer (measured on Qwen2 with SDPA attention,
    benchmarks/bench_vs_trl.py plan-check): norms' inputs and outputs, q/k/v/attention outputs, the
    attention's log-sum-exp, the MLP's gate/up/act/product; a frozen LoRA base skips the norm weights'
    inputs and adds 7 r-sized LoRA intermediates; the causal mask adds L/2."""
    H, I = shape.hidden, shape.intermediate
    base = 10 * H + 4 * I if trains_weights else 8 * H + 4 * I + 7 * lora_r
    return base + seq_len / 2


def weights_how(shape, dtype: str, quantization: str) -> str:
    if quantization == "none":
        return f"{shape.total_params / 1e6:.1f}M params x {DTYPE_BYTES[dtype]:g} B ({dtype})"
    return (f"{shape.linear_params / 1e6:.1f}M in linear layers x {QUANT_BYTES[quantization]:.2f} B ({quantization}) "
            f"+ {(shape.total_params - shape.linear_params) / 1e6:.1f}M x {DTYPE_BYTES[dtype]:g} B")
