"""algo/shaping.py: DAPO's soft overlong punishment, by hand and against TRL's three-case form."""

from __future__ import annotations

import pytest

from ppo_cli.algo.shaping import soft_overlong_penalty
from tests.algo import numpy_reference as ref


def test_soft_overlong_penalty_by_hand():
    # max_new_tokens 20, buffer 4, penalty 1.5: free up to 16 tokens, then -1.5/4 = -0.375 per token
    values = [soft_overlong_penalty(n, 20, 4, 1.5) for n in (0, 15, 16, 17, 18, 20, 21)]
    assert values == [0.0, 0.0, 0.0, -0.375, -0.75, -1.5, -1.5]


def test_buffer_zero_is_off():
    assert soft_overlong_penalty(1000, 20, 0, 1.0) == 0.0


def test_buffer_equal_to_max_length_penalises_from_the_first_token():
    assert soft_overlong_penalty(0, 8, 8, 2.0) == 0.0
    assert soft_overlong_penalty(2, 8, 8, 2.0) == -0.5
    assert soft_overlong_penalty(8, 8, 8, 2.0) == -2.0


@pytest.mark.parametrize("max_length,buffer,penalty", [(20, 4, 1.0), (32, 8, 0.5), (7, 7, 3.0), (64, 1, 1.0)])
def test_matches_trls_three_cases(max_length, buffer, penalty):
    for length in range(0, max_length + 3):
        assert soft_overlong_penalty(length, max_length, buffer, penalty) == pytest.approx(
            ref.soft_overlong_punishment(length, max_length, buffer, penalty), abs=1e-12)
