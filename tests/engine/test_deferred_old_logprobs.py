"""GRPO's old log-probs taken from the update's first epoch instead of a forward of their own
(trainer.defer_old_logprobs, types.DeferredOldLogprobs): the same update as with the separate forward,
one policy forward fewer."""

from types import SimpleNamespace

import pytest
import torch

from ppo_cli.engine.critics import HeadCritic, NoCritic
from ppo_cli.recipe_loading import load_recipe
from ppo_cli.train_setup import init_state
from ppo_cli.trainer import compute_advantages, defer_old_logprobs, fill_in_old_logprobs, optimise, train_step
from ppo_cli.types import DeferredOldLogprobs
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


def test_deferred_old_logprobs_take_records_each_micro_batch_and_returns_them_zeroed_outside_the_mask():
    deferred = DeferredOldLogprobs(torch.full((3, 4), 7.0))
    assert deferred.logprobs.tolist() == [[0.0] * 4] * 3 and not deferred.complete
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)  # a micro-batch trimmed to T' = 3
    mask = torch.tensor([[True, True, False], [True, False, False]])
    old = deferred.take(torch.tensor([2, 0]), logprobs, mask)
    assert old.tolist() == [[-1.0, -2.0, 0.0], [-4.0, 0.0, 0.0]] and not old.requires_grad
    assert deferred.logprobs.tolist() == [[-4.0, 0.0, 0.0, 0.0], [0.0] * 4, [-1.0, -2.0, 0.0, 0.0]]
    assert not deferred.complete  # episode 1 not yet through the forward
    deferred.take(torch.tensor([1]), torch.tensor([[-0.5]]), torch.tensor([[True]]))
    assert deferred.complete and deferred.logprobs[1].tolist() == [-0.5, 0.0, 0.0, 0.0]


def _state_with_forward(logprobs: torch.Tensor, calls: list):
    """A TrainState as fill_in_old_logprobs reads it: the engine's forward returns ``logprobs``."""
    import contextlib

    def forward(generation, chunk, reference=True):
        calls.append((chunk, reference))
        return logprobs, None, None, None

    recipe = SimpleNamespace(train=SimpleNamespace(fsdp_rollout=False), ppo=SimpleNamespace(micro_batch_size=2))
    dist = SimpleNamespace(rollout_parameters=lambda model, fsdp: contextlib.nullcontext())
    return SimpleNamespace(recipe=recipe, dist=dist, model=None,
                           engine=SimpleNamespace(evaluate_logprobs_and_values=forward))


def _rollout(logprobs):
    from ppo_cli.types import Rollout

    return Rollout(None, ["p", "q"], ["a", "b"], logprobs, torch.zeros(2, 2), None, torch.zeros(2), {})


def test_fill_in_old_logprobs_takes_the_recorded_ones_or_runs_the_forward_when_none_were_recorded():
    forwarded, calls = torch.tensor([[-9.0, 0.0], [-8.0, -7.0]]), []
    state = _state_with_forward(forwarded, calls)
    deferred = DeferredOldLogprobs(torch.zeros(2, 2))
    deferred.take(torch.tensor([0, 1]), torch.tensor([[-1.0, -2.0], [-3.0, -4.0]]), torch.ones(2, 2, dtype=torch.bool))
    assert fill_in_old_logprobs(state, _rollout(deferred)).logprobs.tolist() == [[-1.0, -2.0], [-3.0, -4.0]]
    assert calls == []  # the update's first epoch recorded every episode: no forward
    skipped = fill_in_old_logprobs(state, _rollout(DeferredOldLogprobs(torch.zeros(2, 2))))
    # the update was skipped: one forward, in micro-batches, and no reference forward (only the old log-probs are read)
    assert skipped.logprobs is forwarded and calls == [(2, False)]
    has_them = _rollout(torch.ones(2, 2))
    assert fill_in_old_logprobs(state, has_them) is has_them and calls == [(2, False)]


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
    assert isinstance(rollout.logprobs, torch.Tensor)
    start = _lora(engine.actor_critic.policy)

    def update(rollout_):
        engine.actor_critic.policy.load_state_dict(start, strict=False)
        state = init_state(engine, PROMPTS)
        torch.manual_seed(1)  # the same mini-batch order
        adv = compute_advantages(rollout_, state.kl_controller.value, recipe.ppo, group_size=2)
        return adv, optimise(state, rollout_, adv), _lora(engine.actor_critic.policy)

    adv, stats, after = update(rollout)
    deferred = DeferredOldLogprobs(rollout.ref_logprobs)
    adv_d, stats_d, after_d = update(rollout._replace(logprobs=deferred))
    assert torch.equal(adv_d.advantages, adv.advantages)
    assert deferred.complete
    torch.testing.assert_close(deferred.logprobs, rollout.logprobs, atol=1e-5, rtol=0)
    assert stats_d.values["ratio"][0] == 1.0 and stats_d.values["clipfrac"][0] == 0.0  # exactly the old policy
    for name in ("policy_loss", "kl_loss", "approx_kl", "ratio"):
        assert stats_d.values[name] == pytest.approx(stats.values[name], abs=1e-5), name
    # Within a tenth of a step (lr 1e-3): Adam divides each gradient by its own root mean square, so an
    # element whose gradient is a cancellation residue moves by a share of lr that float32 noise decides
    # (o_proj's lora_B at (17, 12): a first gradient of -6.2e-9 against a typical 1e-4, its weight then
    # 1.909e-3 or 1.944e-3 after three steps; the median element moved 2.4e-3).
    for name in after:
        torch.testing.assert_close(after_d[name], after[name], atol=1e-4, rtol=1e-4)


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
    assert isinstance(rollout.logprobs, torch.Tensor) and torch.isfinite(rollout.logprobs).all()
    mask = rollout.generation.response_mask
    kl = ((rollout.logprobs - rollout.ref_logprobs) * mask).sum(dim=1).mean().item()  # k1, summed per episode
    assert metrics["objective/kl"] == pytest.approx(kl, abs=1e-6)
