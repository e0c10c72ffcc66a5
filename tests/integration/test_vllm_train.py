"""`ppo train` with generation.backend: vllm on the tiny models (skipped where vllm is not installed:
scripts/vllm_test.sh makes a venv with it and runs these).

The policy is the tiny one rewritten with 32-dim heads (tests/fixtures/vllm_models.py: vLLM's CPU
attention takes no 24-dim heads), which computes the same logits."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppo_cli.cli import app
from tests.conftest import ROOT, tiny_overrides, is_wall_clock


def _vllm_importable() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - e.g. torchvision built for another torch
        return False
    return True


pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(not _vllm_importable(), reason="vllm is not importable (scripts/vllm_test.sh installs it)"),
]
runner = CliRunner()
# Float32 on both sides, same weights: the sampler's and the trainer's log-probs agree to float rounding
# (measured 4e-6 nats per token at most); a stale adapter or weight copy in vLLM shows up as 0.01-0.3.
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def wide_models(tiny_models, tmp_path_factory) -> Path:
    """The tiny models, the policy in vLLM's shape."""
    from tests.fixtures.vllm_models import widen_heads

    out = tmp_path_factory.mktemp("vllm-models")
    widen_heads(tiny_models / "policy", out / "policy")
    (out / "reward").symlink_to(tiny_models / "reward")
    return out


def _train(models: Path, out: Path, *args: str, **sets) -> list[dict]:
    sets = {"data.prompts": ROOT / "recipes/prompts/reviews.txt",
            "generation.backend": "vllm", **sets}
    cli = ["train", str(ROOT / "recipes" / "tiny_sentiment.yaml")]
    # float32 pinned: LOGPROB_TOLERANCE holds for float32 on both sides. Where the probe picks bf16
    # autocast for the trainer, vLLM (float32 weights) differs by about 0.05 nats per token (measured).
    for item in tiny_overrides(models, out, float32=True, **sets):
        cli += ["--set", item]
    result = runner.invoke(app, cli + list(args))
    assert result.exit_code == 0, result.output
    name = sets.get("name", "tiny-sentiment")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def _same_numbers(a: dict, b: dict) -> bool:
    keys = {k for k in a if not is_wall_clock(k)}
    return {k: a[k] for k in keys} == {k: b[k] for k in keys}


@pytest.fixture(scope="module")
def lora_run(wide_models, tmp_path_factory) -> list[dict]:
    return _train(wide_models, tmp_path_factory.mktemp("runs"), **{"train.total_updates": 8, "train.save_every": 4})


def test_lora_policy_learns_with_vllm_rollouts(lora_run):
    scores = [m["objective/scores"] for m in lora_run]
    # The demo's curve: about -3 at first, short positive reviews (+8 and more) after a few updates.
    assert sum(scores[-3:]) / 3 > sum(scores[:3]) / 3 + 4.0, scores
    for m in lora_run:
        # The trainer recomputes the old log-probs: before its first step the ratio is 1.
        assert abs(m["val/ratio_first_minibatch"] - 1.0) < 1e-4, m
        # vLLM sampled with the adapter of this very update (a fresh LoRA id each time).
        assert m["rollout/logprob_diff_max"] < LOGPROB_TOLERANCE, m
        assert 0.0 <= m["rollout/logprob_diff_mean"] <= m["rollout/logprob_diff_max"]


def test_resumed_vllm_run_gives_the_uninterrupted_numbers(lora_run, wide_models, tmp_path):
    # Per-request seeds come from torch's RNG, which the checkpoint restores.
    first = _train(wide_models, tmp_path, **{"train.total_updates": 4, "train.save_every": 4})
    assert all(_same_numbers(a, b) for a, b in zip(first, lora_run[:4]))
    resumed = _train(wide_models, tmp_path, "--resume", "latest", **{"train.total_updates": 8, "train.save_every": 4})
    assert [m["step"] for m in resumed] == list(range(1, 9))
    for a, b in zip(resumed[4:], lora_run[4:]):
        assert _same_numbers(a, b), (a, b)


