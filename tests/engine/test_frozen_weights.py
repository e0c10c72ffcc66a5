"""A LoRA policy's frozen Linear weights stored in bf16 under bf16 autocast (engine/frozen_weights.py):
bit-identical sampling, log-probs and gradients, half the frozen weights' bytes."""

import pytest
import torch

from ppo_cli.engine.actor_critic import policy_forward, reference_logprobs
from ppo_cli.recipe_loading import load_recipe
from tests.conftest import ROOT, tiny_overrides

pytestmark = pytest.mark.slow
PROMPTS = ["I think the book was", "The movie was", "Overall, the product is", "This phone is"]


def _computed(engine) -> dict[str, torch.Tensor]:
    """Sampled tokens, policy log-probs, reference log-probs and the LoRA gradients of one loss."""
    ac = engine.actor_critic
    torch.manual_seed(3)
    generation = engine.generate(PROMPTS)
    seq, attn, resp = generation.sequences, generation.attention_mask, generation.response_ids
    ac.policy.zero_grad(set_to_none=True)
    with engine.autocast():
        logprobs, _, _ = policy_forward(ac, seq, attn, resp, 1.0)
        with torch.no_grad():
            ref = reference_logprobs(ac, seq, attn, resp, 1.0)
    (logprobs * generation.response_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in ac.policy.named_parameters() if p.requires_grad}
    return {"tokens": generation.response_ids, "logprobs": logprobs.detach(), "ref": ref, **grads}


def test_frozen_linears_in_bf16_compute_exactly_what_bf16_autocast_computes_with_float32_weights(tiny_models, tmp_path):
    from ppo_cli.engine.engine import load_engine

    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml",
                         tiny_overrides(tiny_models, tmp_path, **{"train.mixed_precision": "bf16"}))
    engine = load_engine(recipe)
    policy = engine.actor_critic.policy
    before = _computed(engine)
    q_proj = policy.base_model.model.model.layers[0].self_attn.q_proj
    stored = engine.store_frozen_weights_in_compute_dtype()
    after = _computed(engine)

    base = [m.base_layer for m in policy.modules() if hasattr(m, "base_layer") and type(m.base_layer) is torch.nn.Linear]
    assert stored == len(base) > 0  # every layer LoRA wraps; the LM head is the embedding's, left float32
    trained = {n: p.dtype for n, p in policy.named_parameters() if "lora_" in n}
    assert trained and set(trained.values()) == {torch.float32}
    assert q_proj.base_layer.weight.dtype == torch.bfloat16 and q_proj.lora_A["policy"].weight.dtype == torch.float32
    assert policy.get_input_embeddings().weight.dtype == torch.float32  # the lookup is not autocast
    assert after.keys() == before.keys() and len(before) > 3
    for name, value in before.items():
        assert torch.equal(after[name], value), name


def test_frozen_linears_stay_float32_without_mixed_precision(tiny_models, tmp_path):
    from ppo_cli.engine.engine import load_engine

    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", tiny_overrides(tiny_models, tmp_path, float32=True))
    engine = load_engine(recipe)
    assert engine.store_frozen_weights_in_compute_dtype() == 0
    assert {p.dtype for p in engine.actor_critic.policy.parameters()} == {torch.float32}
