"""The loss of one optimizer step does not depend on how its mini-batch is cut into micro-batches:
token_mean is one mean over every loss token of the step (TRL's "dapo", whose normalizer is the step's
token count), the sequence modes one mean over its completions."""

import pytest
import torch

from ppo_cli.recipe_loading import load_recipe
from ppo_cli.train_setup import init_state
from ppo_cli.trainer import compute_advantages, optimise, token_share
from tests.conftest import ROOT, tiny_overrides

RECIPE = ROOT / "recipes" / "tiny_grpo.yaml"
PROMPTS = ["I think the book was", "The movie was"]


def test_token_share_is_the_micro_batch_part_of_the_step_tokens():
    assert token_share(torch.tensor([3, 2]), 20.0) == 0.25
    assert token_share(torch.tensor([0, 0]), 0.0) == 0.0  # a step without a loss token: nothing to weigh
    # two processes with 12 and 28 loss tokens: each divides by their mean, 20, and the average of the two
    # gradients is the sum over both divided by all 40 tokens
    micro_batches = {0: [torch.tensor([5]), torch.tensor([7])], 1: [torch.tensor([28])]}
    shares = [sum(token_share(m, 20.0) for m in mbs) for mbs in micro_batches.values()]
    assert sum(shares) / 2 == pytest.approx((12 + 28) / 40)


def _step_gradients(engine, recipe, rollout, micro_batch_size: int) -> dict[str, torch.Tensor]:
    """The gradient of the update's one optimizer step, with the mini-batch in micro-batches of this size."""
    recipe = recipe.model_copy(update={"ppo": recipe.ppo.model_copy(update={"micro_batch_size": micro_batch_size})})
    engine.recipe = recipe
    state = init_state(engine, PROMPTS)
    grads = {}

    def record(*args, **kwargs):
        grads.update({n: p.grad.clone() for n, p in engine.actor_critic.policy.named_parameters() if p.grad is not None})

    state.optimizer.step = record  # only the gradient: the weights stay where they were
    adv = compute_advantages(rollout, state.kl_controller.value, recipe.ppo, group_size=2)
    torch.manual_seed(1)
    stats = optimise(state, rollout, adv)
    assert stats.micro_batches_per_step == 4 // micro_batch_size
    return grads


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_micro_batches_of_one_give_the_gradient_of_the_whole_mini_batch(tiny_models, tmp_path, aggregation):
    from ppo_cli.engine.engine import load_engine

    sets = {"generation.num_generations": 2, "ppo.rollout_batch_size": 2, "ppo.mini_batch_size": 4,
            "ppo.micro_batch_size": 4, "ppo.ppo_epochs": 1, "generation.max_new_tokens": 8,
            "ppo.loss_aggregation": aggregation}
    # float32: the two ways sum the same terms in another order; bf16 would round them apart
    recipe = load_recipe(RECIPE, tiny_overrides(tiny_models, tmp_path, float32=True, **sets))
    torch.manual_seed(0)
    engine = load_engine(recipe)
    rollout = engine.collect_rollout([p for p in PROMPTS for _ in range(2)])  # groups of 2
    # responses of at most 8, 8, 2 and 5 tokens: the micro-batches' token counts differ, so a mean per
    # micro-batch weighted by its share of completions would weigh a short response's tokens more
    generation = rollout.generation
    cut = torch.arange(generation.action_mask.shape[1]) < torch.tensor([8, 8, 2, 5]).unsqueeze(1)
    rollout = rollout._replace(generation=generation._replace(action_mask=generation.action_mask & cut))
    assert len(set(rollout.train_mask.sum(dim=1).tolist())) > 1

    whole = _step_gradients(engine, recipe, rollout, micro_batch_size=4)
    in_four = _step_gradients(engine, recipe, rollout, micro_batch_size=1)
    assert whole and whole.keys() == in_four.keys()
    for name in whole:
        torch.testing.assert_close(in_four[name], whole[name], atol=1e-7, rtol=1e-5)
