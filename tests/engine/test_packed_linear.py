"""bf16 products on weights laid out once per generate() call (engine/packed_linear.py): F.linear's
numbers bit for bit, in a LoRA layer, in the head and in generate() on every architecture."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ppo_cli.engine import packed_linear
from ppo_cli.engine.packed_linear import MIN_STEPS, packed_product, packing_pays
from tests.fixtures.architectures import FAMILIES, lora_adapted

BF16_PACKING = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
needs_packing = pytest.mark.skipif(not BF16_PACKING, reason="oneDNN computes bf16 natively only on CPUs with avx512_bf16 or AMX")


@needs_packing
@pytest.mark.parametrize("rows", [1, 5, 16, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_packed_product_is_f_linear_bit_for_bit_at_any_number_of_rows(rows, with_bias):
    torch.manual_seed(rows)
    weight = (torch.randn(192, 576) * 0.05).to(torch.bfloat16)
    bias = torch.randn(192).to(torch.bfloat16) if with_bias else None
    product = packed_product(weight, bias, rows=16)  # laid out for 16 rows, used at any
    x = torch.randn(rows, 576).to(torch.bfloat16)
    got = product(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 192)
    assert torch.equal(got, F.linear(x, weight, bias))
    x3 = x.view(rows, 1, 576)  # a decoding step's (B, 1, H)
    assert torch.equal(product(x3), F.linear(x3, weight, bias))


@needs_packing
def test_a_float32_weight_is_packed_as_autocast_casts_it():
    torch.manual_seed(0)
    weight, bias = torch.randn(64, 96), torch.randn(64)
    x = torch.randn(7, 96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.linear(x, weight, bias)
    assert torch.equal(packed_product(weight, bias, rows=7)(x.to(torch.bfloat16)), expected)


def test_packing_pays_only_on_a_cpu_for_calls_long_enough_and_when_switched_on(monkeypatch):
    assert not packing_pays("cuda", 64)
    assert not packing_pays("cpu", MIN_STEPS - 1)
    assert packing_pays("cpu", MIN_STEPS) == BF16_PACKING
    monkeypatch.setattr(packed_linear, "ENABLED", False)
    assert not packing_pays("cpu", 64)


def _bf16_lora(seed: int = 0) -> nn.Module:
    """A LoRA model whose frozen base is stored in bf16, as a run's is, with a bias on one layer."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 24, bias=False))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.3)
        elif "base_layer" in name:
            param.data = param.data.to(torch.bfloat16)
    return model


@needs_packing
def test_a_packed_lora_layer_is_one_product_of_the_joined_input_and_weights_by_hand():
    """[x_c, x_c A^T] @ [W, scaling B]^T + b, each in bf16, one rounding of the sum: F.linear's bits for
    that product, and at least as close to the exact float32 value as peft's three roundings."""
    from ppo_cli.engine.lean_lora import lean_lora

    model = _bf16_lora()
    layers = [m for m in model.modules() if hasattr(m, "lora_A")]
    x = torch.randn(16, 1, 48)
    calls = []
    real = packed_product
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        peft_out = model(x)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("ppo_cli.engine.lean_lora.packed_product",
                          lambda *args: calls.append(args[0].shape) or real(*args))
            with lean_lora(model, pack_rows=16):
                first = layers[0](x)
                packed_out = model(x)
    assert calls == [torch.Size([32, 48 + 4]), torch.Size([24, 32 + 4])]  # both layers, packed once each
    assert all("forward" not in vars(m) for m in model.modules())
    layer = layers[0]  # Linear(48, 32) with a bias, r 4, scaling 8 / 4 = 2
    W, b = layer.base_layer.weight, layer.base_layer.bias
    A, B = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x_c = x.to(torch.bfloat16)
    h = F.linear(x_c, A.to(torch.bfloat16))
    expected = F.linear(torch.cat([x_c, h], dim=-1), torch.cat([W, (2.0 * B).to(torch.bfloat16)], dim=1), b)
    assert torch.equal(first, expected)
    with torch.no_grad():  # the exact value of the whole model, in float32 from the same bf16 weights
        exact = model.float()(x.to(torch.bfloat16).float())
    assert (packed_out.float() - exact).abs().mean() <= (peft_out.float() - exact).abs().mean()


class _TwoInputs(nn.Module):
    """Layers named as siblings (lean_lora.SIBLINGS) that read different inputs: a group that must split."""

    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(24, 16), nn.Linear(24, 8)

    def forward(self, x, y):
        return self.q_proj(x), self.k_proj(y)


@needs_packing
def test_siblings_that_read_different_inputs_split_and_compute_alone():
    from peft import LoraConfig, get_peft_model

    from ppo_cli.engine.lean_lora import lean_lora

    torch.manual_seed(0)
    model = get_peft_model(_TwoInputs(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.3)
        elif "base_layer" in name:
            param.data = param.data.to(torch.bfloat16)
    x, y = torch.randn(5, 24), torch.randn(5, 24)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with lean_lora(model):
            alone = model(x, y)  # unpacked: each layer on its own
        with lean_lora(model, pack_rows=5):
            first = model(x, y)  # q computes the joined product for x; k reads y: the group splits
            second = model(x, y)
            inner = model.base_model.model
            same = inner.q_proj(x), inner.k_proj(x)  # joined no more, even on one input
    torch.testing.assert_close(first[0], alone[0], atol=0.05, rtol=0.02)  # q's slice of the joined product
    assert torch.equal(first[1], alone[1]) and torch.equal(second[0], alone[0]) and torch.equal(second[1], alone[1])
    assert torch.equal(same[0], alone[0])


def _tied_llama(head_dtype: torch.dtype) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=head_dtype == torch.float32)
    model = LlamaForCausalLM(config).eval()
    model.get_output_embeddings().to(head_dtype)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@needs_packing
