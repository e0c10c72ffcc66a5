"""A mini-batch's micro-batches keep each prompt's completions together (trainer.prompts_together), so
that their forwards run each prompt once (engine/shared_prompts.py)."""

from types import SimpleNamespace

import torch

from ppo_cli.trainer import prompts_together


def _rollout(prompts: list[list[int]]):
    ids = torch.tensor(prompts)
    return SimpleNamespace(generation=SimpleNamespace(prompt_ids=ids, prompt_mask=ids != 0))


def test_completions_of_a_prompt_sit_together_in_the_order_drawn():
    # episodes 0-5: prompts A B A C B A (A = [0, 5, 6], B = [7, 8, 9], C = [0, 0, 6])
    rollout = _rollout([[0, 5, 6], [7, 8, 9], [0, 5, 6], [0, 0, 6], [7, 8, 9], [0, 5, 6]])
    mini_batch = torch.tensor([4, 0, 3, 5, 1, 2])  # the shuffled draw
    # Groups in the order of their prompts' (ids, mask) rows, C < A < B; within one, the order drawn.
    assert prompts_together(mini_batch, rollout).tolist() == [3, 0, 5, 2, 4, 1]


def test_a_mini_batch_of_distinct_prompts_keeps_its_drawn_order():
    rollout = _rollout([[0, 5, 6], [7, 8, 9], [0, 0, 6]])
    assert prompts_together(torch.tensor([2, 0, 1]), rollout).tolist() == [2, 0, 1]
