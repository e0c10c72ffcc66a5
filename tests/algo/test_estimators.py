"""The estimator registry on action masks with holes (an environment's tokens between the policy's).

Each estimator must equal tests/algo/numpy_reference.py, whose loops run over each row's action tokens
as one compacted sequence and write back at their positions; one-turn (prefix) masks must give the
same bits as the formula before masks could have holes.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from ppo_cli.algo.advantages import compact_order, compute_gae, shape_rewards, uncompact
from ppo_cli.algo.estimators import ESTIMATORS, EstimatorSettings
from ppo_cli.algo.group import group_normalized_advantages
from tests.algo import numpy_reference as ref

TOL = 1e-6
SEEDS = range(6)


def holed_batch(seed, group_size=3, prompts=2, length=10):
    """A batch whose action masks have holes: each row is real up to a random length, and inside it
    random environment segments are not actions. Row 0 is all actions (one turn), row 1 has none."""
    rng = np.random.default_rng(seed)
    batch = group_size * prompts
    lengths = rng.integers(1, length + 1, size=batch)
    lengths[0] = length
    action = (np.arange(length)[None, :] < lengths[:, None]) & (rng.random((batch, length)) < 0.6)
    action[0], action[1] = True, False
    action[2, :4] = [True, False, False, True]  # at least one hole
    return dict(
        scores=rng.integers(-2, 3, size=batch).astype(np.float64) * rng.choice([1.0, 0.3]),
        kl=rng.random((batch, length)),
        values=rng.standard_normal((batch, length)),
        mask=action,
        group_size=group_size,
    )


def t(array):
    return torch.from_numpy(np.asarray(array))


def close(got, want):
    np.testing.assert_allclose(got.numpy(), np.asarray(want, dtype=np.float64), rtol=TOL, atol=TOL)


def estimate(name, b, reduce_sum=None, **settings):
    """ESTIMATORS[name] on batch ``b``, the KL weighted 0.05."""
    settings = EstimatorSettings(kl_coef=0.05, group_size=b["group_size"], **settings)
    values = t(b["values"]) if name == "gae" else None
    return ESTIMATORS[name](t(b["scores"]), t(b["kl"]), values, t(b["mask"]), settings, reduce_sum)


def assert_estimate_matches(got, want, mask):
    for field, want_field in zip(got._fields, want):
        close(getattr(got, field), want_field)
        assert (getattr(got, field)[~t(mask)] == 0).all(), f"{field} is not 0 outside the action mask"


# --- GAE over the action tokens as one sequence ---------------------------------------------------


def test_compute_gae_with_one_hole_matches_hand_computed_case():
    # Positions 2 and 3 are an environment's tokens: their reward 9 and value 7 never count.
    rewards = torch.tensor([[0.0, 0.0, 9.0, 9.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 7.0, 7.0, 0.7]])
    action_mask = torch.tensor([[True, True, False, False, True]])
    advantages, returns = compute_gae(rewards, values, action_mask, gamma=0.9, lam=0.8)
    # compacted: rewards [0, 0, 1], values [0.5, 0.6, 0.7], gamma * lam = 0.72, gamma once per action token:
    # A4 = 1 - 0.7 = 0.3; A1 = (0 + 0.9 * 0.7 - 0.6) + 0.72 * 0.3 = 0.03 + 0.216 = 0.246 (position 1
    # bootstraps from V4 = 0.7 across the hole); A0 = (0.9 * 0.6 - 0.5) + 0.72 * 0.246 = 0.04 + 0.17712
    torch.testing.assert_close(advantages, torch.tensor([[0.21712, 0.246, 0.0, 0.0, 0.3]]), rtol=1e-6, atol=1e-6)
    # returns = A + V on the action tokens: [0.71712, 0.846, -, -, 1.0]
    torch.testing.assert_close(returns, torch.tensor([[0.71712, 0.846, 0.0, 0.0, 1.0]]), rtol=1e-6, atol=1e-6)


def test_shape_rewards_puts_the_score_on_the_last_action_token_and_nothing_on_the_environment():
    kl = torch.tensor([[0.2, 0.4, 0.6, 0.8, 1.0]])
    action_mask = torch.tensor([[True, False, True, False, False]])  # the environment answered last
    rewards, non_score_rewards = shape_rewards(torch.tensor([3.0]), kl, 0.5, action_mask)
    # -0.5 * kl on positions 0 and 2; the score 3 on position 2 (-0.3 + 3 = 2.7), the last action token
    torch.testing.assert_close(non_score_rewards, torch.tensor([[-0.1, 0.0, -0.3, 0.0, 0.0]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.1, 0.0, 2.7, 0.0, 0.0]]))


def test_compacting_a_prefix_mask_is_the_identity_and_uncompact_inverts_any_mask():
    prefix = torch.arange(6) < torch.tensor([6, 0, 3, 1]).unsqueeze(1)
    assert torch.equal(compact_order(prefix), torch.arange(6).expand(4, 6))
    holed = torch.tensor([[False, True, False, True, True, False]])
    order = compact_order(holed)
    assert order.tolist() == [[1, 3, 4, 0, 2, 5]]  # action tokens first, each part in its order
    x = torch.arange(6.0).unsqueeze(0)
    assert torch.equal(uncompact(x.gather(1, order), order), x)


def old_compute_gae(rewards, values, response_mask, gamma, lam):
    """compute_gae as it was when masks were prefixes (before compaction), kept to check bit-identity."""
    rewards = torch.where(response_mask, rewards, 0)
    values = torch.where(response_mask, values, 0)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)
    deltas = rewards + gamma * next_values - values
    advantage = torch.zeros_like(deltas[:, 0])
    reversed_advantages = []
    for step in reversed(range(deltas.shape[1])):
        advantage = deltas[:, step] + gamma * lam * advantage
        reversed_advantages.append(advantage)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    advantages = torch.where(response_mask, advantages, 0)
    return advantages, torch.where(response_mask, advantages + values, 0)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.9), (0.9, 0.0)])
def test_compute_gae_on_prefix_masks_is_bit_identical_to_the_formula_before_holes(seed, gamma, lam):
    generator = torch.Generator().manual_seed(seed)
    rewards = torch.randn(8, 33, generator=generator)  # float32, the training dtype
    values = torch.randn(8, 33, generator=generator)
    lengths = torch.randint(0, 34, (8,), generator=generator)
    lengths[0] = 33
    prefix = torch.arange(33) < lengths.unsqueeze(1)
    for got, want in zip(compute_gae(rewards, values, prefix, gamma, lam),
                         old_compute_gae(rewards, values, prefix, gamma, lam)):
        assert got.dtype == torch.float32 and torch.equal(got, want)


# --- every estimator against the numpy reference, on holed masks ---------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("whiten_rewards", [False, True])
@pytest.mark.parametrize("whiten_advantages", [False, True])
@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.7)])
def test_gae_estimator_matches_reference_on_holed_masks(seed, whiten_rewards, whiten_advantages, gamma, lam):
    b = holed_batch(seed)
    got = estimate("gae", b, gamma=gamma, lam=lam, whiten_rewards=whiten_rewards, whiten_advantages=whiten_advantages)
    want = ref.gae_estimator(b["scores"], b["kl"], 0.05, b["values"], b["mask"], gamma, lam, whiten_rewards,
                             whiten_advantages)
    assert_estimate_matches(got, want, b["mask"])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_grpo_matches_reference_on_holed_masks(seed, scale_rewards):
    b = holed_batch(seed)
    want = ref.sequence_estimator("grpo", b["scores"], b["kl"], 0.05, b["mask"], b["group_size"], scale_rewards)
    assert_estimate_matches(estimate("grpo", b, scale_rewards=scale_rewards), want, b["mask"])


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_reference_on_holed_masks(seed):
    b = holed_batch(seed)
    want = ref.sequence_estimator("rloo", b["scores"], b["kl"], 0.05, b["mask"], b["group_size"])
    assert_estimate_matches(estimate("rloo", b), want, b["mask"])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("group_size", [1, 3])  # 1: REINFORCE++; 3: with the group baseline
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_matches_reference_on_holed_masks(seed, group_size, gamma):
    b = dict(holed_batch(seed), group_size=group_size)
    want = ref.reinforce_estimator(b["scores"], b["kl"], 0.05, b["mask"], group_size, gamma)
    assert_estimate_matches(estimate("reinforce_pp", b, gamma=gamma), want, b["mask"])


def test_reinforce_pp_discounts_once_per_action_token_across_a_hole():
    b = dict(scores=np.array([2.0]), kl=np.zeros((1, 4)), values=np.zeros((1, 4)), group_size=1,
             mask=np.array([[True, False, False, True]]))
    got = estimate("reinforce_pp", b, gamma=0.5)
    # compacted rewards [0, 2]: returns [0.5 * 2, 2] = [1, 2] at positions 0 and 3, not 0.5^3 * 2
    torch.testing.assert_close(got.returns, torch.tensor([[1.0, 0.0, 0.0, 2.0]], dtype=torch.float64))


def test_gae_estimator_without_values_names_the_missing_critic():
    b = holed_batch(0)
    with pytest.raises(ValueError, match=r"^the gae estimator needs the critic's values, got None \(value.kind none\)$"):
        ESTIMATORS["gae"](t(b["scores"]), t(b["kl"]), None, t(b["mask"]), EstimatorSettings(), None)


# --- several processes: reduce_sum -----------------------------------------------------------------


def on_two_fake_processes(fn, inputs):
    """fn(inputs[rank], reduce_sum) on two threads whose reduce_sum is an all-reduce (sum) between them."""
    barrier, slots = threading.Barrier(2, timeout=30), [None, None]

    def reduce_sum_of(rank):
        def reduce_sum(tensor):
            slots[rank] = tensor
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()  # both have read the slots before either overwrites its own
            return total
        return reduce_sum

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(fn, inputs[rank], reduce_sum_of(rank)) for rank in range(2)]
        return [future.result() for future in futures]


def test_grpo_batch_std_over_two_processes_is_the_std_of_the_concatenated_scores():
    generator = torch.Generator().manual_seed(0)
    scores = [torch.randn(6, generator=generator, dtype=torch.float64) * 2, torch.randn(4, generator=generator,
                                                                                        dtype=torch.float64)]
    scores[1][2:] = 0.5  # a constant group stays exactly 0
    parts = on_two_fake_processes(lambda s, reduce_sum: group_normalized_advantages(s, 2, "batch", reduce_sum=reduce_sum),
                                  scores)
    whole = torch.cat(scores)
    std = whole.std().item()
    expected = torch.cat([(s.view(-1, 2) - s.view(-1, 2).mean(dim=1, keepdim=True)).reshape(-1) for s in scores]) / (std + 1e-4)
    expected[8:] = 0.0
    torch.testing.assert_close(torch.cat(parts), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat(parts), group_normalized_advantages(whole, 2, "batch"), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name, settings", [
    ("gae", dict(whiten_rewards=True, whiten_advantages=True)),
    ("grpo", dict(scale_rewards="batch")),
    ("grpo", dict(scale_rewards="group")),
    ("rloo", {}),
    ("reinforce_pp", {}),
])
def test_every_estimator_over_two_processes_equals_one_process_on_the_concatenated_batch(name, settings):
    batches = [holed_batch(1), holed_batch(2)]
    parts = on_two_fake_processes(lambda b, reduce_sum: estimate(name, b, reduce_sum, **settings), batches)
    whole = {key: np.concatenate([b[key] for b in batches]) for key in ("scores", "kl", "values", "mask")}
    want = estimate(name, dict(whole, group_size=3), **settings)
    for field in want._fields:
        got = torch.cat([getattr(part, field) for part in parts])
        torch.testing.assert_close(got, getattr(want, field), rtol=1e-12, atol=1e-12)
