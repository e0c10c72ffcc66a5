import math

import pytest
import torch

from ppo_cli.algo.kl import AdaptiveKLController, FixedKLController, kl_penalty

TOL = dict(rtol=1e-6, atol=1e-6)

LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5]])
REF_LOGPROBS = torch.tensor([[-1.5, -1.0, -0.5]])


def test_kl_penalty_k1_matches_hand_computed_case():
    # logprobs - ref_logprobs = [-1 + 1.5, -2 + 1, -0.5 + 0.5]
    expected = torch.tensor([[0.5, -1.0, 0.0]])
    torch.testing.assert_close(kl_penalty(LOGPROBS, REF_LOGPROBS, "k1"), expected, **TOL)


def test_kl_penalty_defaults_to_k1():
    torch.testing.assert_close(kl_penalty(LOGPROBS, REF_LOGPROBS), kl_penalty(LOGPROBS, REF_LOGPROBS, "k1"))


def test_kl_penalty_k2_matches_hand_computed_case():
    # 0.5 * [0.5^2, (-1)^2, 0^2]
    expected = torch.tensor([[0.125, 0.5, 0.0]])
    torch.testing.assert_close(kl_penalty(LOGPROBS, REF_LOGPROBS, "k2"), expected, **TOL)


def test_kl_penalty_k3_matches_hand_computed_case():
    # r = ref - logprobs = [-0.5, 1, 0]: e^-0.5 - 1 + 0.5 = 0.1065306597, e - 1 - 1 = 0.7182818285, 0
    expected = torch.tensor([[0.1065306597, 0.7182818285, 0.0]])
    torch.testing.assert_close(kl_penalty(LOGPROBS, REF_LOGPROBS, "k3"), expected, **TOL)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_is_zero_when_policies_match(estimator):
    logprobs = -torch.rand(3, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(kl_penalty(logprobs, logprobs, estimator), torch.zeros(3, 4), **TOL)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_kl_penalty_k2_and_k3_are_non_negative(estimator):
    generator = torch.Generator().manual_seed(1)
    logprobs = -5 * torch.rand(64, 32, generator=generator, dtype=torch.float64)
    ref_logprobs = -5 * torch.rand(64, 32, generator=generator, dtype=torch.float64)
    assert (kl_penalty(logprobs, ref_logprobs, estimator) >= 0).all()


def test_kl_penalty_matches_plain_loop_on_random_inputs():
    generator = torch.Generator().manual_seed(2)
    logprobs = -3 * torch.rand(4, 6, generator=generator, dtype=torch.float64)
    ref_logprobs = -3 * torch.rand(4, 6, generator=generator, dtype=torch.float64)
    k1, k2, k3 = (kl_penalty(logprobs, ref_logprobs, name) for name in ("k1", "k2", "k3"))
    for b in range(4):
        for t in range(6):
            log_ratio = logprobs[b, t].item() - ref_logprobs[b, t].item()
            assert k1[b, t].item() == pytest.approx(log_ratio, rel=1e-12, abs=1e-12)
            assert k2[b, t].item() == pytest.approx(0.5 * log_ratio**2, rel=1e-12, abs=1e-12)
            assert k3[b, t].item() == pytest.approx(math.exp(-log_ratio) - 1 + log_ratio, rel=1e-9, abs=1e-12)


def test_kl_penalty_k3_mean_estimates_true_kl():
    # Sampling a ~ pi, the mean of k1 and k3 both approach KL(pi || pi_ref) (both are unbiased).
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    pi_ref = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    true_kl = (pi * (pi / pi_ref).log()).sum()
    samples = torch.multinomial(pi, 200_000, replacement=True, generator=torch.Generator().manual_seed(3))
    logprobs, ref_logprobs = pi.log()[samples], pi_ref.log()[samples]
    # 200k samples: standard error of each mean is about 2e-3, so 1e-2 is five standard errors
    for estimator in ("k1", "k3"):
        estimate = kl_penalty(logprobs, ref_logprobs, estimator).mean()
        torch.testing.assert_close(estimate, true_kl, rtol=0, atol=1e-2)


def test_kl_penalty_rejects_unknown_estimator():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty(LOGPROBS, REF_LOGPROBS, "k4")


def test_kl_penalty_does_not_mutate_inputs():
    logprobs, ref_logprobs = LOGPROBS.clone(), REF_LOGPROBS.clone()
    for estimator in ("k1", "k2", "k3"):
        kl_penalty(logprobs, ref_logprobs, estimator)
    assert torch.equal(logprobs, LOGPROBS) and torch.equal(ref_logprobs, REF_LOGPROBS)


def test_fixed_kl_controller_update_is_a_no_op():
    controller = FixedKLController(value=0.05)
    controller.update(current_kl=100.0, n_steps=64)
    assert controller.value == 0.05


def test_fixed_kl_controller_state_dict_round_trips():
    restored = FixedKLController(value=1.0)
    restored.load_state_dict(FixedKLController(value=0.05).state_dict())
    assert restored == FixedKLController(value=0.05)


def test_adaptive_kl_controller_clips_error_above_target():
    controller = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    controller.update(current_kl=12.0, n_steps=64)
    # 12 / 6 - 1 = 1 clips to 0.2: 0.1 * (1 + 0.2 * 64 / 10000) = 0.1 * 1.00128
    assert controller.value == pytest.approx(0.100128, rel=1e-12)


def test_adaptive_kl_controller_clips_error_below_target():
    controller = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    controller.update(current_kl=0.0, n_steps=64)
    # 0 / 6 - 1 = -1 clips to -0.2: 0.1 * (1 - 0.2 * 64 / 10000) = 0.1 * 0.99872
    assert controller.value == pytest.approx(0.099872, rel=1e-12)


def test_adaptive_kl_controller_uses_unclipped_error_inside_band():
    controller = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    controller.update(current_kl=6.6, n_steps=64)
    # 6.6 / 6 - 1 = 0.1 is inside [-0.2, 0.2]: 0.1 * (1 + 0.1 * 64 / 10000) = 0.1 * 1.00064
    assert controller.value == pytest.approx(0.100064, rel=1e-12)


def test_adaptive_kl_controller_holds_value_at_target():
    controller = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    controller.update(current_kl=torch.tensor(6.0), n_steps=64)
    assert controller.value == pytest.approx(0.1, rel=1e-12)
    assert isinstance(controller.value, float)


def test_adaptive_kl_controller_compounds_over_updates():
    controller = AdaptiveKLController(value=0.1, target=1.0, horizon=100)
    controller.update(current_kl=2.0, n_steps=10)
    controller.update(current_kl=2.0, n_steps=10)
    # each update clips to 0.2 and multiplies by 1 + 0.2 * 10 / 100 = 1.02: 0.1 * 1.02^2 = 0.10404
    assert controller.value == pytest.approx(0.10404, rel=1e-12)


def test_adaptive_kl_controller_state_dict_round_trips():
    source = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    source.update(current_kl=12.0, n_steps=64)
    restored = AdaptiveKLController(value=1.0, target=1.0, horizon=1)
    restored.load_state_dict(source.state_dict())
    assert restored == source
    assert source.state_dict() == {"value": source.value, "target": 6.0, "horizon": 10000}


def test_adaptive_kl_controller_load_state_dict_rejects_unknown_keys():
    controller = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    with pytest.raises(TypeError):
        controller.load_state_dict({"value": 0.2, "target": 6.0, "horizon": 10, "extra": 1})
    assert controller.value == 0.1


@pytest.mark.parametrize("target, horizon", [(0.0, 10), (-1.0, 10), (6.0, 0)])
def test_adaptive_kl_controller_rejects_non_positive_target_or_horizon(target, horizon):
    with pytest.raises(ValueError, match="must be > 0"):
        AdaptiveKLController(value=0.1, target=target, horizon=horizon)


def test_kl_penalty_k3_in_the_loss_is_trl_grpo_per_token_kl_with_its_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    ref_logprobs = REF_LOGPROBS.double()
    per_token_kl = kl_penalty(logprobs, ref_logprobs, "k3")
    # TRL's GRPOTrainer: torch.exp(ref - logp) - (ref - logp) - 1
    trl = torch.exp(ref_logprobs - logprobs) - (ref_logprobs - logprobs) - 1
    torch.testing.assert_close(per_token_kl, trl, rtol=1e-12, atol=1e-12)
    per_token_kl.sum().backward()
    # d/dlogp = 1 - exp(ref - logp): 1 - e^-0.5 = 0.3934693403, 1 - e = -1.7182818285, 1 - e^0 = 0
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.3934693403, -1.7182818285, 0.0]], dtype=torch.float64),
                               **TOL)
