import math

import pytest
import torch

from ppo_cli.algo.masking import masked_mean, masked_sum, masked_var, masked_whiten

TOL = dict(rtol=1e-6, atol=1e-6)


def random_inputs(seed, shape=(5, 7)):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float64)
    mask = torch.rand(shape, generator=generator) < 0.6
    mask[0, :2] = True  # at least two counted entries, so the unbiased variance is defined
    return values, mask


VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[True, False, True], [False, False, False]])


def test_masked_sum_matches_hand_computed_case():
    # all: 1 + 3 = 4; per row: [1 + 3, nothing] = [4, 0]; per column: [1, 0, 3]
    assert masked_sum(VALUES, MASK) == 4.0
    torch.testing.assert_close(masked_sum(VALUES, MASK, dim=1), torch.tensor([4.0, 0.0]), **TOL)
    torch.testing.assert_close(masked_sum(VALUES, MASK, dim=0), torch.tensor([1.0, 0.0, 3.0]), **TOL)


def test_masked_mean_matches_hand_computed_case():
    # all: (1 + 3) / 2 = 2; per row: [(1 + 3) / 2, empty -> 0]; per column: [1/1, empty -> 0, 3/1]
    assert masked_mean(VALUES, MASK) == 2.0
    torch.testing.assert_close(masked_mean(VALUES, MASK, dim=1), torch.tensor([2.0, 0.0]), **TOL)
    torch.testing.assert_close(masked_mean(VALUES, MASK, dim=0), torch.tensor([1.0, 0.0, 3.0]), **TOL)


def test_masked_mean_of_all_false_mask_is_zero_not_nan():
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert masked_mean(VALUES, empty) == 0.0
    torch.testing.assert_close(masked_mean(VALUES, empty, dim=1), torch.zeros(2), **TOL)


def test_masked_mean_ignores_nan_and_inf_outside_mask():
    poisoned = VALUES.clone()
    poisoned[~MASK] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan")])
    assert masked_mean(poisoned, MASK) == 2.0
    assert masked_sum(poisoned, MASK) == 4.0


def test_masked_mean_broadcasts_mask_over_trailing_dim():
    values = torch.arange(12.0).reshape(2, 3, 2)
    # row 0 keeps positions 0 and 2: (0 + 1 + 4 + 5) / 4 = 2.5; row 1 keeps nothing -> 0
    mask = torch.tensor([[True, False, True], [False, False, False]]).unsqueeze(-1)
    torch.testing.assert_close(masked_mean(values, mask, dim=(1, 2)), torch.tensor([2.5, 0.0]), **TOL)


@pytest.mark.parametrize("seed", range(5))
def test_masked_mean_matches_plain_loop_on_random_inputs(seed):
    values, mask = random_inputs(seed)
    for row in range(values.shape[0]):
        kept = [values[row, t].item() for t in range(values.shape[1]) if mask[row, t]]
        expected = sum(kept) / len(kept) if kept else 0.0
        assert masked_mean(values, mask, dim=1)[row].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    kept = [v.item() for v, m in zip(values.flatten(), mask.flatten()) if m]
    assert masked_mean(values, mask).item() == pytest.approx(sum(kept) / len(kept), rel=1e-12)


def test_masked_var_matches_hand_computed_case():
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 100.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    # mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5; biased 5 / 4, unbiased 5 / 3
    torch.testing.assert_close(masked_var(values, mask, unbiased=False), torch.tensor(1.25), **TOL)
    torch.testing.assert_close(masked_var(values, mask), torch.tensor(5.0 / 3.0), **TOL)


@pytest.mark.parametrize("seed", range(5))
def test_masked_var_matches_torch_var_of_selected_entries(seed):
    values, mask = random_inputs(seed)
    selected = values[mask]
    torch.testing.assert_close(masked_var(values, mask), selected.var(correction=1), **TOL)
    torch.testing.assert_close(masked_var(values, mask, unbiased=False), selected.var(correction=0), **TOL)


