import math

import pytest
import torch

from ppo_cli.algo.losses import (
    PolicyLossOutput,
    ValueLossOutput,
    clipped_policy_loss,
    clipped_surrogate,
    clipped_value_loss,
    entropy_from_logits,
    explained_variance,
    sequence_log_ratio,
)

TOL = dict(rtol=1e-6, atol=1e-6)

# 2x3 case: ratios chosen so each token exercises one side of the clip; token (1, 2) is padding.
RATIOS = torch.tensor([[1.5, 0.5, 1.0], [0.5, 2.0, 1.1]])
ADVANTAGES = torch.tensor([[1.0, 1.0, -2.0], [-1.0, -1.0, 3.0]])
RESPONSE_MASK = torch.tensor([[True, True, True], [True, True, False]])


def plain_loop_policy_loss(logprobs, old_logprobs, advantages, response_mask, cliprange):
    per_token = []
    for lp, old, adv, counts in zip(
        logprobs.flatten().tolist(), old_logprobs.flatten().tolist(),
        advantages.flatten().tolist(), response_mask.flatten().tolist(),
    ):
        if counts:
            ratio = math.exp(lp - old)
            clipped = min(max(ratio, 1 - cliprange), 1 + cliprange)
            per_token.append(max(-adv * ratio, -adv * clipped))
    return sum(per_token) / len(per_token)


def random_policy_batch(seed, shape=(4, 7)):
    generator = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(shape, generator=generator, dtype=torch.float64) * 3
    old_logprobs = logprobs + 0.4 * torch.randn(shape, generator=generator, dtype=torch.float64)
    advantages = torch.randn(shape, generator=generator, dtype=torch.float64)
    response_mask = torch.rand(shape, generator=generator) < 0.7
    response_mask[0, 0] = True
    return logprobs, old_logprobs, advantages, response_mask


def test_clipped_policy_loss_matches_hand_computed_2x3_case():
    out = clipped_policy_loss(RATIOS.log(), torch.zeros(2, 3), ADVANTAGES, RESPONSE_MASK, cliprange=0.2)
    assert isinstance(out, PolicyLossOutput)
    # per token max(-A*r, -A*clip(r)): (0,0) max(-1.5,-1.2)=-1.2 clipped; (0,1) max(-0.5,-0.8)=-0.5;
    # (0,2) 2; (1,0) max(0.5,0.8)=0.8 clipped; (1,1) max(2,1.2)=2 -> (-1.2-0.5+2+0.8+2)/5 = 0.62
    torch.testing.assert_close(out.loss, torch.tensor(0.62), **TOL)
    # clipped branch strictly larger at (0,0) and (1,0): 2 of 5 counted tokens
    torch.testing.assert_close(out.clipfrac, torch.tensor(0.4), **TOL)
    # 0.5 * (ln1.5^2 + ln0.5^2 + 0 + ln0.5^2 + ln2^2) / 5 = 0.5 * (0.1644019539 + 3 * 0.4804530139) / 5
    torch.testing.assert_close(out.approx_kl, torch.tensor(0.1605760996), **TOL)
    # (1.5 + 0.5 + 1 + 0.5 + 2) / 5, the padding ratio 1.1 excluded
    torch.testing.assert_close(out.ratio_mean, torch.tensor(1.1), **TOL)


@pytest.mark.parametrize(
    "ratio, advantage, expected_loss, clipped",
    [
        (1.5, 1.0, -1.2, True),   # A > 0, r above 1+eps: -(1.2 * 1), clipped
        (0.5, 1.0, -0.5, False),  # A > 0, r below 1-eps: unclipped -0.5 (the clip bites one way)
        (0.5, -1.0, 0.8, True),   # A < 0, r below 1-eps: -(0.8 * -1), clipped
        (2.0, -1.0, 2.0, False),  # A < 0, r above 1+eps: unclipped -(2 * -1)
        (1.1, 1.0, -1.1, False),  # inside the trust region: plain -r * A
        (0.9, -1.0, 0.9, False),  # inside the trust region: plain -r * A
    ],
)
def test_clipped_policy_loss_clips_only_the_optimistic_side(ratio, advantage, expected_loss, clipped):
    out = clipped_policy_loss(
        torch.tensor([[math.log(ratio)]]), torch.zeros(1, 1), torch.tensor([[advantage]]),
        torch.ones(1, 1, dtype=torch.bool), cliprange=0.2,
    )
    torch.testing.assert_close(out.loss, torch.tensor(expected_loss), **TOL)
    assert out.clipfrac.item() == (1.0 if clipped else 0.0)


