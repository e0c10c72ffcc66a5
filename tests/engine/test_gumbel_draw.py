"""The sampler's draw (generate.sampling_processors): transformers' warpers, then the Gumbel-max trick,
under its greedy loop. Draws must follow softmax(scores / temperature) restricted by top-k and top-p,
the distribution whose log-probs PPO's ratio uses."""

import math

import pytest
import torch

from ppo_cli.engine.generate import GumbelMaxDraw, sampling_config, sampling_processors
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


def test_gumbel_max_draws_from_the_softmax_and_never_a_masked_token():
    # softmax([0, ln 2, ln 3, -inf]) = [1/6, 2/6, 3/6, 0]
    scores = torch.tensor([[0.0, math.log(2), math.log(3), -math.inf]])
    freq = _frequencies(GumbelMaxDraw(), scores)
    assert freq[3] == 0.0
    _assert_within_5_standard_errors(freq, [1 / 6, 2 / 6, 3 / 6, 0.0])


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
    assert [type(p) for p in processors] == [GumbelMaxDraw]
    config = sampling_config(GenerationConfig(max_new_tokens=7), stop_token_id=2, pad_token_id=0)
    # transformers' own sampling (and its default top_k 50) stays off: the draw is the processor's
    assert config.do_sample is False and config.max_new_tokens == 7 and config.eos_token_id == 2