def test_masked_var_of_single_entry_is_zero_not_nan():
    values = torch.tensor([[7.0, 1.0, 2.0]])
    mask = torch.tensor([[True, False, False]])
    assert masked_var(values, mask) == 0.0
    assert masked_var(values, mask, unbiased=False) == 0.0


def test_masked_var_unbiased_raises_on_empty_mask():
    with pytest.raises(ValueError, match="at least one True entry"):
        masked_var(VALUES, torch.zeros(2, 3, dtype=torch.bool))


def test_masked_var_biased_of_empty_mask_is_zero():
    assert masked_var(VALUES, torch.zeros(2, 3, dtype=torch.bool), unbiased=False) == 0.0


def test_masked_whiten_matches_hand_computed_case():
    values = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[True, True, True, False]])
    # mean 2, unbiased var (1 + 0 + 1) / 2 = 1 -> (x - 2) / 1; off-mask entry -> 0
    torch.testing.assert_close(masked_whiten(values, mask), torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), **TOL)
    # keep_mean adds the mean 2 back to the masked entries only
    torch.testing.assert_close(
        masked_whiten(values, mask, keep_mean=True), torch.tensor([[1.0, 2.0, 3.0, 0.0]]), **TOL
    )


@pytest.mark.parametrize("seed", range(5))
def test_masked_whiten_has_zero_mean_unit_std_on_masked_entries(seed):
    values, mask = random_inputs(seed)
    whitened = masked_whiten(3.0 * values + 5.0, mask)
    torch.testing.assert_close(masked_mean(whitened, mask), torch.tensor(0.0, dtype=torch.float64), **TOL)
    torch.testing.assert_close(masked_var(whitened, mask).sqrt(), torch.tensor(1.0, dtype=torch.float64), **TOL)


@pytest.mark.parametrize("seed", range(5))
def test_masked_whiten_zeroes_entries_outside_mask(seed):
    values, mask = random_inputs(seed)
    values[~mask] = float("nan")
    whitened = masked_whiten(values, mask)
    assert torch.all(whitened[~mask] == 0.0)
    assert torch.isfinite(whitened).all()


@pytest.mark.parametrize("seed", range(5))
def test_masked_whiten_keep_mean_keeps_the_mean_and_unit_std(seed):
    values, mask = random_inputs(seed)
    values = values + 4.0
    whitened = masked_whiten(values, mask, keep_mean=True)
    torch.testing.assert_close(masked_mean(whitened, mask), masked_mean(values, mask), **TOL)
    torch.testing.assert_close(masked_var(whitened, mask).sqrt(), torch.tensor(1.0, dtype=torch.float64), **TOL)


def test_masked_whiten_of_constant_values_is_zero_not_nan():
    # var 0: eps keeps rsqrt finite and (x - mean) is 0 everywhere
    whitened = masked_whiten(torch.full((2, 3), 4.0), torch.ones(2, 3, dtype=torch.bool))
    torch.testing.assert_close(whitened, torch.zeros(2, 3), **TOL)


def test_masked_functions_do_not_mutate_inputs():
    values, mask = random_inputs(0)
    values_before, mask_before = values.clone(), mask.clone()
    masked_sum(values, mask)
    masked_mean(values, mask, dim=1)
    masked_var(values, mask)
    masked_whiten(values, mask)
    masked_whiten(values, mask, keep_mean=True)
    assert torch.equal(values, values_before) and torch.equal(mask, mask_before)


def test_masked_mean_gradient_flows_only_to_masked_entries():
    values = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    mask = torch.tensor([[True, False, True]])
    masked_mean(values, mask).backward()
    # d/dx of (x0 + x2) / 2 is 1/2 on the counted entries, 0 on the other
    torch.testing.assert_close(values.grad, torch.tensor([[0.5, 0.0, 0.5]]), **TOL)
    assert not math.isnan(values.grad.sum().item())