@pytest.mark.parametrize("ratio, advantage", [(1.5, 1.0), (1.9, 2.0), (0.5, -1.0), (0.1, -3.0)])
def test_clipped_policy_loss_gradient_is_zero_on_clipped_plateau(ratio, advantage):
    logprobs = torch.tensor([[math.log(ratio)]], requires_grad=True)
    out = clipped_policy_loss(
        logprobs, torch.zeros(1, 1), torch.tensor([[advantage]]), torch.ones(1, 1, dtype=torch.bool), 0.2
    )
    out.loss.backward()
    assert logprobs.grad.item() == 0.0


@pytest.mark.parametrize("ratio, advantage", [(1.1, 1.0), (0.5, 1.0), (2.0, -1.0), (0.9, -2.0)])
def test_clipped_policy_loss_gradient_is_minus_advantage_times_ratio_when_unclipped(ratio, advantage):
    logprobs = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    out = clipped_policy_loss(
        logprobs, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([[advantage]], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.bool), 0.2,
    )
    out.loss.backward()
    # d/d logprob of -A * exp(logprob - old) is -A * r
    assert logprobs.grad.item() == pytest.approx(-advantage * ratio, rel=1e-12)


def test_clipped_policy_loss_ignores_masked_out_tokens():
    logprobs = RATIOS.log().requires_grad_()
    reference = clipped_policy_loss(logprobs, torch.zeros(2, 3), ADVANTAGES, RESPONSE_MASK, 0.2)
    reference.loss.backward()
    reference_grad = logprobs.grad.clone()

    poisoned_logprobs = RATIOS.log()
    poisoned_logprobs[1, 2] = float("inf")
    poisoned_logprobs.requires_grad_()
    old_logprobs = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, -float("inf")]])
    advantages = ADVANTAGES.clone()
    advantages[1, 2] = float("nan")
    out = clipped_policy_loss(poisoned_logprobs, old_logprobs, advantages, RESPONSE_MASK, 0.2)
    out.loss.backward()
    for got, want in zip(out, reference):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(poisoned_logprobs.grad, reference_grad, rtol=0, atol=0)
    assert poisoned_logprobs.grad[1, 2] == 0.0


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("cliprange", [0.1, 0.2, 0.3])
def test_clipped_policy_loss_matches_plain_loop_on_random_inputs(seed, cliprange):
    logprobs, old_logprobs, advantages, response_mask = random_policy_batch(seed)
    out = clipped_policy_loss(logprobs, old_logprobs, advantages, response_mask, cliprange)
    expected = plain_loop_policy_loss(logprobs, old_logprobs, advantages, response_mask, cliprange)
    assert out.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_clipped_policy_loss_is_never_below_unclipped_surrogate(seed):
    logprobs, old_logprobs, advantages, response_mask = random_policy_batch(seed)
    out = clipped_policy_loss(logprobs, old_logprobs, advantages, response_mask, 0.2)
    ratio = (logprobs - old_logprobs).exp()
    unclipped = ((-advantages * ratio) * response_mask).sum() / response_mask.sum()
    assert out.loss.item() >= unclipped.item() - 1e-12


def test_clipped_policy_loss_at_ratio_one_is_minus_mean_advantage():
    logprobs, _, advantages, response_mask = random_policy_batch(3)
    out = clipped_policy_loss(logprobs, logprobs, advantages, response_mask, 0.2)
    expected = -(advantages * response_mask).sum() / response_mask.sum()
    torch.testing.assert_close(out.loss, expected, **TOL)
    assert out.clipfrac == 0.0 and out.approx_kl == 0.0 and out.ratio_mean == 1.0


def test_clipped_policy_loss_statistics_carry_no_grad():
    logprobs, old_logprobs, advantages, response_mask = random_policy_batch(4)
    out = clipped_policy_loss(logprobs.requires_grad_(), old_logprobs, advantages, response_mask, 0.2)
    assert out.loss.requires_grad
    assert not any(stat.requires_grad for stat in (out.clipfrac, out.approx_kl, out.ratio_mean))