def test_full_fine_tuning_reloads_the_weights_into_vllm(wide_models, tmp_path):
    metrics = _train(wide_models, tmp_path, **{"policy.lora": "null", "value.kind": "model", "optim.lr": 1e-4,
                                               "ppo.rollout_is_clip": 2.0, "train.total_updates": 3})
    assert metrics[-1]["objective/kl"] > 0.05  # the policy did move away from the weights vLLM loaded
    for m in metrics:
        assert m["rollout/logprob_diff_max"] < LOGPROB_TOLERANCE, m
        assert abs(m["val/ratio_first_minibatch"] - 1.0) < 1e-4, m


def test_grpo_samples_each_group_as_one_vllm_request_of_n(wide_models, tmp_path):
    """A group of 4 completions is one request with SamplingParams n=4: the completions differ (each
    child has its own seed), and each sits on its own prompt's row (a completion on another prompt's row
    would put the sampler's log-probs far from the trainer's)."""
    metrics = _train(wide_models, tmp_path, **{"ppo.advantage": "grpo", "generation.num_generations": 4,
                                               "value.kind": "none", "ppo.rollout_batch_size": 4,
                                               "ppo.mini_batch_size": 8, "ppo.micro_batch_size": 8,
                                               "train.total_updates": 2, "train.save_every": 0})
    for m in metrics:
        assert m["reward_std"] > 0.0 and m["frac_reward_zero_std"] < 1.0, m
        assert m["rollout/logprob_diff_max"] < LOGPROB_TOLERANCE, m
    assert metrics[-1]["episode"] == 2 * 4 * 4


SMOLLM2_RECIPE = ROOT / "recipes" / "smollm2_concise.yaml"


def _train_smollm2(smollm2: Path, out: Path, **sets) -> list[dict]:
    """Short updates (two unless ``sets`` says) of the real recipe (its reward, prompts, LoRA) sampled by vLLM."""
    sets = {"policy.path": smollm2, "output_dir": out, "generation.backend": "vllm",
            "generation.max_new_tokens": 16, "ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 4,
            "ppo.micro_batch_size": 4, "train.total_updates": 2, "train.sample_every": 0, **sets}
    cli = ["train", str(SMOLLM2_RECIPE)]
    for key, value in sets.items():
        cli += ["--set", f"{key}={value}"]
    result = runner.invoke(app, cli)
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in (out / "smollm2-concise" / "metrics.jsonl").read_text().splitlines()]


def test_smollm2_with_vllm_rollouts_samples_the_trained_distribution(smollm2, tmp_path):
    """SmolLM2-135M (30 layers, heads of 64, tied embeddings). In float32 on both sides vLLM's log-probs
    are the trainer's to float rounding in every update (measured 5e-6 mean, 5e-5 max at 48 tokens): the
    adapter it samples with is this update's. Under the default bf16 autocast the engine computes in bf16
    and the two differ by rounding only (measured 0.03 nats per token, at most 0.3-0.5)."""
    exact = _train_smollm2(smollm2, tmp_path / "fp32", **{"train.mixed_precision": "no"})
    assert len(exact) == 2
    for m in exact:
        assert m["rollout/logprob_diff_max"] < LOGPROB_TOLERANCE, m
        assert abs(m["val/ratio_first_minibatch"] - 1.0) < 1e-4, m
    assert exact[-1]["objective/kl"] > 0.0  # the second update sampled with a trained adapter
    default = _train_smollm2(smollm2, tmp_path / "auto", **{"train.total_updates": 1})
    for m in default:
        assert 0.0 < m["rollout/logprob_diff_mean"] < 0.1, m
        assert m["rollout/logprob_diff_mean"] <= m["rollout/logprob_diff_max"] < 2.0, m
        assert abs(m["val/ratio_first_minibatch"] - 1.0) < 1e-4, m
