"""GRPO's old log-probs taken from the update's first epoch instead of a forward of their own
(trainer.defer_old_logprobs): the same update as with the separate forward, one policy forward fewer."""

from types import SimpleNamespace

import pytest
import torch

from ppo_cli.engine.critics import HeadCritic, NoCritic
from ppo_cli.recipe_loading import load_recipe
from ppo_cli.trainer import compute_advantages, defer_old_logprobs, init_state, optimise, train_step
from tests.conftest import ROOT, tiny_overrides

RECIPE = ROOT / "recipes" / "tiny_grpo.yaml"
PROMPTS = ["I think the book was", "The movie was"]
SMALL = {"generation.num_generations": 2, "ppo.rollout_batch_size": 2, "ppo.mini_batch_size": 4,
         "ppo.micro_batch_size": 2, "ppo.ppo_epochs": 3, "generation.max_new_tokens": 8, "ppo.max_kl": "null"}


def _ppo(**sets):
    return load_recipe(RECIPE, [f"{k}={v}" for k, v in {**SMALL, **sets}.items()]).ppo


def _engine(critic=NoCritic()):
    return SimpleNamespace(actor_critic=SimpleNamespace(critic=critic, reference_is_policy=False))


def test_defer_old_logprobs_only_where_nothing_reads_them_before_an_unchanged_policy_does():
    assert defer_old_logprobs(_ppo(), _engine(), episodes=4)  # grpo: the KL in the loss, one mini-batch
    assert not defer_old_logprobs(_ppo(), _engine(), episodes=8)  # two mini-batches: the second sees a moved policy
    assert not defer_old_logprobs(_ppo(**{"ppo.advantage": "rloo"}), _engine(), episodes=4)  # the KL in the reward
    assert not defer_old_logprobs(_ppo(**{"ppo.kl_penalty": "reward"}), _engine(), episodes=4)
    assert not defer_old_logprobs(_ppo(), _engine(critic=HeadCritic()), episodes=4)  # a value head reads that forward


def _lora(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.slow
def test_grpo_update_with_old_logprobs_from_its_first_epoch_equals_the_one_with_a_separate_forward(tiny_models, tmp_path):
    from ppo_cli.engine.engine import load_engine

    # float32: the two ways compute the same forward on differently batched rows; bf16 would round them apart
    recipe = load_recipe(RECIPE, tiny_overrides(tiny_models, tmp_path, float32=True, **SMALL))
    torch.manual_seed(0)
    engine = load_engine(recipe)
    rollout = engine.collect_rollout(PROMPTS * 2)
    assert rollout.logprobs is not None
    start = _lora(engine.actor_critic.policy)

    def update(rollout_):
        engine.actor_critic.policy.load_state_dict(start, strict=False)
        state = init_state(engine, PROMPTS)
        torch.manual_seed(1)  # the same mini-batch order
        adv = compute_advantages(rollout_, state.kl_controller.value, recipe.ppo, group_size=2)
        return adv, optimise(state, rollout_, adv), _lora(engine.actor_critic.policy)

    adv, stats, after = update(rollout)
    adv_d, stats_d, after_d = update(rollout._replace(logprobs=None))
    assert torch.equal(adv_d.advantages, adv.advantages)
    torch.testing.assert_close(stats_d.old_logprobs, rollout.logprobs, atol=1e-5, rtol=0)
    assert stats_d.values["ratio"][0] == 1.0 and stats_d.values["clipfrac"][0] == 0.0  # exactly the old policy
    for name in ("policy_loss", "kl_loss", "approx_kl", "ratio"):
        assert stats_d.values[name] == pytest.approx(stats.values[name], abs=1e-5), name
    for name in after:
        torch.testing.assert_close(after_d[name], after[name], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_grpo_train_step_runs_one_policy_forward_fewer_and_reports_the_kl(tiny_models, tmp_path, monkeypatch):
    from ppo_cli.engine import engine as engine_module

    recipe = load_recipe(RECIPE, tiny_overrides(tiny_models, tmp_path, **SMALL))  # the default precision
    torch.manual_seed(0)
    state = init_state(engine_module.load_engine(recipe), PROMPTS * 4)
    calls, original = [], engine_module.policy_forward
    monkeypatch.setattr(engine_module, "policy_forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    metrics, rollout = train_step(state)
    assert not calls  # the rollout ran no policy forward of its own
    assert metrics["val/ratio_first_minibatch"] == 1.0
    assert rollout.logprobs is not None and torch.isfinite(rollout.logprobs).all()
    mask = rollout.generation.response_mask
    kl = ((rollout.logprobs - rollout.ref_logprobs) * mask).sum(dim=1).mean().item()  # k1, summed per episode
    assert metrics["objective/kl"] == pytest.approx(kl, abs=1e-6)