def test_clipped_policy_loss_sends_no_gradient_to_old_logprobs_or_advantages():
    logprobs, old_logprobs, advantages, response_mask = random_policy_batch(5)
    old_logprobs.requires_grad_()
    advantages.requires_grad_()
    clipped_policy_loss(logprobs.requires_grad_(), old_logprobs, advantages, response_mask, 0.2).loss.backward()
    assert old_logprobs.grad is None and advantages.grad is None
    assert logprobs.grad is not None


VALUES = torch.tensor([[1.0, 2.0], [2.0, -1.0]])
OLD_VALUES = torch.tensor([[0.8, 1.0], [1.0, 0.0]])
RETURNS = torch.tensor([[1.5, 0.0], [2.5, 3.0]])
VALUE_MASK = torch.tensor([[True, True], [True, False]])


def test_clipped_value_loss_matches_hand_computed_case():
    out = clipped_value_loss(VALUES, OLD_VALUES, RETURNS, VALUE_MASK, cliprange_value=0.2)
    assert isinstance(out, ValueLossOutput)
    # (0,0) move 0.2 is inside the clip: 0.5^2 = 0.25; (0,1) clipped to 1.2: max(2^2, 1.2^2) = 4;
    # (1,0) clipped to 1.2: max(0.5^2, 1.3^2) = 1.69 -> 0.5 * (0.25 + 4 + 1.69) / 3 = 0.99
    torch.testing.assert_close(out.loss, torch.tensor(0.99), **TOL)
    # only (1,0) has the clipped error strictly larger: 1 of 3
    torch.testing.assert_close(out.clipfrac, torch.tensor(1.0 / 3.0), **TOL)


def test_clipped_value_loss_gradient_is_zero_when_clipped_error_wins():
    values = torch.tensor([[2.0]], requires_grad=True)
    one_token = torch.ones(1, 1, dtype=torch.bool)
    out = clipped_value_loss(values, torch.tensor([[1.0]]), torch.tensor([[2.5]]), one_token, 0.2)
    out.loss.backward()
    # the clipped prediction 1.2 does not depend on values once |values - old| > 0.2
    assert values.grad.item() == 0.0


def test_clipped_value_loss_gradient_is_value_minus_return_when_unclipped_wins():
    values = torch.tensor([[2.0]], requires_grad=True)
    one_token = torch.ones(1, 1, dtype=torch.bool)
    out = clipped_value_loss(values, torch.tensor([[1.0]]), torch.tensor([[0.0]]), one_token, 0.2)
    out.loss.backward()
    # d/dv of 0.5 * (v - R)^2 at v = 2, R = 0 is 2
    torch.testing.assert_close(values.grad, torch.tensor([[2.0]]), **TOL)


def test_clipped_value_loss_ignores_masked_out_tokens():
    reference = clipped_value_loss(VALUES, OLD_VALUES, RETURNS, VALUE_MASK, 0.2)
    values = VALUES.clone()
    values[1, 1] = float("inf")
    values.requires_grad_()
    old_values, returns = OLD_VALUES.clone(), RETURNS.clone()
    old_values[1, 1], returns[1, 1] = float("nan"), -float("inf")
    out = clipped_value_loss(values, old_values, returns, VALUE_MASK, 0.2)
    out.loss.backward()
    for got, want in zip(out, reference):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.isfinite(values.grad).all() and values.grad[1, 1] == 0.0


@pytest.mark.parametrize("seed", range(10))
def test_clipped_value_loss_matches_plain_loop_on_random_inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    values, old_values, returns = torch.randn(3, 4, 6, generator=generator, dtype=torch.float64)
    value_mask = torch.rand(4, 6, generator=generator) < 0.7
    value_mask[0, 0] = True
    out = clipped_value_loss(values, old_values, returns, value_mask, 0.3)
    losses, clipped = [], []
    for v, old, ret, counts in zip(values.flatten().tolist(), old_values.flatten().tolist(),
                                   returns.flatten().tolist(), value_mask.flatten().tolist()):
        if counts:
            v_clipped = old + min(max(v - old, -0.3), 0.3)
            losses.append(max((v - ret) ** 2, (v_clipped - ret) ** 2))
            clipped.append((v_clipped - ret) ** 2 > (v - ret) ** 2)
    assert out.loss.item() == pytest.approx(0.5 * sum(losses) / len(losses), rel=1e-12)
    assert out.clipfrac.item() == pytest.approx(sum(clipped) / len(clipped), rel=1e-12)


def test_entropy_from_logits_matches_hand_computed_case():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0]]])
    # uniform over 2: ln 2; p = [0.75, 0.25]: -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.5623351446
    torch.testing.assert_close(entropy_from_logits(logits), torch.tensor([[0.6931471806, 0.5623351446]]), **TOL)


