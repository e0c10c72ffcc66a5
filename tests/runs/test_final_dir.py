"""final/ and checkpoints: the policy at the top (hub layout) with a model card, the critic in critic/,
paths as the recipe gave them, and directories in the older layout (critic at the top) still load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ppo_cli.checkpoint import (
    CRITIC,
    MANIFEST,
    load_checkpoint,
    load_policy_and_value,
    save_checkpoint,
    save_final,
    save_policy_and_value,
    write_manifest,
)
from ppo_cli.model_card import hub_base_model, parse_front_matter, render_model_card
from ppo_cli.recipe_loading import dump_resolved, load_recipe
from tests.conftest import ROOT, tiny_overrides

PROMPTS = ["I think the book was", "The movie was", "Overall, the product is", "This phone is"]
SMALL = {"ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 2, "ppo.micro_batch_size": 2,
         "ppo.ppo_epochs": 1, "generation.max_new_tokens": 8}
FULL_FINETUNE = {"policy.lora": "null", "value.kind": "model"}
BEFORE = {"score": -5.83, "eos_rate": 0.19, "response_length": 21.6, "kl": 0.0}
AFTER = {"score": 9.35, "eos_rate": 1.0, "response_length": 5.0, "kl": 7.17}


def _engine(policy_path, output_dir, models: Path, **extra):
    from ppo_cli.engine.engine import load_engine

    sets = {**SMALL, **extra}
    # float32: the saved and merged models must give the trained logits to 1e-5 / 1e-4.
    overrides = tiny_overrides(models, Path(output_dir), float32=True, **sets)
    overrides = [o for o in overrides if not o.startswith("policy.path=")] + [f"policy.path={policy_path}"]
    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", overrides)
    torch.manual_seed(0)
    return load_engine(recipe)


def _perturb_adapters(policy) -> None:
    """LoRA B starts at zero; give every adapter weights of its own so a wrong load cannot pass."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)


def _info(recipe, step: int = 1) -> dict:
    return {"name": recipe.name, "policy_path": recipe.policy.path, "policy_adapter": recipe.policy.adapter,
            "lora": recipe.policy.lora is not None, "value_kind": "adapter", "step": step, "trust_remote_code": False}


# --- the model card, without models ---------------------------------------------------------------


def test_hub_base_model_is_the_hub_id_or_the_id_a_local_config_records(tmp_path):
    assert hub_base_model("Qwen/Qwen2.5-1.5B") == "Qwen/Qwen2.5-1.5B"  # not a local directory: loaded from the hub
    (tmp_path / "recorded").mkdir()
    (tmp_path / "recorded" / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen2.5-0.5B"}))
    assert hub_base_model(str(tmp_path / "recorded")) == "Qwen/Qwen2.5-0.5B"
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "config.json").write_text(json.dumps({"_name_or_path": "/home/me/models/x"}))
    assert hub_base_model(str(tmp_path / "local")) is None
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text("{}")
    assert hub_base_model(str(tmp_path / "bare")) is None


def test_model_card_front_matter_and_numbers():
    info = {"name": "qwen-sentiment", "policy_path": "Qwen/Qwen2.5-1.5B", "policy_adapter": "me/qwen-sft", "lora": True, "step": 30}
    card = render_model_card(info, "name: qwen-sentiment\nseed: 0\n", BEFORE, AFTER)
    assert parse_front_matter(card) == {"base_model": "Qwen/Qwen2.5-1.5B", "library_name": "peft",
                                        "tags": ["ppo_cli", "ppo", "rlhf", "reinforcement-learning"]}
    assert "| mean reward | -5.830 | +9.350 |" in card
    assert "| EOS rate | 19% | 100% |" in card
    assert "| mean length (tokens) | 21.6 | 5.0 |" in card
    assert "| KL to the reference (nats per response) | 0.000 | 7.170 |" in card
    assert "```yaml\nname: qwen-sentiment\nseed: 0\n```" in card
    assert "PeftModel.from_pretrained(model, 'me/qwen-sft').merge_and_unload()" in card


def test_model_card_of_a_full_finetune_without_eval_prompts():
    card = render_model_card({"policy_path": "gpt2", "lora": False, "step": 3}, "name: x\n")
    assert parse_front_matter(card)["library_name"] == "transformers"
    assert "no before/after numbers" in card and "PeftModel" not in card


def test_model_card_of_a_critic_free_run_names_the_estimator_and_no_critic():
    info = {"policy_path": "gpt2", "lora": True, "step": 3, "value_kind": "none", "advantage": "grpo"}
    card = render_model_card(info, "name: x\n")
    assert "A LoRA adapter (peft) trained with GRPO (RLHF, no critic) by ppo_cli for 3 updates" in card
    assert "critic/" not in card
    assert "trained with PPO (RLHF)" in render_model_card({**info, "advantage": "gae", "value_kind": "head"}, "name: x\n")


# --- final/ written from real models ---------------------------------------------------------------


