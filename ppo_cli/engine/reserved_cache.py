"""A KV cache that holds each layer's keys and values in one buffer of the whole sampling length,
written in place at every step.

transformers' DynamicLayer concatenates its cache with each step's keys and values: a copy of the
whole cache, per layer and per step, ``O(T^2)`` over a call. SmolLM2's rotary embedding also leaves
the keys in float32, which the attention then casts to bf16 again at every step under autocast.
Here each layer's buffer is allocated once, ``(B, H, length, D)``, and the cache it hands to the
attention is a view of its first ``n`` positions; under bf16 autocast it holds the keys and values
already cast (the SDPA and eager attentions cast them to the autocast dtype before any arithmetic,
so the bits they compute with are the same: tests/engine/test_reserved_cache.py, on the architecture
matrix).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

# The attention implementations that cast their keys and values to the autocast dtype first
# (F.scaled_dot_product_attention and torch.matmul are autocast's lower-precision ops).
CASTING_ATTENTIONS = ("sdpa", "eager")
ENABLED = True  # benchmarks/bench_reserved_cache.py switches it off for its A/B


class ReservedLayer(DynamicLayer):
    """DynamicLayer's cache of ``length`` positions reserved up front. ``keys`` and ``values`` stay
    DynamicLayer's attributes (views of the buffers), so its other methods (get_seq_length, crop,
    reorder_cache...) work as they do there; any of them that replaces a view with a tensor of its own
    has the next update copy it into fresh buffers."""

    def __init__(self, length: int, store_dtype: torch.dtype | None):
        super().__init__()
        self.length = length
        self.store_dtype = store_dtype
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        cached = self.keys.shape[-2] if self.keys.dim() == 4 else 0
        total = cached + key_states.shape[-2]
        if not self._buffers_hold_the_cache(total):
            self._key_buffer = self._reserve(self.keys, key_states, cached, total)
            self._value_buffer = self._reserve(self.values, value_states, cached, total)
        self._key_buffer[:, :, cached:total].copy_(key_states)
        self._value_buffer[:, :, cached:total].copy_(value_states)
        self.keys = self._key_buffer[:, :, :total]
        self.values = self._value_buffer[:, :, :total]
        return self.keys, self.values

    def _buffers_hold_the_cache(self, total: int) -> bool:
        buffer = self._key_buffer
        return (buffer is not None and total <= buffer.shape[2] and self.keys.dim() == 4
                and self.keys.data_ptr() == buffer.data_ptr() and self.values.data_ptr() == self._value_buffer.data_ptr())

    def _reserve(self, cached_states: torch.Tensor, new_states: torch.Tensor, cached: int, total: int) -> torch.Tensor:
        B, H, _, D = new_states.shape
        dtype = self.store_dtype or new_states.dtype
        buffer = torch.empty((B, H, max(total, self.length), D), dtype=dtype, device=new_states.device)
        if cached:
            buffer[:, :, :cached].copy_(cached_states)
        return buffer


class ReservedCache(DynamicCache):
    """DynamicCache with each of its full-attention layers a ReservedLayer of ``length`` positions
    (sliding-window and other layer kinds are transformers' own)."""

    def __init__(self, config, length: int, store_dtype: torch.dtype | None = None):
        super().__init__(config=config)
        reserved = lambda: ReservedLayer(length, store_dtype)  # noqa: E731
        if self.layer_class_to_replicate is DynamicLayer:
            self.layer_class_to_replicate = reserved
        self.layers = [reserved() if type(layer) is DynamicLayer else layer for layer in self.layers]


def reserved_cache(lm, length: int) -> ReservedCache | None:
    """A ReservedCache for ``lm``'s generate() over ``length`` positions (prompt and new tokens), kept in
    the autocast dtype while autocast is on and the model's attention casts to it; None where it is off."""
    if not ENABLED:
        return None
    store_dtype = None
    device_type = lm.device.type
    if (torch.is_autocast_enabled(device_type)
            and getattr(lm.config, "_attn_implementation", None) in CASTING_ATTENTIONS):
        store_dtype = torch.get_autocast_dtype(device_type)
    return ReservedCache(lm.config, length, store_dtype)