def test_entropy_from_logits_is_log_vocab_for_uniform_and_zero_for_one_hot():
    uniform = torch.full((2, 3, 50), 1.7)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(50.0)), **TOL)
    one_hot = torch.full((1, 1, 50), -1e4)
    one_hot[..., 7] = 0.0
    torch.testing.assert_close(entropy_from_logits(one_hot), torch.zeros(1, 1), **TOL)


@pytest.mark.parametrize("seed", range(5))
def test_entropy_from_logits_matches_plain_loop_on_random_inputs(seed):
    logits = 3 * torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    entropy = entropy_from_logits(logits)
    for b in range(2):
        for t in range(3):
            row = logits[b, t].tolist()
            normaliser = sum(math.exp(x) for x in row)
            expected = -sum(math.exp(x) / normaliser * (x - math.log(normaliser)) for x in row)
            assert entropy[b, t].item() == pytest.approx(expected, rel=1e-10)


def test_entropy_from_logits_is_invariant_to_shifting_logits():
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    torch.testing.assert_close(entropy_from_logits(logits + 100.0), entropy_from_logits(logits), **TOL)


def test_explained_variance_matches_hand_computed_case():
    values = torch.tensor([[1.0, 2.0, 3.0, 3.0, 100.0]])
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, -100.0]])
    mask = torch.tensor([[True, True, True, True, False]])
    # residual [0,0,0,1]: var 0.1875; returns [1,2,3,4]: var 1.25 -> 1 - 0.1875 / 1.25 = 0.85
    torch.testing.assert_close(explained_variance(values, returns, mask), torch.tensor(0.85), **TOL)


def test_explained_variance_is_one_for_perfect_critic_and_zero_for_constant_critic():
    returns = torch.randn(3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    one, zero = torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    torch.testing.assert_close(explained_variance(returns, returns, mask), one, **TOL)
    torch.testing.assert_close(explained_variance(torch.full_like(returns, 0.3), returns, mask), zero, **TOL)


def test_explained_variance_is_zero_not_nan_when_returns_are_constant_or_mask_empty():
    values = torch.tensor([[1.0, 2.0, 3.0]])
    returns = torch.full((1, 3), 2.0)
    assert explained_variance(values, returns, torch.ones(1, 3, dtype=torch.bool)) == 0.0
    assert explained_variance(values, returns + torch.arange(3.0), torch.zeros(1, 3, dtype=torch.bool)) == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_explained_variance_matches_plain_loop_on_random_inputs(seed):
    generator = torch.Generator().manual_seed(seed)
    values, returns = torch.randn(2, 4, 6, generator=generator, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=generator) < 0.7
    flat = zip(values.flatten().tolist(), returns.flatten().tolist(), mask.flatten().tolist())
    pairs = [(v, r) for v, r, counts in flat if counts]

    def variance(xs):
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / len(xs)

    expected = 1 - variance([r - v for v, r in pairs]) / variance([r for _, r in pairs])
    assert explained_variance(values, returns, mask).item() == pytest.approx(expected, rel=1e-10)


def test_loss_functions_do_not_mutate_inputs():
    logprobs, old_logprobs, advantages, response_mask = random_policy_batch(6)
    logits = torch.randn(4, 7, 5, dtype=torch.float64)
    inputs = (logprobs, old_logprobs, advantages, response_mask, logits)
    snapshot = [x.clone() for x in inputs]
    clipped_policy_loss(logprobs, old_logprobs, advantages, response_mask, 0.2)
    clipped_value_loss(logprobs, old_logprobs, advantages, response_mask, 0.2)
    entropy_from_logits(logits)
    explained_variance(logprobs, advantages, response_mask)
    for before, after in zip(snapshot, inputs):
        assert torch.equal(before, after)


# Clip-higher (DAPO): eps_low 0.2, eps_high 0.28. One token per case of the 1x4 batch.
CH_RATIOS = torch.tensor([[1.25, 1.3, 0.75, 0.85]], dtype=torch.float64)
CH_ADVANTAGES = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
CH_MASK = torch.ones(1, 4, dtype=torch.bool)


def test_clipped_surrogate_matches_hand_computed_clip_higher_case():
    out = clipped_surrogate(CH_RATIOS, CH_ADVANTAGES, 0.2, 0.28)
    # 1.25 < 1.28 stays unclipped: -1.25; 1.3 > 1.28: -1.28; 0.75 < 0.8 with A < 0: max(0.75, 0.8); 0.85 inside
    torch.testing.assert_close(out.per_token, torch.tensor([[-1.25, -1.28, 0.8, 0.85]], dtype=torch.float64), **TOL)
    assert out.clipped_high.tolist() == [[False, True, False, False]]
    assert out.clipped_low.tolist() == [[False, False, True, False]]


def test_clipped_policy_loss_with_cliprange_high_matches_hand_computed_case():
    logprobs = CH_RATIOS.log().requires_grad_()
    out = clipped_policy_loss(logprobs, torch.zeros(1, 4, dtype=torch.float64), CH_ADVANTAGES, CH_MASK, 0.2,
                              cliprange_high=0.28)
    torch.testing.assert_close(out.loss, torch.tensor(-0.22, dtype=torch.float64), **TOL)  # (-1.25 - 1.28 + 0.8 + 0.85) / 4
    assert (out.clipfrac_low.item(), out.clipfrac_high.item(), out.clipfrac.item()) == (0.25, 0.25, 0.5)
    out.loss.backward()
    # only the unclipped tokens move: d/dlogp of -A * r / 4 is -A * r / 4
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.25 / 4, 0.0, 0.0, 0.85 / 4]], dtype=torch.float64), **TOL)


