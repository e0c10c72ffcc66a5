"""rollout_rows.py: a rollout's rows by index, and rollouts of different widths made one."""

from __future__ import annotations

import pytest
import torch

from ppo_cli.rollout_rows import concat_rollouts, select_rows
from ppo_cli.types import DeferredOldLogprobs, Generation, Rollout

PAD = 9


def _rollout(prompt_ids, prompt_mask, response_ids, response_mask, scores, tag, scored=None, failures=None):
    response_mask = torch.tensor(response_mask)
    B, T = response_mask.shape
    generation = Generation(torch.tensor(prompt_ids), torch.tensor(prompt_mask), torch.tensor(response_ids),
                            response_mask, response_mask[:, -1].logical_not(), response_mask.clone())
    per_token = torch.arange(1, B * T + 1, dtype=torch.float32).view(B, T) * response_mask
    return Rollout(generation, [f"{tag}p{i}" for i in range(B)], [f"{tag}r{i}" for i in range(B)], per_token,
                   -per_token, per_token / 10, torch.tensor(scores), {"fn": list(scores)}, None, None, scored, failures)


A = _rollout([[PAD, 5], [6, 7]], [[False, True], [True, True]], [[1, 2, PAD], [3, PAD, PAD]],
             [[True, True, False], [True, False, False]], [1.0, 0.0], "a")
B = _rollout([[8]], [[True]], [[4, 4, 4, 4]], [[True, True, True, True]], [2.0], "b",
             scored=torch.tensor([False]), failures={"fn": "timed out"})


def test_concat_pads_prompts_left_and_responses_right():
    both = concat_rollouts([A, B], PAD)
    gen = both.generation
    assert gen.prompt_ids.tolist() == [[PAD, 5], [6, 7], [PAD, 8]]
    assert gen.prompt_mask.tolist() == [[False, True], [True, True], [False, True]]
    assert gen.response_ids.tolist() == [[1, 2, PAD, PAD], [3, PAD, PAD, PAD], [4, 4, 4, 4]]
    assert gen.response_mask.tolist() == [[True, True, False, False], [True, False, False, False], [True] * 4]
    assert gen.action_mask.tolist() == gen.response_mask.tolist()
    assert gen.finished.tolist() == [True, True, False]
    assert both.logprobs.tolist() == [[1.0, 2.0, 0.0, 0.0], [4.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]]
    assert both.ref_logprobs.tolist() == [[-1.0, -2.0, 0.0, 0.0], [-4.0, 0.0, 0.0, 0.0], [-1.0, -2.0, -3.0, -4.0]]
    assert both.scores.tolist() == [1.0, 0.0, 2.0]
    assert both.prompts == ["ap0", "ap1", "bp0"] and both.responses == ["ar0", "ar1", "br0"]
    assert both.score_components == {"fn": [1.0, 0.0, 2.0]}
    assert both.scored.tolist() == [True, True, False]  # A's None: all scored
    assert both.reward_failures == {"fn": "timed out"}
    assert both.fixed_value_features is None and both.sampler_logprobs is None


def test_select_rows_in_the_order_given():
    both = concat_rollouts([A, B], PAD)
    picked = select_rows(both, torch.tensor([2, 0]))
    assert picked.generation.response_ids.tolist() == [[4, 4, 4, 4], [1, 2, PAD, PAD]]
    assert picked.prompts == ["bp0", "ap0"] and picked.score_components == {"fn": [2.0, 1.0]}
    assert picked.scored.tolist() == [False, True] and picked.scores.tolist() == [2.0, 1.0]
    assert picked.logprobs.tolist() == [[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 0.0, 0.0]]


def test_deferred_old_logprobs_stay_deferred_until_recorded():
    deferred_a = A._replace(logprobs=DeferredOldLogprobs(A.ref_logprobs))
    deferred_b = B._replace(logprobs=DeferredOldLogprobs(B.ref_logprobs))
    both = concat_rollouts([deferred_a, deferred_b], PAD)
    assert isinstance(both.logprobs, DeferredOldLogprobs) and both.logprobs.logprobs.shape == (3, 4)
    assert isinstance(select_rows(both, torch.tensor([1])).logprobs, DeferredOldLogprobs)
    with pytest.raises(ValueError, match="cannot be mixed"):
        concat_rollouts([deferred_a, B], PAD)
    both.logprobs.take(torch.tensor([0]), torch.zeros(1, 4), torch.ones(1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="already recorded"):
        select_rows(both, torch.tensor([0]))


def test_episodes_of_several_turns_follow_their_rows():
    """Rollout.episodes (one record per row) is selected and concatenated with the rows; none stays none."""
    a, b = A._replace(episodes=["ea0", "ea1"]), B._replace(episodes=["eb0"])
    both = concat_rollouts([a, b], PAD)
    assert both.episodes == ["ea0", "ea1", "eb0"]
    assert select_rows(both, torch.tensor([2, 0])).episodes == ["eb0", "ea0"]
    assert concat_rollouts([A, B], PAD).episodes is None and select_rows(A, torch.tensor([1])).episodes is None
