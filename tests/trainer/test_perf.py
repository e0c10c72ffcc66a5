"""MFU and decode bandwidth arithmetic, checked against hand-computed numbers."""

import pytest

from ppo_cli.perf import ModelSizes, decode_gbps, mfu, rollout_flops, update_flops

# A 1M-parameter policy; rollout forwards: old log-probs (1M) + reference (1M) + a 0.5M reward model.
SIZES = ModelSizes(policy=1_000_000, rollout_forwards=2_500_000, trained_forwards=1_000_000, policy_bytes=4_000_000)


def test_rollout_flops_count_generation_and_the_scoring_forwards():
    # 4 episodes: 10 prompt tokens each (40), 6 generated each (24); the padded batch is 4 x 16 = 64 positions.
    # generation 2 x 1e6 x (40 + 24) = 1.28e8; forwards 2 x 2.5e6 x 64 = 3.2e8
    assert rollout_flops(SIZES, prompt_tokens=40, generated_tokens=24, sequence_tokens=64) == 1.28e8 + 3.2e8


def test_update_flops_are_six_per_parameter_token_and_epoch():
    # 4 epochs x 6 x 1e6 x 64 = 1.536e9
    assert update_flops(SIZES, sequence_tokens=64, ppo_epochs=4) == 1.536e9


def test_mfu_divides_by_seconds_and_peak():
    assert mfu(1.536e9, seconds=2.0, peak_flops=1e9) == pytest.approx(0.768)


def test_decode_gbps_reads_the_weights_once_per_step():
    # 4 MB of weights x 24 steps in 0.5 s = 192 MB/s
    assert decode_gbps(4_000_000, decode_steps=24, seconds=0.5) == pytest.approx(0.192)