@pytest.mark.slow
def test_final_dir_is_hub_ready_with_relative_paths_kept(tiny_models, sft_adapter, tmp_path, monkeypatch):
    """Run from a directory where the recipe's relative paths resolve: nothing in final/ may name the
    absolute path of this machine, and --merge folds base + SFT adapter + PPO adapter together."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    shutil.copytree(tiny_models / "policy", tmp_path / "models" / "policy")
    shutil.copytree(sft_adapter, tmp_path / "sft")
    monkeypatch.chdir(tmp_path)
    engine = _engine("models/policy", "runs", tiny_models, **{"policy.adapter": "sft"})
    _perturb_adapters(engine.actor_critic.policy)
    info = _info(engine.recipe)
    card = render_model_card(info, dump_resolved(engine.recipe), BEFORE, AFTER)
    final = Path("runs/final")
    save_final(engine.actor_critic, engine.tokenizer, final, info, torch.float32, model_card=card)

    meta = parse_front_matter((final / "README.md").read_text())
    assert meta == {"library_name": "peft", "tags": ["ppo_cli", "ppo", "rlhf", "reinforcement-learning"]}  # local base
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == "models/policy"
    assert json.loads((final / "ppo_cli.json").read_text())["policy_adapter"] == "sft"
    assert "adapter `sft` merged in" in (final / "README.md").read_text()
    for path in final.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".md", ".txt", ".jinja"):
            assert str(tmp_path) not in path.read_text(), path
    assert sorted(p.name for p in (final / CRITIC).iterdir()) == ["value_adapter", "value_head.safetensors"]
    assert not (final / "value_head.safetensors").exists() and not (final / "value_adapter").exists()

    # The adapter loads with peft on base + SFT, and merged/ is that same model in plain weights.
    ids = torch.tensor([[5, 17, 42, 9, 33]])
    engine.actor_critic.use_adapter("policy")
    with torch.no_grad():
        trained = engine.actor_critic.policy(input_ids=ids).logits
        sft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("models/policy"), "sft").merge_and_unload()
        assert (sft(ids).logits - trained).abs().max() > 1e-2  # the PPO adapter changes the model
        adapted = PeftModel.from_pretrained(sft, str(final)).eval()  # injects its layers into sft itself
        torch.testing.assert_close(adapted(ids).logits, trained, atol=1e-5, rtol=0)
        merged = AutoModelForCausalLM.from_pretrained(final / "merged").eval()
        torch.testing.assert_close(merged(ids).logits, trained, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_qlora_with_sft_adapter_names_the_recipe_base_not_the_temporary_merge(tiny_models, sft_adapter, tmp_path, monkeypatch):
    shutil.copytree(tiny_models / "policy", tmp_path / "models" / "policy")
    monkeypatch.chdir(tmp_path)
    engine = _engine("models/policy", "runs", tiny_models, **{"policy.adapter": str(sft_adapter), "policy.quantization": "4bit"})
    (tmp_path / "saved").mkdir()
    save_policy_and_value(engine.actor_critic, engine.tokenizer, tmp_path / "saved")
    for name in ("adapter_config.json", "critic/value_adapter/adapter_config.json"):
        assert json.loads((tmp_path / "saved" / name).read_text())["base_model_name_or_path"] == "models/policy", name


def _to_old_layout(directory: Path) -> None:
    """The layout before critic/: its files at the top of the directory, manifest rewritten."""
    for item in (directory / CRITIC).iterdir():
        shutil.move(str(item), directory / item.name)
    (directory / CRITIC).rmdir()
    manifest = json.loads((directory / MANIFEST).read_text())
    write_manifest(directory, {k: v for k, v in manifest.items() if k != "files"})


def _parameters(module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


@pytest.mark.slow
def test_resume_from_a_checkpoint_with_the_critic_at_the_top(tiny_models, tmp_path):
    from ppo_cli.train_setup import init_state
    from ppo_cli.trainer import train_step

    policy = str(tiny_models / "policy")
    state = init_state(_engine(policy, tmp_path, tiny_models), PROMPTS)
    train_step(state)
    checkpoint = save_checkpoint(state, tmp_path / "checkpoints", keep=2)
    assert (checkpoint / CRITIC / "value_head.safetensors").is_file()
    _to_old_layout(checkpoint)
    fresh = init_state(_engine(policy, tmp_path, tiny_models), PROMPTS)
    load_checkpoint(fresh, checkpoint)
    expected, loaded = _parameters(state.engine.actor_critic), _parameters(fresh.engine.actor_critic)
    assert any(".value." in name and "lora_B" in name for name in expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["critic-subfolder", "old-critic-at-top"])
def test_full_finetune_policy_and_value_model_round_trip(tiny_models, tmp_path, layout):
    policy = str(tiny_models / "policy")
    engine = _engine(policy, tmp_path, tiny_models, **FULL_FINETUNE)
    ac = engine.actor_critic
    with torch.no_grad():
        for param in list(ac.policy.parameters())[:3] + list(ac.value_backbone.parameters())[:3]:
            param.add_(0.01)
    directory = tmp_path / "saved"
    directory.mkdir()
    save_policy_and_value(ac, engine.tokenizer, directory)
    write_manifest(directory, {"kind": "checkpoint"})
    assert (directory / CRITIC / "value_model" / "config.json").is_file()
    if layout == "old-critic-at-top":
        _to_old_layout(directory)
    fresh = _engine(policy, tmp_path, tiny_models, **FULL_FINETUNE).actor_critic
    load_policy_and_value(fresh, directory)
    expected, loaded = _parameters(ac), _parameters(fresh)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
