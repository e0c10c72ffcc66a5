"""The four roles on the tiny models: reference by adapter switching, critics, QLoRA, weights that move."""


from pathlib import Path

import pytest
import torch

from ppo_cli.algo.losses import entropy_from_logits
from ppo_cli.engine.actor_critic import policy_forward
from ppo_cli.engine.logprobs import position_ids_from_mask, selective_log_softmax
from ppo_cli.engine.models import unwrap_causal_lm
from ppo_cli.engine.engine import load_engine
from ppo_cli.recipe_loading import load_recipe
from ppo_cli.train_setup import init_state
from ppo_cli.trainer import train_step
from tests.conftest import ROOT, tiny_overrides

# Every test loads an engine on the tiny models: the slow suite.
pytestmark = pytest.mark.slow

PROMPTS = ["I think the book was", "The movie was", "Overall, the product is", "This phone is"]


@pytest.fixture
def make_engine(tiny_models, tmp_path):
    def make(**extra):
        sets = {"ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 2, "ppo.micro_batch_size": 1,
                "ppo.ppo_epochs": 1, "generation.max_new_tokens": 8, **extra}
        # float32: these tests hold the engine's log-probs to plain float32 forwards (1e-5, 1e-6).
        recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", tiny_overrides(tiny_models, tmp_path, float32=True, **sets))
        torch.manual_seed(0)
        return load_engine(recipe)

    return make


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _changed(before: dict, module: torch.nn.Module) -> set[str]:
    return {name for name, p in module.named_parameters() if not torch.equal(before[name], p.detach())}


