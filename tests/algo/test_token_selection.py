"""algo/token_selection.py: the high-entropy tokens TRL's top_entropy_quantile trains on."""

from __future__ import annotations

import pytest
import torch

from ppo_cli.algo.token_selection import high_entropy_mask
from tests.algo import numpy_reference as ref

ENTROPY = torch.tensor([[0.1, 0.5, 0.9, 9.0], [0.3, 0.7, 0.2, 0.0]])
MASK = torch.tensor([[True, True, True, False], [True, True, False, False]])


def test_top_forty_percent_by_hand():
    # masked entropies sorted: 0.1 0.3 0.5 0.7 0.9; the 0.6 quantile sits at 0.6 * 4 = 2.4 -> 0.5 + 0.4 * 0.2 = 0.58
    keep, threshold = high_entropy_mask(ENTROPY, MASK, 0.4)
    assert threshold.item() == pytest.approx(0.58)
    assert keep.tolist() == [[False, False, True, False], [False, True, False, False]]  # 9.0 is padding: never kept


def test_quantile_one_keeps_every_masked_token():
    keep, threshold = high_entropy_mask(ENTROPY, MASK, 1.0)
    assert threshold.item() == pytest.approx(0.1)
    assert keep.tolist() == MASK.tolist()


def test_ties_at_the_threshold_are_kept():
    keep, threshold = high_entropy_mask(torch.tensor([[1.0, 1.0, 1.0, 2.0]]), torch.ones(1, 4, dtype=torch.bool), 0.25)
    assert threshold.item() == pytest.approx(1.25)
    assert keep.tolist() == [[False, False, False, True]]
    keep, _ = high_entropy_mask(torch.ones(1, 4), torch.ones(1, 4, dtype=torch.bool), 0.25)
    assert keep.all()  # all equal: every token is at the threshold


def test_empty_mask_keeps_nothing():
    keep, threshold = high_entropy_mask(ENTROPY, torch.zeros_like(MASK), 0.2)
    assert not keep.any() and threshold.item() == 0.0


def test_no_gradient_through_the_selection():
    entropy = ENTROPY.clone().requires_grad_(True)
    keep, threshold = high_entropy_mask(entropy, MASK, 0.5)
    assert not keep.requires_grad and not threshold.requires_grad


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("top_quantile", [0.05, 0.2, 0.5, 0.8, 1.0])
def test_matches_the_plain_loop(seed, top_quantile):
    generator = torch.Generator().manual_seed(seed)
    entropy = torch.rand(4, 7, generator=generator, dtype=torch.float64) * 3
    mask = torch.rand(4, 7, generator=generator) < 0.7
    keep, threshold = high_entropy_mask(entropy, mask, top_quantile)
    expected_keep, expected_threshold = ref.high_entropy_mask(entropy.tolist(), mask.tolist(), top_quantile)
    assert keep.tolist() == expected_keep
    assert threshold.item() == pytest.approx(expected_threshold, abs=1e-6)


def test_the_threshold_over_every_processs_tokens():
    # this process: 0.1 0.5 0.9 | 0.3 0.7; another's: 2.0 3.0 (one padding column of its own)
    other = torch.tensor([[2.0, 3.0, 0.0]])
    other_mask = torch.tensor([[True, True, False]])
    everyone = torch.cat([ENTROPY, torch.nn.functional.pad(other, (0, 1))])  # gathered: widths padded to 4
    everyone_mask = torch.cat([MASK, torch.nn.functional.pad(other_mask, (0, 1))])
    # 7 values sorted 0.1 0.3 0.5 0.7 0.9 2 3; the 0.5 quantile is the 4th: 0.7
    keep, threshold = high_entropy_mask(ENTROPY, MASK, 0.5, everyone, everyone_mask)
    assert threshold.item() == pytest.approx(0.7)
    assert keep.tolist() == [[False, False, True, False], [False, True, False, False]]
    expected_keep, expected_threshold = ref.high_entropy_mask(everyone.tolist(), everyone_mask.tolist(), 0.5)
    assert expected_threshold == pytest.approx(0.7) and expected_keep[:2] == keep.tolist()
