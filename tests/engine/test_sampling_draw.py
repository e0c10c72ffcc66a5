"""The sampler's draw (generate.sampling_processors): transformers' warpers, then a blocked inverse-CDF
draw, under its greedy loop. Draws must follow softmax(scores / temperature) restricted by top-k and top-p,
the distribution whose log-probs PPO's ratio uses."""

import math

import pytest
import torch

from ppo_cli.engine.generate import BlockedInverseCdfDraw, sampling_config, sampling_processors
from ppo_cli.recipe import GenerationConfig

DRAWS = 200_000


def _frequencies(processors, scores: torch.Tensor) -> torch.Tensor:
    """The share of DRAWS rows that picked each token, as transformers' greedy loop picks them."""
    torch.manual_seed(0)
    batch = scores.expand(DRAWS, -1).clone()
    picked = processors(torch.zeros(DRAWS, 1, dtype=torch.long), batch).argmax(dim=-1)
    return torch.bincount(picked, minlength=scores.shape[-1]).double() / DRAWS


def _assert_within_5_standard_errors(freq: torch.Tensor, expected: list[float]):
    for f, p in zip(freq.tolist(), expected):
        tolerance = 5 * math.sqrt(max(p * (1 - p), 1e-12) / DRAWS)
        assert f == pytest.approx(p, abs=tolerance), (freq.tolist(), expected)


def test_the_draw_is_from_the_softmax_and_never_a_masked_token():
    # softmax([0, ln 2, ln 3, -inf]) = [1/6, 2/6, 3/6, 0]
    scores = torch.tensor([[0.0, math.log(2), math.log(3), -math.inf]])
    freq = _frequencies(BlockedInverseCdfDraw(), scores)
    assert freq[3] == 0.0
    _assert_within_5_standard_errors(freq, [1 / 6, 2 / 6, 3 / 6, 0.0])


def test_blocks_of_the_vocabulary_are_drawn_by_their_mass_and_tokens_within_them_by_theirs():
    """Three blocks of 256 and a partial one of 88 (V = 856): mass in four blocks, one token masked in
    each, the last token of the vocabulary among the likely ones. Probabilities 0.1, 0.2, 0.3, 0.25 and
    0.15 at tokens 3, 300, 301, 700, 855."""
    scores = torch.full((1, 856), -math.inf)
    for token, p in ((3, 0.1), (300, 0.2), (301, 0.3), (700, 0.25), (855, 0.15)):
        scores[0, token] = math.log(p) + 7.0  # the draw is shift-invariant
    freq = _frequencies(BlockedInverseCdfDraw(), scores)
    expected = torch.zeros(856, dtype=torch.float64)
    expected[[3, 300, 301, 700, 855]] = torch.tensor([0.1, 0.2, 0.3, 0.25, 0.15], dtype=torch.float64)
    assert freq[expected == 0].sum() == 0.0
    _assert_within_5_standard_errors(freq[expected > 0], [0.1, 0.2, 0.3, 0.25, 0.15])


def test_each_row_draws_from_its_own_scores_and_the_drawn_token_alone_is_finite():
    scores = torch.tensor([[0.0, -math.inf, -math.inf], [-math.inf, -math.inf, 5.0]])
    out = BlockedInverseCdfDraw()(torch.zeros(2, 1, dtype=torch.long), scores)
    assert out.tolist() == [[0.0, -math.inf, -math.inf], [-math.inf, -math.inf, 0.0]]


def test_temperature_and_top_k_apply_before_the_draw():
    # scores / 0.5 = [0, 2 ln 2, 2 ln 3, 2 ln 4] -> weights 1, 4, 9, 16; top-2 keeps 9 and 16
    scores = torch.tensor([[0.0, math.log(2), math.log(3), math.log(4)]])
    gen = GenerationConfig(temperature=0.5, top_k=2)
    freq = _frequencies(sampling_processors(gen), scores)
    _assert_within_5_standard_errors(freq, [0.0, 0.0, 9 / 25, 16 / 25])


def test_top_p_keeps_the_smallest_set_over_p():
    # probabilities 0.1, 0.2, 0.3, 0.4: top_p 0.6 keeps 0.4 and 0.3 (0.7 >= 0.6), renormalized to 3/7, 4/7
    scores = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log()
    freq = _frequencies(sampling_processors(GenerationConfig(top_p=0.6)), scores)
    _assert_within_5_standard_errors(freq, [0.0, 0.0, 3 / 7, 4 / 7])


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    # probabilities 0.05, 0.15, 0.3, 0.5: min_p 0.25 drops those below 0.125 -> 0.15, 0.3, 0.5 renormalized
    scores = torch.tensor([[0.05, 0.15, 0.3, 0.5]]).log()
    freq = _frequencies(sampling_processors(GenerationConfig(min_p=0.25)), scores)
    _assert_within_5_standard_errors(freq, [0.0, 0.15 / 0.95, 0.3 / 0.95, 0.5 / 0.95])


def test_the_default_recipe_draws_from_the_full_softmax_with_no_warper():
    processors = sampling_processors(GenerationConfig())
    assert [type(p) for p in processors] == [BlockedInverseCdfDraw]
    config = sampling_config(GenerationConfig(max_new_tokens=7), stop_token_id=2, pad_token_id=0)
    # transformers' own sampling (and its default top_k 50) stays off: the draw is the processor's
    assert config.do_sample is False and config.max_new_tokens == 7 and config.eos_token_id == 2
