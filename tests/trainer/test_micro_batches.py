"""Micro-batches sized by token count (ppo.micro_batch_tokens)."""

import pytest
import torch

from ppo_cli import trainer
from ppo_cli.engine.engine import load_engine
from ppo_cli.plan_memory import update_micro_batch
from ppo_cli.recipe_loading import load_recipe
from ppo_cli.train_setup import init_state
from ppo_cli.trainer import token_budget_micro_batches, train_step
from tests.conftest import ROOT, tiny_overrides


def test_micro_batches_fill_longest_first_up_to_the_budget():
    rows = torch.tensor([10, 11, 12, 13, 14])
    lengths = torch.tensor([3, 9, 1, 9, 5])
    # prompt 4: costs 13, 13, 9, 7, 5 tokens sorted; 2 x 13 = 26 fits in 30, 3 x 13 does not;
    # then 3 x 9 = 27 fits.
    batches = token_budget_micro_batches(rows, lengths, prompt_len=4, budget=30)
    assert [b.tolist() for b in batches] == [[11, 13], [14, 10, 12]]


def test_an_episode_longer_than_the_budget_gets_its_own_micro_batch():
    batches = token_budget_micro_batches(torch.tensor([0, 1]), torch.tensor([9, 1]), prompt_len=4, budget=10)
    assert [b.tolist() for b in batches] == [[0], [1]]
    # a response of length 0 still costs one position (the update trims to at least one token)
    batches = token_budget_micro_batches(torch.tensor([0, 1]), torch.tensor([0, 0]), prompt_len=4, budget=10)
    assert [b.tolist() for b in batches] == [[0, 1]]


def test_plan_counts_the_full_length_episodes_that_fit(tmp_path):
    sets = {"ppo.mini_batch_size": 16, "ppo.micro_batch_tokens": 100, "generation.max_new_tokens": 24}
    # arithmetic on the recipe alone: the model paths are never opened
    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", tiny_overrides(tmp_path / "models", tmp_path, **sets))
    assert update_micro_batch(recipe, prompt_len=8) == 3  # 100 // (8 + 24)
    assert update_micro_batch(recipe, prompt_len=200) == 1


@pytest.mark.slow
def test_update_with_a_token_budget_covers_every_episode_once_within_budget(tiny_models, tmp_path, monkeypatch):
    budget = 60
    sets = {"ppo.rollout_batch_size": 8, "ppo.mini_batch_size": 8, "ppo.micro_batch_size": 8, "ppo.ppo_epochs": 2,
            "ppo.micro_batch_tokens": budget, "generation.max_new_tokens": 16}
    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", tiny_overrides(tiny_models, tmp_path, **sets))
    torch.manual_seed(0)
    engine = load_engine(recipe)
    seen, original = [], trainer.micro_batch_loss

    def recording(state, rollout, adv, rows, stats):
        gen = rollout.generation
        longest = max(1, int(gen.response_mask[rows].sum(dim=1).max()))
        seen.append((rows.tolist(), len(rows) * (gen.prompt_ids.shape[1] + longest)))
        return original(state, rollout, adv, rows, stats)

    monkeypatch.setattr(trainer, "micro_batch_loss", recording)
    metrics, _ = train_step(init_state(engine, ["The movie was", "This phone is", "I think the book was", "Overall"] * 2))
    assert len(seen) > 2, "the budget should split each mini-batch"
    assert all(tokens <= budget or len(rows) == 1 for rows, tokens in seen)
    per_epoch = len(seen) // 2
    for epoch in range(2):
        rows = sorted(r for batch, _ in seen[epoch * per_epoch : (epoch + 1) * per_epoch] for r in batch)
        assert rows == list(range(8))
    assert metrics["val/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-4)
