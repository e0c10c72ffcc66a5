"""policy.adapter: an SFT adapter merged at load is the starting policy AND the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ppo_cli.engine.inference import load_inference_engine
from ppo_cli.engine.logprobs import position_ids_from_mask, selective_log_softmax
from ppo_cli.engine.engine import load_engine
from ppo_cli.model_refs import resolve_model_reference
from ppo_cli.recipe_loading import dump_resolved, load_recipe
from ppo_cli.train_setup import init_state
from ppo_cli.trainer import train_step
from tests.conftest import ROOT, tiny_overrides

# Every test loads the tiny models with an SFT adapter: the slow suite.
pytestmark = pytest.mark.slow

PROMPTS = ["I think the book was", "The movie was", "Overall, the product is", "This phone is"]
SMALL = {"ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 2, "ppo.micro_batch_size": 2,
         "ppo.ppo_epochs": 1, "generation.max_new_tokens": 8}
FULL_FINETUNE = {"policy.lora": "null", "value.kind": "model"}


def _recipe(tiny_models, tmp_path, adapter, **extra):
    sets = {**SMALL, "policy.adapter": str(adapter), **extra}
    # float32: log-probs are compared with the plain float32 forward of the merged model (1e-5).
    return load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", tiny_overrides(tiny_models, tmp_path / "runs", float32=True, **sets))


def _plain_logprobs(model, generation, temperature: float = 1.0) -> torch.Tensor:
    """(B, T) log-probs of the sampled responses under a plain transformers/peft model, masked."""
    T = generation.response_ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=generation.sequences, attention_mask=generation.attention_mask.long(),
                       position_ids=position_ids_from_mask(generation.attention_mask)).logits[:, -T - 1 : -1]
    return selective_log_softmax(logits.float() / temperature, generation.response_ids)[generation.response_mask]


def _base_and_sft(tiny_models, adapter):
    """The bare base and base + adapter (peft, unmerged): the independent ground truth."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_models / "policy", dtype=torch.float32).eval()
    sft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_models / "policy", dtype=torch.float32),
                                    str(adapter)).eval()
    return base, sft


