"""`ppo rollout / eval / compare` with generation.backend: vllm sample with vLLM, as `ppo train` does
(skipped where vllm is not importable: scripts/vllm_test.sh runs these).

At temperature 1e-4 sampling is greedy in effect (a runner-up token 0.002 logits behind has probability
e^-20; at 0.01 a near tie on the tiny model flipped one token in 96), so vLLM and transformers, both
float32 on the same weights, must give the same tokens: the same responses, stop tokens and lengths,
which checks prompts, stop token, LoRA adapter and truncation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppo_cli.cli import app
from tests.conftest import ROOT, tiny_overrides
from tests.integration.test_vllm_train import _vllm_importable, wide_models  # noqa: F401 - a fixture

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(not _vllm_importable(), reason="vllm is not importable (scripts/vllm_test.sh installs it)"),
]
runner = CliRunner()
GREEDY = "0.0001"
MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def run(wide_models, tmp_path_factory) -> Path:
    """A LoRA run of two updates (transformers sampling), so 'aligned' is an adapter on the base."""
    out = tmp_path_factory.mktemp("runs")
    sets = {"data.prompts": ROOT / "recipes/prompts/reviews.txt", "data.eval_prompts": "null",
            "train.total_updates": 2, "ppo.rollout_batch_size": 8, "ppo.mini_batch_size": 8,
            "ppo.micro_batch_size": 8}
    cli = ["train", str(ROOT / "recipes" / "tiny_sentiment.yaml")]
    for item in tiny_overrides(wide_models, out, **sets):
        cli += ["--set", item]
    result = runner.invoke(app, cli)
    assert result.exit_code == 0, result.output
    return out / "tiny-sentiment"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "eight.txt"
    path.write_text("\n".join((ROOT / "recipes/prompts/reviews_eval.txt").read_text().splitlines()[:8]) + "\n")
    return path


def _invoke(args: list[str], run: Path, prompts: Path, backend: str, temperature: str = GREEDY):
    result = runner.invoke(app, [*args, "--run", str(run), "--prompts", str(prompts), "--temperature", temperature,
                                 "--max-new-tokens", str(MAX_NEW_TOKENS), "--set", f"generation.backend={backend}"])
    assert result.exit_code == 0, result.output
    return result


def _rollout(model: str, run: Path, prompts: Path, out: Path, backend: str, temperature: str = GREEDY) -> list[dict]:
    _invoke(["rollout", model, "--out", str(out)], run, prompts, backend, temperature)
    return [json.loads(line) for line in out.read_text().splitlines()]


def _tokens(rows: list[dict], prefix: str = "") -> list[tuple]:
    return [(r[f"{prefix}response"], r[f"{prefix}finished"], r[f"{prefix}response_tokens"]) for r in rows]


def test_rollout_samples_with_vllm_what_transformers_samples_greedily(run, prompts, tmp_path):
    vllm_rows = _rollout("base", run, prompts, tmp_path / "vllm.jsonl", "vllm")
    hf_rows = _rollout("base", run, prompts, tmp_path / "hf.jsonl", "hf")
    assert {r["generation"]["backend"] for r in vllm_rows} == {"vllm"}
    assert {r["generation"]["backend"] for r in hf_rows} == {"hf"}
    assert len(vllm_rows) == 8 and _tokens(vllm_rows) == _tokens(hf_rows)


def test_rollout_with_vllm_at_temperature_1_stops_at_the_stop_token_or_the_length_limit(run, prompts, tmp_path):
    rows = _rollout("aligned", run, prompts, tmp_path / "vllm.jsonl", "vllm", temperature="1.0")
    for row in rows:
        assert 1 <= row["response_tokens"] <= MAX_NEW_TOKENS
        assert row["finished"] or row["response_tokens"] == MAX_NEW_TOKENS, row


def test_eval_of_the_lora_adapter_with_vllm_matches_transformers(run, prompts, tmp_path):
    _invoke(["eval", "aligned", "--out", str(tmp_path / "vllm.json")], run, prompts, "vllm")
    _invoke(["eval", "aligned", "--out", str(tmp_path / "hf.json")], run, prompts, "hf")
    vllm, hf = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("vllm", "hf"))
    assert vllm["generation"]["backend"] == "vllm" and hf["generation"]["backend"] == "hf"
    # Same tokens, so the same lengths, stop rate and rewards; the KL is transformers' forward on them.
    for key in ("eos_rate", "response_length", "distinct_1", "distinct_2"):
        assert vllm[key] == hf[key], key
    assert vllm["reward"]["mean"] == pytest.approx(hf["reward"]["mean"], abs=1e-5)
    assert vllm["kl"] == pytest.approx(hf["kl"], abs=1e-4)


def test_compare_runs_two_vllm_engines_in_turn_and_matches_transformers(run, prompts, tmp_path):
    _invoke(["compare", "base", "aligned", "--out", str(tmp_path / "vllm")], run, prompts, "vllm")
    _invoke(["compare", "base", "aligned", "--out", str(tmp_path / "hf")], run, prompts, "hf")
    vllm, hf = (json.loads((tmp_path / name / "compare.json").read_text()) for name in ("vllm", "hf"))
    assert vllm["a"]["generation"]["backend"] == vllm["b"]["generation"]["backend"] == "vllm"
    for side in ("a_", "b_"):
        assert _tokens(vllm["rows"], side) == _tokens(hf["rows"], side)