def test_policy_forward_matches_plain_model_logits(make_engine):
    engine = make_engine(**{"generation.temperature": 0.7})
    generation = engine.generate(PROMPTS)
    T = generation.response_ids.shape[1]
    with torch.no_grad():
        logprobs, entropies, _ = policy_forward(engine.actor_critic, generation.sequences, generation.attention_mask,
                                                generation.response_ids, 0.7, "value")
        plain = unwrap_causal_lm(engine.actor_critic.policy)(
            input_ids=generation.sequences, attention_mask=generation.attention_mask.long(),
            position_ids=position_ids_from_mask(generation.attention_mask),
        ).logits[:, -T - 1 : -1]
    plain = plain.float() / 0.7
    torch.testing.assert_close(logprobs, selective_log_softmax(plain, generation.response_ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(entropies, entropy_from_logits(plain), atol=1e-5, rtol=1e-5)


def test_lora_reference_equals_policy_at_init_and_first_ratio_is_one(make_engine):
    engine = make_engine()
    rollout = engine.collect_rollout(PROMPTS)
    mask = rollout.generation.response_mask
    # LoRA B starts at zero: the base with the adapter disabled is the policy itself.
    torch.testing.assert_close(rollout.logprobs[mask], rollout.ref_logprobs[mask], atol=1e-6, rtol=0)
    # The update's grad-enabled forward reproduces the rollout's no-grad log-probs (ratio = 1).
    new_logprobs, _, _ = policy_forward(engine.actor_critic, rollout.generation.sequences, rollout.generation.attention_mask,
                                        rollout.generation.response_ids, 1.0)
    assert new_logprobs.requires_grad
    torch.testing.assert_close(new_logprobs.detach()[mask], rollout.logprobs[mask], atol=1e-5, rtol=0)


def test_one_update_moves_both_adapters_and_head_but_not_the_base(make_engine):
    engine = make_engine()
    ac = engine.actor_critic
    before = _snapshot(ac)
    state = init_state(engine, PROMPTS)
    train_step(state)
    changed = _changed(before, ac)
    assert any(".policy." in n and "lora_" in n for n in changed), "policy adapter did not train"
    assert any(".value." in n and "lora_" in n for n in changed), "value adapter did not train"
    assert {"value_head.weight", "value_head.bias"} <= changed
    assert not [n for n in changed if "lora_" not in n and not n.startswith("value_head")], "base weights moved"


def test_full_finetune_trains_policy_and_value_model_and_keeps_reference_frozen(make_engine):
    engine = make_engine(**{"policy.lora": "null", "value.kind": "model"})
    ac = engine.actor_critic
    assert ac.value_kind == "model" and ac.ref_model is not None and ac.value_backbone is not None
    ref_before, pol_before, val_before = _snapshot(ac.ref_model), _snapshot(ac.policy), _snapshot(ac.value_backbone)
    train_step(init_state(engine, PROMPTS))
    assert not _changed(ref_before, ac.ref_model)
    assert _changed(pol_before, ac.policy)
    assert _changed(val_before, ac.value_backbone)


def test_value_head_on_policy_backbone_gives_values_from_the_same_forward(make_engine):
    engine = make_engine(**{"value.kind": "head"})
    rollout = engine.collect_rollout(PROMPTS)
    assert rollout.values.shape == rollout.logprobs.shape
    assert rollout.values[rollout.generation.response_mask].abs().sum() > 0
    metrics, _ = train_step(init_state(engine, PROMPTS))
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())


def test_qlora_rollout_reference_then_training_step(make_engine):
    """bitsandbytes: a 4-bit layer in eval mode repacks after a no-grad forward and breaks the backward."""
    pytest.importorskip("bitsandbytes")
    engine = make_engine(**{"policy.quantization": "4bit"})
    before = _snapshot(engine.actor_critic)
    rollout = engine.collect_rollout(PROMPTS)  # no-grad generate + policy + reference (adapter disabled)
    new_logprobs, _, _ = policy_forward(engine.actor_critic, rollout.generation.sequences, rollout.generation.attention_mask,
                                        rollout.generation.response_ids, 1.0)
    mask = rollout.generation.response_mask
    torch.testing.assert_close(new_logprobs.detach()[mask], rollout.logprobs[mask], atol=1e-5, rtol=0)
    metrics, _ = train_step(init_state(engine, PROMPTS))
    assert abs(metrics["val/ratio"] - 1.0) < 0.05
    assert any("lora_" in n for n in _changed(before, engine.actor_critic))


def _value_loss_grads(engine) -> tuple[dict[str, torch.Tensor | None], torch.Tensor | None]:
    """Gradients of the values alone (summed) w.r.t. the policy's LoRA weights, and the head's."""
    ac = engine.actor_critic
    generation = engine.generate(PROMPTS)
    _, _, values = policy_forward(ac, generation.sequences, generation.attention_mask, generation.response_ids, 1.0)
    ac.zero_grad(set_to_none=True)
    values.sum().backward()
    lora = {n: p.grad for n, p in ac.policy.named_parameters() if "lora_" in n}
    return lora, ac.value_head.weight.grad


def test_value_head_leaves_the_policy_weights_to_the_policy_loss_unless_asked(make_engine):
    lora, head = _value_loss_grads(make_engine(**{"value.kind": "head"}))
    assert head is not None and head.abs().sum() > 0
    assert lora and all(g is None for g in lora.values())
    lora, head = _value_loss_grads(make_engine(**{"value.kind": "head", "value.train_backbone": "true"}))
    assert head.abs().sum() > 0
    assert any(g is not None and g.abs().sum() > 0 for g in lora.values())


def test_value_learning_rate_defaults_by_critic_kind(make_engine):
    from ppo_cli.engine.critics import VALUE_HEAD_LR_WIDTH
    from ppo_cli.engine.models import hidden_size_of

    def group_lrs(**sets):
        engine = make_engine(**sets)
        state = init_state(engine, PROMPTS)
        return [g["lr"] for g in state.optimizer.param_groups], hidden_size_of(engine.actor_critic.policy)

    (policy_lr, value_lr), hidden = group_lrs(**{"value.kind": "head", "optim.lr": 1e-3})
    assert policy_lr == 1e-3 and value_lr == pytest.approx(VALUE_HEAD_LR_WIDTH / hidden)
    assert group_lrs(**{"value.kind": "adapter", "optim.lr": 1e-3})[0] == [1e-3, 1e-3]
    assert group_lrs(**{"value.kind": "head", "optim.lr": 1e-3, "optim.value_lr": 2e-4})[0] == [1e-3, 2e-4]


def test_frozen_value_model_trains_only_its_head(make_engine):
    engine = make_engine(**{"value.kind": "model", "value.train_backbone": "false"})
    ac = engine.actor_critic
    assert ac.value_parameters() == list(ac.value_head.parameters())
    backbone_before, head_before = _snapshot(ac.value_backbone), _snapshot(ac.value_head)
    state = init_state(engine, PROMPTS)
    assert len(state.optimizer.param_groups[1]["params"]) == 2  # weight and bias of the head
    train_step(state)
    assert not _changed(backbone_before, ac.value_backbone)
    assert _changed(head_before, ac.value_head) == {"weight", "bias"}


def test_frozen_value_model_on_the_reward_model_shares_it_and_the_update_reuses_its_features(make_engine, tiny_models):
    """value.init_from reward + train_backbone false: the reward classifier's own weights, no copy, and
    the update reads the rollout's features instead of running the value model again."""
    engine = make_engine(**{"value.kind": "model", "value.init_from": "reward", "value.train_backbone": "false",
                            "value.dtype": "float32"})
    ac = engine.actor_critic
    reward_model = engine.reward.scorers[0][2].model
    assert ac.value_backbone is reward_model.base_model
    rollout = engine.collect_rollout(PROMPTS)
    T, H = rollout.values.shape[1], ac.value_backbone.config.hidden_size
    assert rollout.fixed_value_features.shape == (len(PROMPTS), T, H)
    calls = []
    ac.value_backbone.register_forward_hook(lambda *args: calls.append(1))
    state = init_state(engine, PROMPTS)
    from ppo_cli.trainer import compute_advantages, optimise

    adv = compute_advantages(rollout, 0.1, state.recipe.ppo)
    stats = optimise(state, rollout, adv)
    assert stats.optimizer_steps > 0 and not calls
    assert stats.values["value_clipfrac"][0] == 0.0  # the first micro-batch's values are the rollout's


def test_value_model_on_another_tokenizer_is_refused_before_loading(tiny_models, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from ppo_cli.errors import ModelReferenceError

    other = tmp_path / "other-reward"
    shutil.copytree(tiny_models / "reward", other)
    tokenizer = AutoTokenizer.from_pretrained(other)
    tokenizer.add_tokens(["<not-in-the-policy>"])
    tokenizer.save_pretrained(other)
    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml",
                         tiny_overrides(tiny_models, tmp_path, **{"value.kind": "model", "value.path": str(other)}))
    with pytest.raises(ModelReferenceError) as err:
        load_engine(recipe)
    assert err.value.message == (
        f"value model '{other}' has a different tokenizer from the policy's, but reads the policy's token ids"
    )


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attn_implementation_reaches_every_model_of_the_policy(make_engine, attn):
    engine = make_engine(**{"policy.attn_implementation": attn, "value.kind": "model"})
    ac = engine.actor_critic
    for model in (unwrap_causal_lm(ac.policy), ac.value_backbone):
        assert model.config._attn_implementation == attn


def test_flash_attention_on_cpu_is_one_line(make_engine):
    from ppo_cli.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="flash_attention_2 needs a CUDA GPU, and this run is on cpu") as err:
        make_engine(**{"policy.attn_implementation": "flash_attention_2", "train.device": "cpu"})
    assert err.value.hint == "set policy.attn_implementation: auto (or sdpa)"