@pytest.mark.parametrize("extra", [{}, FULL_FINETUNE], ids=["lora", "full"])
def test_sft_adapter_is_start_and_reference_and_first_kl_is_zero(tiny_models, sft_adapter, tmp_path, extra):
    engine = load_engine(_recipe(tiny_models, tmp_path, sft_adapter, **extra))
    ac = engine.actor_critic
    if ac.value_backbone is not None:  # a critic initialised from the policy starts from the SFT model too
        merged_q = ac.ref_model.model.layers[0].self_attn.q_proj.weight
        assert torch.equal(ac.value_backbone.layers[0].self_attn.q_proj.weight, merged_q)
    torch.manual_seed(0)
    metrics, rollout = train_step(init_state(engine, PROMPTS))
    mask = rollout.generation.response_mask
    base, sft = _base_and_sft(tiny_models, sft_adapter)
    expected = _plain_logprobs(sft, rollout.generation)

    torch.testing.assert_close(rollout.logprobs[mask], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(rollout.ref_logprobs[mask], expected, atol=1e-5, rtol=0)
    assert (_plain_logprobs(base, rollout.generation) - expected).abs().max() > 0.05  # the adapter matters
    assert metrics["objective/kl"] == 0.0


def test_sft_adapter_with_4bit_base_has_zero_first_kl(tiny_models, sft_adapter, tmp_path):
    engine = load_engine(_recipe(tiny_models, tmp_path, sft_adapter, **{"policy.quantization": "4bit"}))
    torch.manual_seed(0)
    metrics, rollout = train_step(init_state(engine, PROMPTS))
    assert metrics["objective/kl"] == 0.0
    # Quantizing base + adapter stays near base + adapter (nf4 rounding), far from the bare base.
    base, sft = _base_and_sft(tiny_models, sft_adapter)
    mask = rollout.generation.response_mask
    to_sft = (rollout.logprobs[mask] - _plain_logprobs(sft, rollout.generation)).abs().mean()
    to_base = (rollout.logprobs[mask] - _plain_logprobs(base, rollout.generation)).abs().mean()
    assert to_sft < to_base / 2


def _fake_run(recipe, tmp_path: Path) -> Path:
    run = tmp_path / "runs" / recipe.name
    run.mkdir(parents=True)
    (run / "recipe.yaml").write_text(dump_resolved(recipe))
    return run


@pytest.mark.parametrize("extra", [{}, FULL_FINETUNE], ids=["lora", "full"])
def test_eval_base_samples_the_sft_model_with_zero_kl(tiny_models, sft_adapter, tmp_path, extra):
    recipe = _recipe(tiny_models, tmp_path, sft_adapter, **extra)
    model = resolve_model_reference("base", _fake_run(recipe, tmp_path))
    assert model.base_adapter == str(sft_adapter)
    engine = load_inference_engine(recipe, model)
    assert engine.actor_critic.reference_is_policy
    torch.manual_seed(0)
    generation = engine.generate(PROMPTS)
    logprobs, ref_logprobs, _, _ = engine.evaluate_logprobs_and_values(generation, 4)
    expected = _plain_logprobs(_base_and_sft(tiny_models, sft_adapter)[1], generation)
    torch.testing.assert_close(logprobs[generation.response_mask], expected, atol=1e-5, rtol=0)
    assert torch.equal(logprobs, ref_logprobs)


def test_eval_hub_style_model_with_sft_recipe_loads_the_sft_reference(tiny_models, sft_adapter, tmp_path):
    """A model outside the run (here the bare base as a plain directory) is compared with the recipe's
    reference: base + adapter, loaded as a separate copy."""
    recipe = _recipe(tiny_models, tmp_path, sft_adapter)
    engine = load_inference_engine(recipe, resolve_model_reference(str(tiny_models / "policy")))
    assert engine.actor_critic.ref_model is not None and not engine.actor_critic.reference_is_policy
    torch.manual_seed(0)
    generation = engine.generate(PROMPTS)
    _, ref_logprobs, _, _ = engine.evaluate_logprobs_and_values(generation, 4)
    expected = _plain_logprobs(_base_and_sft(tiny_models, sft_adapter)[1], generation)
    torch.testing.assert_close(ref_logprobs[generation.response_mask], expected, atol=1e-5, rtol=0)


def test_adapter_for_another_model_fails_in_one_line(tiny_models, sft_adapter, tmp_path):
    import json
    import shutil

    from ppo_cli.errors import ModelLoadError

    other = tmp_path / "other"
    shutil.copytree(sft_adapter, other)
    config = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["not_a_module"]}))
    with pytest.raises(ModelLoadError) as err:
        load_engine(_recipe(tiny_models, tmp_path, other))
    assert err.value.message.startswith(f"cannot apply adapter '{other}' (policy.adapter) to '{tiny_models / 'policy'}': ")
    assert "\n" not in err.value.message
    assert err.value.hint == "the adapter must have been trained on this base model (policy.path)"


def test_adapter_trained_on_another_architecture_is_refused_even_when_its_shapes_fit(tiny_models, sft_adapter, tmp_path):
    """peft records the base's class; shapes that happen to fit would otherwise merge another model's delta."""
    import json
    import shutil

    from ppo_cli.errors import ModelLoadError

    other = tmp_path / "gemma-sft"
    shutil.copytree(sft_adapter, other)
    config = json.loads((other / "adapter_config.json").read_text())
    config["auto_mapping"] = {"base_model_class": "Gemma2ForCausalLM", "parent_library": "transformers.models.gemma2.modeling_gemma2"}
    (other / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as err:
        load_engine(_recipe(tiny_models, tmp_path, other))
    assert err.value.message == (f"adapter '{other}' (policy.adapter) was trained on a Gemma2ForCausalLM, "
                                 f"but '{tiny_models / 'policy'}' is a Qwen2ForCausalLM")
