"""engine/reserved_cache.py: each layer's keys and values in one buffer reserved for the whole call,
written in place; under bf16 autocast held already cast. The cache it hands the attention holds the
values DynamicLayer's concatenation holds, and generate() samples the same tokens with it."""

from __future__ import annotations

import pytest
import torch

from ppo_cli.engine import reserved_cache
from ppo_cli.engine.reserved_cache import ReservedCache, ReservedLayer
from tests.fixtures.architectures import FAMILIES, lora_adapted


def _states(rows: int, positions: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2, positions, 4, generator=generator),
            torch.randn(rows, 2, positions, 4, generator=generator))


def test_a_reserved_layer_holds_what_concatenation_holds_in_one_buffer_of_the_reserved_length():
    layer = ReservedLayer(length=6, store_dtype=None)
    steps = [_states(3, 3, 0), _states(3, 1, 1), _states(3, 1, 2)]  # a prefill of 3, then two steps
    for step, (keys, values) in enumerate(steps, start=1):
        cached_keys, cached_values = layer.update(keys, values)
        expected = [torch.cat([s[i] for s in steps[:step]], dim=2) for i in (0, 1)]
        assert torch.equal(cached_keys, expected[0]) and torch.equal(cached_values, expected[1])
        if step == 1:
            buffer = layer._key_buffer
    assert layer._key_buffer is buffer and buffer.shape == (3, 2, 6, 4)  # allocated once
    assert layer.keys.data_ptr() == buffer.data_ptr() and layer.get_seq_length() == 5


def test_a_layer_past_its_reserved_length_or_reordered_copies_its_cache_into_new_buffers():
    layer = ReservedLayer(length=4, store_dtype=None)
    first, second, third = _states(2, 3, 0), _states(2, 2, 1), _states(2, 1, 2)
    layer.update(*first)
    keys, _ = layer.update(*second)  # 5 > 4 positions: a buffer of 5
    assert layer._key_buffer.shape[2] == 5 and torch.equal(keys, torch.cat([first[0], second[0]], dim=2))
    layer.reorder_cache(torch.tensor([1, 1]))  # DynamicLayer's own: index_select leaves the buffers
    keys, values = layer.update(*third)
    whole = torch.cat([first[1], second[1]], dim=2)[[1, 1]]
    assert torch.equal(values, torch.cat([whole, third[1]], dim=2))
    assert keys.shape == (2, 2, 6, 4) and layer.keys.data_ptr() == layer._key_buffer.data_ptr()


def test_a_layer_stores_in_its_dtype_the_values_cast_as_the_attention_would_cast_them():
    layer = ReservedLayer(length=8, store_dtype=torch.bfloat16)
    keys, values = _states(2, 3, 0)
    cached_keys, cached_values = layer.update(keys, values)
    assert cached_keys.dtype == torch.bfloat16 and torch.equal(cached_keys, keys.to(torch.bfloat16))
    assert torch.equal(cached_values, values.to(torch.bfloat16))


def test_the_cache_reserves_full_attention_layers_and_keeps_transformers_sliding_ones():
    from transformers import AutoConfig
    from transformers.cache_utils import DynamicSlidingWindowLayer

    config = AutoConfig.for_model("gemma3_text", num_hidden_layers=6, sliding_window=16, hidden_size=32,
                                  intermediate_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    cache = ReservedCache(config, length=40)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds.count(ReservedLayer) == config.layer_types.count("full_attention") >= 1
    assert kinds.count(DynamicSlidingWindowLayer) == config.layer_types.count("sliding_attention") >= 1


def _has_full_attention_layers(model) -> bool:
    from transformers.cache_utils import DynamicLayer

    cache = ReservedCache(model.get_base_model().config, length=1)
    return cache.layer_class_to_replicate not in (None, DynamicLayer) or any(
        isinstance(layer, ReservedLayer) for layer in cache.layers)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("precision", ["bf16 autocast, shared prompts", "float32, distinct prompts"])
def test_generate_samples_the_same_tokens_and_log_probs_with_the_reserved_cache(architecture_models, family,
                                                                              precision, monkeypatch):
    """Bit for bit: under bf16 autocast (the cache held in bf16) with repeated prompts, whose prefill
    fills it once and repeats it over their rows (shared_prompts.shared_prefill), and in float32."""
    from ppo_cli.engine.frozen_weights import store_frozen_linears_in
    from ppo_cli.engine.generate import generate_with_logprobs
    from ppo_cli.recipe import GenerationConfig

    model = lora_adapted(architecture_models / family)
    bf16 = precision.startswith("bf16")
    if bf16:
        store_frozen_linears_in(model, torch.bfloat16)
    vocab = model.get_output_embeddings().weight.shape[0]
    torch.manual_seed(1)
    distinct = 2 if bf16 else 8
    prompt_ids = torch.randint(3, vocab, (distinct, 12)).repeat_interleave(8 // distinct, dim=0)
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    prompt_mask[:4, :3] = False  # left padding
    gen = GenerationConfig(max_new_tokens=10, temperature=0.7)
    updates = []
    real_update = ReservedLayer.update
    monkeypatch.setattr(ReservedLayer, "update", lambda self, *a, **k: updates.append(self.store_dtype) or real_update(self, *a, **k))
    samples = []
    for enabled in (True, False):
        monkeypatch.setattr(reserved_cache, "ENABLED", enabled)
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            samples.append(generate_with_logprobs(model, prompt_ids, prompt_mask, gen, stop_token_id=-1,
                                                  pad_token_id=0, keep_hidden=False))
        if enabled:  # Mistral's layers all slide (its window 4096): transformers' own
            expected = {torch.bfloat16 if bf16 else None} if _has_full_attention_layers(model) else set()
            assert set(updates) == expected, set(updates)
    (reserved_gen, reserved_logprobs, _), (plain_gen, plain_logprobs, _) = samples
    assert torch.equal(reserved_gen.response_ids, plain_gen.response_ids)
    assert torch.equal(reserved_logprobs, plain_logprobs)
