import pytest
import torch

from ppo_cli.engine.generate import trim_padding, truncate_after_stop
from ppo_cli.types import Generation

EOS, PAD = 0, 1


@pytest.mark.parametrize(
    "raw, ids, mask, finished",
    [
        # stop token in the middle: kept, everything after it padded
        ([5, 6, 0, 7], [5, 6, 0, 1], [1, 1, 1, 0], True),
        # no stop token: all sampled tokens count
        ([5, 6, 7, 8], [5, 6, 7, 8], [1, 1, 1, 1], False),
        # stop token first: a one-token response
        ([0, 6, 7, 8], [0, 1, 1, 1], [1, 0, 0, 0], True),
        # only the first of two stop tokens ends the response
        ([5, 0, 0, 9], [5, 0, 1, 1], [1, 1, 0, 0], True),
        # stop token last
        ([5, 6, 7, 0], [5, 6, 7, 0], [1, 1, 1, 1], True),
    ],
)
def test_truncate_after_stop_keeps_up_to_first_stop_token(raw, ids, mask, finished):
    out_ids, out_mask, out_finished = truncate_after_stop(torch.tensor([raw]), EOS, PAD)
    assert out_ids.tolist() == [ids]
    assert out_mask.tolist() == [[bool(m) for m in mask]]
    assert out_finished.tolist() == [finished]


def test_truncate_after_stop_is_row_wise():
    raw = torch.tensor([[5, 0, 7], [5, 6, 7]])
    ids, mask, finished = truncate_after_stop(raw, EOS, PAD)
    assert ids.tolist() == [[5, 0, 1], [5, 6, 7]]
    assert mask.sum(dim=1).tolist() == [2, 3]
    assert finished.tolist() == [True, False]


def test_trim_padding_drops_columns_after_longest_response():
    gen = Generation(
        prompt_ids=torch.tensor([[1, 2], [3, 4]]),
        prompt_mask=torch.ones(2, 2, dtype=torch.bool),
        response_ids=torch.tensor([[5, 0, 1, 1], [5, 6, 0, 1]]),
        response_mask=torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool),
        finished=torch.tensor([True, True]),
    )
    trimmed = trim_padding(gen)
    assert trimmed.response_ids.tolist() == [[5, 0, 1], [5, 6, 0]]
    assert trimmed.response_mask.shape == (2, 3)
    assert trimmed.sequences.shape == (2, 5)
