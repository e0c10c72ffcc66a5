"""value.kind auto: the critic it stands for, read from the recipe and the models' files (no model loaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppo_cli.auto import ValueSettings, value_kind, value_model_path, value_settings
from ppo_cli.plan_memory import settings_from_recipe
from ppo_cli.recipe_loading import load_recipe

TOKENIZER = {"version": "1.0", "truncation": None, "padding": None,
             "added_tokens": [{"id": 3, "content": "<eos>", "special": True}],
             "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}}

RECIPE = """\
name: auto
policy:
  path: {policy}
  lora: {lora}
reward:
  components:
    - type: function
      function: rewards.py:length_reward
{reward}
data:
  prompts: prompts.txt
train:
  total_updates: 2
"""


def model_dir(root: Path, name: str, model_type: str = "qwen2", tokenizer: dict | None = None) -> Path:
    path = root / name
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    if tokenizer is not None:
        (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    return path


def recipe(tmp_path: Path, reward: str = "", lora: bool = True, overrides: tuple[str, ...] = ()):
    policy = model_dir(tmp_path, "policy", tokenizer=TOKENIZER)
    text = RECIPE.format(policy=policy, lora="{r: 4}" if lora else "null", reward=reward)
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return load_recipe(path, list(overrides))


def scalar_reward(path: Path, quantization: str = "none") -> str:
    return f"    - type: model\n      path: {path}\n      quantization: {quantization}"


@pytest.mark.parametrize("lora", [True, False])
def test_auto_is_the_frozen_reward_model_critic_with_a_reward_model_of_the_policys_kind(tmp_path, lora):
    # Padding settings and how a version of `tokenizers` writes merges or an unset field: not the vocabulary.
    rm = model_dir(tmp_path, "rm", tokenizer={**TOKENIZER, "padding": {"direction": "Left"},
                                              "model": {**TOKENIZER["model"], "merges": ["a b"], "end_of_word_suffix": ""}})
    r = recipe(tmp_path, scalar_reward(rm), lora=lora)
    assert value_settings(r) == ValueSettings("model", "reward", False, str(rm), "float32")
    assert value_kind(r) == "model" and value_model_path(r) == str(rm)
    s = settings_from_recipe(r, "cpu", prompt_len=16)
    assert (s.value_kind, s.value_frozen, s.value_shared) == ("model", True, True)  # `ppo plan`: no second copy


@pytest.mark.parametrize("lora", [True, False])
def test_auto_is_the_value_head_without_a_reward_model(tmp_path, lora):
    r = recipe(tmp_path, lora=lora)
    assert value_settings(r) == ValueSettings("head", "policy", None, None, None)


@pytest.mark.parametrize("other", [
    {**TOKENIZER, "model": {**TOKENIZER["model"], "vocab": {"a": 0, "b": 2, "ab": 1}}},
    {**TOKENIZER, "model": {**TOKENIZER["model"], "merges": []}},
    {**TOKENIZER, "added_tokens": [{"id": 3, "content": "</s>", "special": True}]},
], ids=["vocab", "merges", "added tokens"])
def test_auto_is_the_value_head_when_the_reward_model_reads_another_tokenizer(tmp_path, other):
    assert value_kind(recipe(tmp_path, scalar_reward(model_dir(tmp_path, "rm", tokenizer=other)))) == "head"


def test_auto_is_the_value_head_when_the_reward_model_is_another_architecture(tmp_path):
    rm = model_dir(tmp_path, "rm", model_type="bert", tokenizer=TOKENIZER)  # e.g. a bidirectional encoder
    assert value_kind(recipe(tmp_path, scalar_reward(rm))) == "head"


def test_auto_is_the_value_head_when_the_reward_model_has_no_tokenizer_file(tmp_path):
    assert value_kind(recipe(tmp_path, scalar_reward(model_dir(tmp_path, "rm", tokenizer=None)))) == "head"


def test_auto_is_the_value_head_when_the_reward_model_is_not_on_this_machine(tmp_path):
    assert value_kind(recipe(tmp_path, scalar_reward(tmp_path / "missing"))) == "head"


def test_auto_is_the_value_head_with_a_quantized_reward_model(tmp_path):
    rm = model_dir(tmp_path, "rm", tokenizer=TOKENIZER)
    assert value_kind(recipe(tmp_path, scalar_reward(rm, "4bit"))) == "head"  # its weights could not be shared


def test_auto_with_a_classifier_reward_is_the_value_head(tmp_path):
    rm = model_dir(tmp_path, "rm", tokenizer=TOKENIZER)
    reward = f"    - type: classifier\n      path: {rm}\n      labels: {{positive: 1.0}}"
    assert value_kind(recipe(tmp_path, reward)) == "head"  # no scalar score head to start from


def test_auto_follows_what_the_recipe_names(tmp_path):
    rm = model_dir(tmp_path, "rm", tokenizer=TOKENIZER)
    assert value_settings(recipe(tmp_path, scalar_reward(rm), overrides=("value.lora={r: 8}",))).kind == "adapter"
    named = recipe(tmp_path, scalar_reward(rm), overrides=("value.path=other",))
    assert value_settings(named) == ValueSettings("model", "policy", None, "other", None)
    trained = recipe(tmp_path, scalar_reward(rm), overrides=("value.init_from=reward",))
    assert value_settings(trained) == ValueSettings("model", "reward", None, None, None)  # TRL's critic, trained
    assert value_settings(recipe(tmp_path, scalar_reward(rm), overrides=("value.train_backbone=true",))).kind == "head"


def test_a_concrete_kind_is_kept(tmp_path):
    rm = model_dir(tmp_path, "rm", tokenizer=TOKENIZER)
    for kind in ("adapter", "head", "model"):
        assert value_kind(recipe(tmp_path, scalar_reward(rm), overrides=(f"value.kind={kind}",))) == kind


def test_separate_value_model_on_the_policys_tokenizer_passes_the_check_before_loading(tmp_path):
    from ppo_cli.engine.actor_critic import check_value_model_tokenizer

    value = model_dir(tmp_path, "value", tokenizer=TOKENIZER)
    check_value_model_tokenizer(recipe(tmp_path, overrides=("value.kind=model", f"value.path={value}")))


def test_separate_value_model_without_tokenizer_files_is_refused_before_loading(tmp_path):
    from ppo_cli.engine.actor_critic import check_value_model_tokenizer
    from ppo_cli.errors import ModelReferenceError

    value = model_dir(tmp_path, "value", tokenizer=None)
    with pytest.raises(ModelReferenceError) as err:
        check_value_model_tokenizer(recipe(tmp_path, overrides=("value.kind=model", f"value.path={value}")))
    assert err.value.message == (f"value model '{value}' has no tokenizer files to compare with the policy's, "
                                 "but reads the policy's token ids")


def test_value_lora_with_auto_and_no_lora_policy_is_refused_without_reading_the_models(tmp_path):
    from ppo_cli.errors import RecipeError

    with pytest.raises(RecipeError) as err:
        recipe(tmp_path, lora=False, overrides=("value.lora={r: 8}",))
    assert err.value.message == "--set value.lora: only used with value kind 'adapter', but the value kind is 'auto'"