def test_8bit_adamw_trains_a_full_finetune_and_its_state_reloads_safely(make_engine, tmp_path):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    engine = make_engine(**{"policy.lora": "null", "value.kind": "model", "optim.name": "adamw_8bit"})
    state = init_state(engine, PROMPTS)
    optimizer = getattr(state.optimizer, "optimizer", state.optimizer)  # accelerate wraps it
    assert isinstance(optimizer, bnb.optim.AdamW8bit)
    before = _snapshot(engine.actor_critic.policy)
    train_step(state)
    assert _changed(before, engine.actor_critic.policy)
    big = max(engine.actor_critic.policy_parameters(), key=lambda p: p.numel())
    moment = optimizer.state[big]["state1"].clone()
    assert moment.dtype == torch.uint8  # 1 byte per moment
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    optimizer.state.clear()
    optimizer.load_state_dict(torch.load(tmp_path / "optimizer.pt", weights_only=True))  # as checkpoints load
    assert torch.equal(optimizer.state[big]["state1"], moment)


def _scalar_reward_model(tiny_models: Path, out: Path) -> Path:
    """The tiny sentiment classifier as a 1-output reward model (score = positive - negative logit)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cls = AutoModelForSequenceClassification.from_pretrained(tiny_models / "reward", dtype=torch.float32)
    weight = cls.score.weight.detach()
    config = cls.config
    config.num_labels, config.id2label, config.label2id = 1, {0: "score"}, {"score": 0}
    config.problem_type = "regression"
    scalar = AutoModelForSequenceClassification.from_config(config)
    state = cls.state_dict()
    state["score.weight"] = (weight[2] - weight[0]).unsqueeze(0)  # labels: negative, neutral, positive
    scalar.load_state_dict(state)
    scalar.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_models / "reward").save_pretrained(out)
    return out


def test_auto_critic_with_a_scalar_reward_model_of_the_policys_kind_is_the_frozen_reward_model(
        make_engine, tiny_models, tmp_path):
    """value.kind auto, a `type: model` reward on the policy's architecture and tokenizer: the critic
    is the reward model itself (shared, frozen), its head starts as the reward model's score head,
    and only that head trains."""
    rm = _scalar_reward_model(tiny_models, tmp_path / "rm")
    engine = make_engine(**{"value.kind": "auto", "reward.components": f"[{{type: model, path: '{rm}'}}]"})
    ac = engine.actor_critic
    reward_model = engine.reward.scorers[0][2].model
    assert ac.value_kind == "model" and ac.value_backbone is reward_model.base_model
    assert torch.equal(ac.value_head.weight, reward_model.score.weight)
    assert ac.value_parameters() == list(ac.value_head.parameters())


def test_cpu_weights_stay_views_of_the_mapped_checkpoint_on_accelerates_cpu0(tiny_models):
    # Several processes run on accelerate's device cpu:0; moving the weights there would copy every
    # tensor while the checkpoint's pages are resident (twice the model while loading).
    from transformers import AutoModelForCausalLM

    from ppo_cli.engine.models import load_pretrained

    model = load_pretrained(AutoModelForCausalLM, str(tiny_models / "policy"), dtype=torch.float32,
                            device=torch.device("cpu", 0))
    checkpoint = str((tiny_models / "policy" / "model.safetensors").resolve())
    mapped = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(checkpoint):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            mapped.append((start, end))
    assert mapped, "the checkpoint is not mapped"
    assert all(any(start <= p.data_ptr() < end for start, end in mapped) for p in model.parameters())