def test_clipped_policy_loss_cliprange_high_defaults_to_cliprange():
    out = clipped_policy_loss(CH_RATIOS.log(), torch.zeros(1, 4, dtype=torch.float64), CH_ADVANTAGES, CH_MASK, 0.2)
    # symmetric 0.2: 1.25 is clipped to 1.2 too -> (-1.2 - 1.2 + 0.8 + 0.85) / 4
    torch.testing.assert_close(out.loss, torch.tensor(-0.1875, dtype=torch.float64), **TOL)
    assert (out.clipfrac_low.item(), out.clipfrac_high.item(), out.clipfrac.item()) == (0.25, 0.5, 0.75)


@pytest.mark.parametrize("seed", range(5))
def test_clipfrac_is_the_sum_of_the_low_and_high_fractions(seed):
    logprobs, old_logprobs, advantages, response_mask = random_policy_batch(seed)
    out = clipped_policy_loss(logprobs, old_logprobs, advantages, response_mask, 0.2, cliprange_high=0.3)
    ratio = (logprobs - old_logprobs).exp()
    strictly_larger = -advantages * ratio.clamp(0.8, 1.3) > -advantages * ratio  # verl's pg_clipfrac
    torch.testing.assert_close(out.clipfrac, strictly_larger[response_mask].double().mean(), **TOL)
    torch.testing.assert_close(out.clipfrac, out.clipfrac_low + out.clipfrac_high, **TOL)


# GSPO: row 0 has log-ratios [0.1, 0.3] (mean 0.2), row 1 one real token with log-ratio -0.4.
GSPO_OLD = torch.zeros(2, 2, dtype=torch.float64)
GSPO_LOGPROBS = torch.tensor([[0.1, 0.3], [-0.4, 5.0]], dtype=torch.float64)
GSPO_ADVANTAGES = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
GSPO_MASK = torch.tensor([[True, True], [True, False]])


def test_sequence_log_ratio_is_the_mean_token_log_ratio_of_each_row():
    log_ratio = sequence_log_ratio(GSPO_LOGPROBS, GSPO_OLD, GSPO_MASK)
    torch.testing.assert_close(log_ratio, torch.tensor([[0.2, 0.2], [-0.4, 0.0]], dtype=torch.float64), **TOL)


def test_sequence_log_ratio_gradient_is_one_per_real_token():
    logprobs = GSPO_LOGPROBS.clone().requires_grad_()
    sequence_log_ratio(logprobs, GSPO_OLD, GSPO_MASK).sum().backward()
    # sg[log s_i] + logp_t - sg[logp_t]: d/dlogp_t = 1 on real tokens, padding gets nothing
    assert logprobs.grad.tolist() == [[1.0, 1.0], [1.0, 0.0]]


