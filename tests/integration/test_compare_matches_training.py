"""`ppo compare base aligned` on a run's held-out prompts gives, row for row, what the run measured
before and after training (eval.json), and `ppo eval base` gives the same base row.

The recipe is tiny_grpo with 4 prompts per rollout batch (as recipes/smollm2_concise_grpo.yaml): the
16 held-out prompts are then sampled in 4 batches; a held-out evaluation that sampled them in one batch
of 16 drew different random numbers per token and gave a different base row from the same seed.
"""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppo_cli.cli import app
from tests.conftest import ROOT
from tests.integration.test_critic_free import RECIPE, _sets

pytestmark = pytest.mark.slow
EVAL_PROMPTS = ROOT / "recipes/prompts/reviews_eval.txt"


def _ok(*args) -> None:
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def run(tiny_models: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compare-matches")
    _ok("train", RECIPE, *_sets(tiny_models, out, **{
        "name": "grpo4", "train.total_updates": 1, "ppo.rollout_batch_size": 4, "ppo.ppo_epochs": 1}))
    return out / "grpo4"


def _side(report: dict, side: str) -> dict:
    """One side of compare.json in eval.json's terms."""
    rows = report["rows"]
    return {"responses": [r[f"{side}_response"] for r in rows], "scores": [r[f"{side}_reward"] for r in rows],
            "score": report[side]["reward"]["mean"], "eos_rate": report[side]["eos_rate"],
            "response_length": report[side]["response_length"], "kl": report[side]["kl"]}


def _held_out(evaluation: dict) -> dict:
    return {"responses": [s["response"] for s in evaluation["samples"]], "scores": [s["score"] for s in evaluation["samples"]],
            **{key: evaluation[key] for key in ("score", "eos_rate", "response_length", "kl")}}


def test_compare_rows_are_the_runs_before_and_after_numbers(run: Path, tmp_path: Path):
    out = tmp_path / "compare"
    _ok("compare", "base", "aligned", "--run", run, "--prompts", EVAL_PROMPTS, "--out", out)
    report = json.loads((out / "compare.json").read_text())
    evaluation = json.loads((run / "eval.json").read_text())
    assert [r["prompt"] for r in report["rows"]] == [s["prompt"] for s in evaluation["before"]["samples"]]
    assert report["a"]["seed"] == 0 and report["a"]["num_prompts"] == 16
    # every sampled token equal, hence every number: exact, not approximate
    assert _side(report, "a") == {**_held_out(evaluation["before"]), "kl": 0.0}
    assert _side(report, "b") == _held_out(evaluation["after"])


def test_eval_of_base_is_the_runs_before_numbers(run: Path, tmp_path: Path):
    summary_path = tmp_path / "eval.json"
    _ok("eval", "base", "--run", run, "--prompts", EVAL_PROMPTS, "--out", summary_path)
    summary = json.loads(summary_path.read_text())
    before = json.loads((run / "eval_before.json").read_text())
    assert (summary["reward"]["mean"], summary["eos_rate"], summary["response_length"]) == (
        before["score"], before["eos_rate"], before["response_length"])
