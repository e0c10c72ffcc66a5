"""A tiny run set up to go wrong (no KL penalty, 10x the demo's learning rate) through the real CLI:
the health warnings fire and are printed, logged and summarised; the plot and TensorBoard files exist."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ppo_cli.cli import app
from tests.conftest import ROOT, tiny_overrides
from tests.observe.test_tracking import read_scalars

pytestmark = pytest.mark.slow
runner = CliRunner()

PROMPTS = ["I think the book was", "The movie was", "Overall, the product is", "This phone is",
           "The food at this place", "My experience with the hotel", "The service was", "This album is"]
UPDATES = 10


@pytest.fixture(scope="module")
def wild_run(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("health")
    prompts = out / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    sets = tiny_overrides(tiny_models, out, **{
        "name": "wild", "data.prompts": prompts,
        # a KL penalty too small to hold the policy near the reference, and big steps (kl_coef 0 would
        # skip the reference forward and leave the KL unmeasured: docs/memory.md)
        "ppo.kl_coef": 1e-6, "optim.lr": 3e-2,
        "ppo.rollout_batch_size": 8, "ppo.mini_batch_size": 4, "ppo.micro_batch_size": 4,
        "generation.max_new_tokens": 12, "train.total_updates": UPDATES, "train.sample_every": 0,
        "monitor.window": 4, "logging.tensorboard": "true",
    })
    args = ["train", str(ROOT / "recipes" / "tiny_sentiment.yaml")]
    for item in sets:
        args += ["--set", item]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return out / "wild", result.output


def test_no_kl_penalty_and_a_high_lr_raise_the_expected_warnings(wild_run):
    run, output = wild_run
    summary = json.loads((run / "summary.json").read_text())
    raised = {w["rule"] for w in summary["warnings"]}
    # Steps this large move the policy far from the one that sampled the batch (approx-KL), and with
    # no KL penalty nothing keeps it near the reference (KL per token). What the collapsed policy does
    # next (stop ending with EOS, lose diversity or entropy) depends on the tiny models, so it is not asserted.
    assert {"approx_kl_high", "kl_high"} <= raised, summary["warnings"]
    kl_high = next(w for w in summary["warnings"] if w["rule"] == "kl_high")
    assert "nats per response token" in kl_high["message"]
    assert "warning update 4: approx-KL" in output  # printed when it starts, with cause and fix
    assert "likely cause:" in output and "fix: lower optim.lr" in output


def test_metrics_jsonl_records_the_active_warnings_of_each_update(wild_run):
    run, _ = wild_run
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, UPDATES + 1))
    assert all(isinstance(row["health/warnings"], list) for row in rows)
    assert rows[0]["health/warnings"] == []  # nothing can fire before a window of updates
    assert {"approx_kl_high", "kl_high"} <= {rule for row in rows for rule in row["health/warnings"]}
    summary = json.loads((run / "summary.json").read_text())
    assert {w["rule"] for w in summary["warnings"] if w["active_at_end"]} == set(rows[-1]["health/warnings"])
    assert {"samples/distinct_1", "samples/distinct_2", "val/ratio_first_minibatch"} <= set(rows[0])
    assert rows[0]["val/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-4)  # same log-probs before any step


def test_run_summary_panel_lists_warnings_and_files(wild_run):
    run, output = wild_run
    summary = json.loads((run / "summary.json").read_text())
    assert summary["files"]["learning curves"] == str(run / "plots" / "learning_curves.png")
    assert summary["files"]["tensorboard"] == str(run / "tensorboard")
    assert summary["episodes_per_s"] > 0
    for text in ("health warnings (", "approx_kl_high", "episodes/s", "peak memory", "learning curves"):
        assert text in output, text


def test_the_plot_is_written_at_the_end(wild_run):
    pytest.importorskip("matplotlib")
    run, _ = wild_run
    png = run / "plots" / "learning_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 50_000


def test_tensorboard_event_file_holds_the_metrics(wild_run):
    run, _ = wild_run
    scalars = read_scalars(run / "tensorboard")
    for tag in ("objective/kl", "objective/scores", "policy/clipfrac_avg", "loss/value_avg", "eos_rate"):
        assert [step for step, _ in scalars[tag]] == list(range(1, UPDATES + 1)), tag
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [v for _, v in scalars["objective/scores"]] == pytest.approx([m["objective/scores"] for m in metrics], rel=1e-6)