@pytest.mark.parametrize("head_dtype", [torch.float32, torch.bfloat16], ids=["float32 tied head", "bf16 head"])
def test_the_packed_head_computes_the_same_logits_and_gives_the_head_back(head_dtype):
    from ppo_cli.engine.generate import head_cast_once

    model = _tied_llama(head_dtype)
    head = model.get_output_embeddings()
    ids = torch.randint(0, 300, (3, 7))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        per_call = model(input_ids=ids).logits
        with head_cast_once(model, pack_rows=3):
            assert "forward" in vars(head)
            packed = model(input_ids=ids).logits
    assert "forward" not in vars(head)
    assert packed.dtype == torch.bfloat16
    assert torch.equal(packed, per_call)


@needs_packing
@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_in_bf16_samples_the_same_tokens_and_log_probs_on_packed_weights(architecture_models, family, monkeypatch):
    """generate() under bf16 autocast, as `auto` runs on this CPU, for long enough to pack: the packed
    products give the draws that the same products on the weights as they are (F.linear) give; and one
    forward with siblings joined is at least as close to float32's logits as peft's forward (measured:
    closer on all 13 architectures that pack, mean error 0.038-0.063 against peft's 0.035-0.066)."""
    from ppo_cli.engine import generate as generate_module
    from ppo_cli.engine import lean_lora as lean_module
    from ppo_cli.engine.frozen_weights import store_frozen_linears_in
    from ppo_cli.engine.generate import generate_with_logprobs
    from ppo_cli.recipe import GenerationConfig

    model = lora_adapted(architecture_models / family)
    store_frozen_linears_in(model, torch.bfloat16)  # as a run stores them under bf16 autocast
    vocab = model.get_output_embeddings().weight.shape[0]
    torch.manual_seed(1)
    prompt_ids = torch.randint(3, vocab, (6, 9))
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    prompt_mask[:2, :3] = False  # left padding
    # one forward, packed (siblings joined) against peft's and float32's from the same bf16 weights
    with torch.no_grad():
        exact = copy.deepcopy(model).float()(input_ids=prompt_ids, attention_mask=prompt_mask.long()).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            peft_logits = model(input_ids=prompt_ids, attention_mask=prompt_mask.long()).logits.float()
            with lean_module.lean_lora(model, pack_rows=6):
                packed_logits = model(input_ids=prompt_ids, attention_mask=prompt_mask.long()).logits.float()
    assert (packed_logits - exact).abs().mean() <= (peft_logits - exact).abs().mean()
    gen = GenerationConfig(max_new_tokens=MIN_STEPS, temperature=0.7)
    real = packed_product
    packs = []

    def unpacked_product(weight, bias, rows):
        weight, bias = weight.detach().to(torch.bfloat16), None if bias is None else bias.detach().to(torch.bfloat16)
        return lambda x: F.linear(x, weight, bias)

    samples = {}
    for product in (real, unpacked_product):
        monkeypatch.setattr(lean_module, "packed_product", lambda *args: packs.append(1) or product(*args))
        monkeypatch.setattr(generate_module, "packed_product", product)
        torch.manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            samples[product] = generate_with_logprobs(model, prompt_ids, prompt_mask, gen, stop_token_id=-1,
                                                      pad_token_id=0, keep_hidden=False)
        # GPT-2's projections are Conv1D layers (peft's fan_in_fan_out), which keep peft's forward
        assert (len(packs) == 0) == (family == "gpt2"), len(packs)
        packs.clear()
    (packed_gen, packed_logprobs, _), (plain_gen, plain_logprobs, _) = samples[real], samples[unpacked_product]
    assert torch.equal(packed_gen.response_ids, plain_gen.response_ids)
    assert torch.equal(packed_logprobs, plain_logprobs)


@needs_packing
@pytest.mark.parametrize("pack_weights, max_new_tokens, packs", [(True, MIN_STEPS, True), (True, MIN_STEPS - 1, False),
                                                                (False, MIN_STEPS, False)])
def test_generate_packs_where_the_recipe_lets_it_and_the_call_is_long_enough(architecture_models, monkeypatch,
                                                                             pack_weights, max_new_tokens, packs):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ppo_cli.engine import generate as generate_module
    from ppo_cli.engine import lean_lora as lean_module
    from ppo_cli.engine.generate import generate
    from ppo_cli.recipe import GenerationConfig

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(architecture_models / "llama", dtype=torch.float32),
                           LoraConfig(r=4, target_modules="all-linear"))
    calls = []
    for module in (lean_module, generate_module):
        monkeypatch.setattr(module, "packed_product", lambda *args: calls.append(1) or packed_product(*args))
    gen = GenerationConfig(max_new_tokens=max_new_tokens, pack_weights=pack_weights)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        generate(model, torch.randint(3, 50, (2, 5)), torch.ones(2, 5, dtype=torch.bool), gen, stop_token_id=-1,
                 pad_token_id=0)
    assert bool(calls) == packs
