"""Sampling's LoRA layers in two ops (engine/lean_lora.py): peft's numbers, by hand and on every
architecture of the matrix, and peft's own forward wherever a layer is not a plain LoRA Linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ppo_cli.engine import lean_lora as lean_module
from ppo_cli.engine.lean_lora import lean_lora
from tests.fixtures.architectures import FAMILIES, lora_adapted


def _adapted(seed: int = 0, **lora) -> nn.Module:
    """Two Linear layers with a LoRA adapter whose B is not zero (a fresh one's is, and would add nothing)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 5, bias=False))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=6, target_modules=["0", "2"], **lora))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(param, std=0.5)
    return model


def _lora_layers(model):
    from peft.tuners.lora.layer import Linear as LoraLinear

    return [m for m in model.modules() if isinstance(m, LoraLinear)]


def test_a_layer_adds_scaling_times_its_two_products_to_the_base_by_hand():
    model = _adapted()
    layer = _lora_layers(model)[1]  # Linear(6, 5), no bias; scaling = alpha / r = 1.5
    x = torch.randn(3, 6)
    W, A, B = layer.base_layer.weight, layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = x @ W.T + 1.5 * (x @ A.T) @ B.T
    with torch.no_grad(), lean_lora(model) as installed:
        assert installed == 2 and "forward" in vars(layer)
        got = layer(x)
    assert "forward" not in vars(layer)  # peft's forward again outside
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(got, layer(x), atol=1e-6, rtol=1e-6)  # and peft's


def test_under_autocast_the_sum_is_rounded_once():
    """A bf16 base under autocast, as a run's frozen weights are: peft rounds the adapter's product to bf16,
    then the sum; here the sum is rounded once, so it is at least as close to the exact value."""
    model = _adapted(seed=1)
    for layer in _lora_layers(model):
        layer.base_layer.to(torch.bfloat16)
    layer = _lora_layers(model)[0]
    x = torch.randn(64, 8)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        peft_out = layer(x)
        with lean_lora(model):
            lean_out = layer(x)
    assert lean_out.dtype == peft_out.dtype == torch.bfloat16
    # exact: the same bf16 operands, multiplied and summed in float64
    bf = lambda t: t.detach().to(torch.bfloat16).double()  # noqa: E731
    W, b = bf(layer.base_layer.weight), bf(layer.base_layer.bias)
    A, B = bf(layer.lora_A["default"].weight), bf(layer.lora_B["default"].weight)
    h = (bf(x) @ A.T).to(torch.bfloat16).double()  # both round x @ A^T to bf16 (the first product's output)
    exact = bf(x) @ W.T + b + 1.5 * h @ B.T
    lean_error = (lean_out.double() - exact).abs().max().item()
    peft_error = (peft_out.double() - exact).abs().max().item()
    assert lean_error <= peft_error
    assert lean_error <= exact.abs().max().item() * 2 ** -8  # within one bf16 rounding of the largest value


def test_a_bf16_base_without_autocast_adds_the_float32_adapter_in_float32():
    """A model loaded in bf16 with mixed_precision no (the 1.5B recipe on a GPU): peft computes the adapter
    in its float32, adds in float32 and casts the sum back to bf16; so does this."""
    model = _adapted(seed=2)
    model.base_model.model.to(torch.bfloat16)
    for layer in _lora_layers(model):
        for adapter in (layer.lora_A["default"], layer.lora_B["default"]):
            adapter.float()
    x = torch.randn(16, 8).to(torch.bfloat16)
    with torch.no_grad():
        peft_out = model(x)
        with lean_lora(model) as installed:
            assert installed == 2
            lean_out = model(x)
    assert lean_out.dtype == torch.bfloat16
    torch.testing.assert_close(lean_out.float(), peft_out.float(), atol=0, rtol=2 ** -8)


def test_with_gradients_on_a_layer_runs_peft_s_forward_and_trains():
    model = _adapted()
    x = torch.randn(4, 8)
    model(x).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with lean_lora(model):
        model(x).sum().backward()
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == expected.keys() and any("lora_A" in n for n in got)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=0, rtol=0)


def test_a_disabled_adapter_inside_gives_the_base():
    model = _adapted()
    x = torch.randn(4, 8)
    with torch.no_grad():
        with model.disable_adapter():
            base = model(x)
        with lean_lora(model), model.disable_adapter():
            got = model(x)
    torch.testing.assert_close(got, base, atol=0, rtol=0)


@pytest.mark.parametrize("case", ["dora", "dropout", "merged", "partitioned", "switched_off"])
def test_a_layer_that_is_not_a_plain_lora_linear_keeps_peft_s_forward(case, monkeypatch):
    model = _adapted(**({"use_dora": True} if case == "dora" else {"lora_dropout": 0.1} if case == "dropout" else {}))
    x = torch.randn(4, 8)
    if case == "merged":
        model.merge_adapter()
    if case == "partitioned":  # as ZeRO-3 leaves a partitioned parameter
        _lora_layers(model)[0].base_layer.weight.data = torch.empty(0)
    if case == "switched_off":
        monkeypatch.setattr(lean_module, "ENABLED", False)
    with torch.no_grad(), lean_lora(model) as installed:
        assert installed == (1 if case == "partitioned" else 0)
        if case != "partitioned":
            model.eval()  # dropout's own randomness off, to compare with peft's
            torch.testing.assert_close(model(x), model.base_model(x), atol=0, rtol=0)


def test_a_4bit_base_keeps_peft_s_forward():
    bnb = pytest.importorskip("bitsandbytes")
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    linear = bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4", compute_dtype=torch.float32)
    linear.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4")
    linear = linear.to("cpu")
    model = get_peft_model(nn.Sequential(linear), LoraConfig(r=4, target_modules=["0"]))
    with torch.no_grad(), lean_lora(model) as installed:
        assert installed == 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_generate_samples_the_same_tokens_and_log_probs_on_every_architecture(architecture_models, family, monkeypatch):
    from ppo_cli.engine.generate import generate_with_logprobs
    from ppo_cli.recipe import GenerationConfig

    model = lora_adapted(architecture_models / family)
    with lean_lora(model) as installed:
        # GPT-2's projections are Conv1D layers (peft's fan_in_fan_out), which keep peft's forward
        assert (installed == 0) == (family == "gpt2"), installed
    vocab = model.get_output_embeddings().weight.shape[0]
    torch.manual_seed(1)
    prompt_ids = torch.randint(3, vocab, (6, 9))
    prompt_mask = torch.ones_like(prompt_ids, dtype=torch.bool)
    prompt_mask[:2, :3] = False  # left padding
    gen = GenerationConfig(max_new_tokens=8, temperature=0.7)
    samples = {}
    for lean in (True, False):
        monkeypatch.setattr(lean_module, "ENABLED", lean)
        torch.manual_seed(0)
        samples[lean] = generate_with_logprobs(model, prompt_ids, prompt_mask, gen, stop_token_id=-1, pad_token_id=0,
                                               keep_hidden=False)
    (lean_gen, lean_logprobs, _), (peft_gen, peft_logprobs, _) = samples[True], samples[False]
    assert torch.equal(lean_gen.response_ids, peft_gen.response_ids)
    torch.testing.assert_close(lean_logprobs, peft_logprobs, atol=1e-5, rtol=0)