def test_gspo_loss_matches_hand_computed_case():
    out = clipped_policy_loss(GSPO_LOGPROBS, GSPO_OLD, GSPO_ADVANTAGES, GSPO_MASK, 0.2,
                              ratio_level="sequence", loss_agg_mode="seq_mean_token_mean")
    # s_0 = e^0.2 = 1.2214 > 1.2 with A > 0: -1.2; s_1 = e^-0.4 = 0.6703 < 0.8 with A < 0: 0.8; mean of rows
    torch.testing.assert_close(out.loss, torch.tensor(-0.2, dtype=torch.float64), **TOL)
    assert (out.clipfrac_low.item(), out.clipfrac_high.item()) == (1 / 3, 2 / 3)
    # approx_kl stays token-level: 0.5 * (0.01 + 0.09 + 0.16) / 3
    torch.testing.assert_close(out.approx_kl, torch.tensor(0.26 / 6, dtype=torch.float64), **TOL)


def test_gspo_gradient_equals_the_sequence_level_objective_gradient():
    logprobs = GSPO_LOGPROBS.clone().requires_grad_()
    out = clipped_policy_loss(logprobs, GSPO_OLD, GSPO_ADVANTAGES, GSPO_MASK, 0.5,
                              ratio_level="sequence", loss_agg_mode="seq_mean_token_mean")
    # unclipped at eps 0.5: (-e^0.2 + e^-0.4) / 2
    torch.testing.assert_close(out.loss, torch.tensor(-0.2755413561, dtype=torch.float64), **TOL)
    out.loss.backward()
    # GSPO's objective written per sequence: -1/2 sum_i A_i exp(mean_t log-ratio_i)
    reference = GSPO_LOGPROBS.clone().requires_grad_()
    log_s = torch.stack([reference[0].mean(), reference[1, :1].mean()])
    (-(torch.tensor([1.0, -1.0], dtype=torch.float64) * log_s.exp()).mean()).backward()
    # = -e^0.2 / 4 on each token of row 0, e^-0.4 / 2 on row 1's token
    torch.testing.assert_close(logprobs.grad, reference.grad, **TOL)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.3053506895, -0.3053506895], [0.3351600230, 0.0]],
                                                            dtype=torch.float64), **TOL)


def test_sequence_ratio_equals_token_ratio_when_rows_have_one_token():
    logprobs, old_logprobs, advantages, _ = random_policy_batch(6, shape=(5, 3))
    mask = torch.zeros(5, 3, dtype=torch.bool)
    mask[:, 0] = True
    token = clipped_policy_loss(logprobs, old_logprobs, advantages, mask, 0.2, ratio_level="token")
    sequence = clipped_policy_loss(logprobs, old_logprobs, advantages, mask, 0.2, ratio_level="sequence")
    for got, want in zip(sequence, token):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_gspo_loss_ignores_inf_and_nan_on_padding():
    logprobs = GSPO_LOGPROBS.clone()
    logprobs[1, 1] = float("inf")
    logprobs.requires_grad_()
    old = GSPO_OLD.clone()
    old[1, 1] = float("nan")
    out = clipped_policy_loss(logprobs, old, GSPO_ADVANTAGES, GSPO_MASK, 0.5, ratio_level="sequence",
                              loss_agg_mode="seq_mean_token_mean")
    out.loss.backward()
    torch.testing.assert_close(out.loss, torch.tensor(-0.2755413561, dtype=torch.float64), **TOL)
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[1, 1] == 0.0


def test_clipped_policy_loss_uses_the_loss_aggregation():
    # the 2x3 case: per-token losses [-1.2, -0.5, 2 | 0.8, 2, -]; row means 0.1 and 1.4
    out = clipped_policy_loss(RATIOS.log(), torch.zeros(2, 3), ADVANTAGES, RESPONSE_MASK, 0.2,
                              loss_agg_mode="seq_mean_token_mean")
    torch.testing.assert_close(out.loss, torch.tensor(0.75), **TOL)
    out = clipped_policy_loss(RATIOS.log(), torch.zeros(2, 3), ADVANTAGES, RESPONSE_MASK, 0.2,
                              loss_agg_mode="seq_mean_token_sum_norm", max_response_length=4)
    torch.testing.assert_close(out.loss, torch.tensor((0.3 + 2.8) / 8), **TOL)  # row sums 0.3, 2.8, / 4, mean


def test_clipped_policy_loss_rejects_an_unknown_ratio_level():
    with pytest.raises(ValueError, match=r"^unknown ratio_level 'seq'; expected one of token, sequence$"):
        clipped_policy_loss(RATIOS.log(), torch.zeros(2, 3), ADVANTAGES, RESPONSE_MASK, 0.2, ratio_level="seq")
