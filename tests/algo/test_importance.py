import math

import torch

from ppo_cli.algo.importance import truncated_is_weights
from ppo_cli.algo.losses import clipped_policy_loss

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, 0.0]])
SAMPLER = torch.tensor([[-1.0, -2.5, -0.2], [-1.0, -1.0, float("-inf")]])
MASK = torch.tensor([[True, True, True], [True, True, False]])


def test_weights_by_hand():
    weights = truncated_is_weights(OLD, SAMPLER, MASK, clip=1.5)
    expected = torch.tensor([
        [1.0,              # same log-prob: weight 1
         1.5,              # exp(0.5) = 1.6487 is truncated to the cap
         math.exp(-0.3)],  # 0.7408: the sampler liked it more, only the upper side is capped
        [math.exp(-2.0),   # 0.1353
         1.0,
         1.0],             # padding (sampler -inf there): 1, never inf or NaN
    ])
    torch.testing.assert_close(weights, expected, rtol=1e-6, atol=1e-6)


def test_weights_are_detached():
    old = OLD.clone().requires_grad_(True)
    assert not truncated_is_weights(old, SAMPLER, MASK, clip=2.0).requires_grad


def test_weighted_policy_loss_multiplies_each_token_term():
    # ratio 1 everywhere (logprobs == old): each token's term is -A_t, so the loss is -mean(w_t * A_t).
    advantages = torch.tensor([[1.0, -2.0, 4.0], [0.5, 3.0, 100.0]])
    weights = truncated_is_weights(OLD, SAMPLER, MASK, clip=1.5)
    logprobs = OLD.clone().requires_grad_(True)
    out = clipped_policy_loss(logprobs, OLD, advantages, MASK, cliprange=0.2, token_weights=weights)
    by_hand = -(1.0 * 1.0 + 1.5 * -2.0 + math.exp(-0.3) * 4.0 + math.exp(-2.0) * 0.5 + 1.0 * 3.0) / 5
    assert math.isclose(out.loss.item(), by_hand, rel_tol=1e-6)
    out.loss.backward()
    # d(-w A ratio)/d logprob = -w A at ratio 1, divided by the 5 counted tokens; padding gets none.
    torch.testing.assert_close(logprobs.grad, torch.where(MASK, -weights * advantages / 5, 0.0))
    # Without weights the same call is the plain clipped loss.
    plain = clipped_policy_loss(OLD, OLD, advantages, MASK, cliprange=0.2)
    assert math.isclose(plain.loss.item(), -(1.0 - 2.0 + 4.0 + 0.5 + 3.0) / 5, rel_tol=1e-6)
