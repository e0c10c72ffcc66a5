import pytest
import torch

from ppo_cli.algo.aggregation import (
    LOSS_AGG_MODES,
    aggregate_loss,
    seq_mean_token_mean,
    seq_mean_token_sum_norm,
    token_mean,
)
from ppo_cli.algo.masking import mask_truncated_completions

TOL = dict(rtol=1e-6, atol=1e-6)

# Row 0 has 4 real tokens, row 1 one, row 2 none (a response cut to nothing).
LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0], [7.0, 7.0, 7.0, 7.0]])
MASK = torch.tensor([[True, True, True, True], [True, False, False, False], [False, False, False, False]])


def test_token_mean_matches_hand_computed_case():
    # (1 + 2 + 3 + 4 + 10) / 5 real tokens
    torch.testing.assert_close(token_mean(LOSS, MASK), torch.tensor(4.0), **TOL)


def test_seq_mean_token_mean_matches_hand_computed_case():
    # row means 2.5, 10, and 0 for the empty row, over 3 rows
    torch.testing.assert_close(seq_mean_token_mean(LOSS, MASK), torch.tensor(12.5 / 3), **TOL)


def test_seq_mean_token_sum_norm_matches_hand_computed_case():
    # row sums 10, 10, 0, each / 8, mean over 3 rows
    torch.testing.assert_close(seq_mean_token_sum_norm(LOSS, MASK, 8), torch.tensor(2.5 / 3), **TOL)


@pytest.mark.parametrize(
    "mode, expected_grad",
    [
        # d/dl_bt: 1 / 5 real tokens
        ("token_mean", [[0.2, 0.2, 0.2, 0.2], [0.2, 0, 0, 0], [0, 0, 0, 0]]),
        # 1 / (3 rows * row length): a token of the 1-token row weighs 4 times one of the 4-token row
        ("seq_mean_token_mean", [[1 / 12] * 4, [1 / 3, 0, 0, 0], [0, 0, 0, 0]]),
        # 1 / (3 rows * 8): every real token weighs the same, whatever its row's length
        ("seq_mean_token_sum_norm", [[1 / 24] * 4, [1 / 24, 0, 0, 0], [0, 0, 0, 0]]),
    ],
)
def test_aggregate_loss_gradient_gives_each_token_its_weight(mode, expected_grad):
    loss = LOSS.clone().requires_grad_()
    aggregate_loss(loss, MASK, mode, max_response_length=8).backward()
    torch.testing.assert_close(loss.grad, torch.tensor(expected_grad), **TOL)


def test_aggregate_loss_defaults_to_token_mean():
    torch.testing.assert_close(aggregate_loss(LOSS, MASK), token_mean(LOSS, MASK), rtol=0, atol=0)


def test_aggregation_of_a_batch_with_a_truncated_row_masked_out():
    # row 0 hit max_new_tokens without its stop token; row 1 finished after 1 token
    mask = mask_truncated_completions(MASK[:2], torch.tensor([False, True]))
    assert mask.tolist() == [[False] * 4, [True, False, False, False]]
    assert aggregate_loss(LOSS[:2], mask, "token_mean").item() == 10.0
    assert aggregate_loss(LOSS[:2], mask, "seq_mean_token_mean").item() == 5.0  # (0 + 10) / 2
    assert aggregate_loss(LOSS[:2], mask, "seq_mean_token_sum_norm", 4).item() == 1.25  # (0 + 10 / 4) / 2


def test_aggregations_ignore_nan_outside_the_mask():
    poisoned = LOSS.clone()
    poisoned[~MASK] = float("nan")
    for mode in LOSS_AGG_MODES:
        assert aggregate_loss(poisoned, MASK, mode, 8) == aggregate_loss(LOSS, MASK, mode, 8)


@pytest.mark.parametrize(
    "mode, max_response_length, message",
    [
        ("seq_mean", None, "unknown loss aggregation 'seq_mean'; expected one of token_mean, seq_mean_token_mean, seq_mean_token_sum_norm"),
        ("seq_mean_token_sum_norm", None, "seq_mean_token_sum_norm needs max_response_length > 0 (the generation's max_new_tokens), got None"),
        ("seq_mean_token_sum_norm", 0, "seq_mean_token_sum_norm needs max_response_length > 0 (the generation's max_new_tokens), got 0"),
    ],
)
def test_aggregate_loss_rejects_bad_modes_in_one_line(mode, max_response_length, message):
    with pytest.raises(ValueError) as error:
        aggregate_loss(LOSS, MASK, mode, max_response_length)
    assert str(error.value) == message
