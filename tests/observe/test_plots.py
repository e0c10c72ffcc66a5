"""Learning-curve plots from a synthetic metrics.jsonl, and `ppo plot`'s one-line errors."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppo_cli.cli import app
from ppo_cli.errors import PpoError, UsageError
from ppo_cli.plots import PLOT_NAME, first_warnings, plot_run, read_metrics, smooth, smoothing_weight

runner = CliRunner()


def write_metrics(run: Path, updates: int = 60) -> Path:
    """A run directory whose metrics.jsonl looks like a real one: NaN as null, an infinity as "inf",
    health warnings, and a last line cut short by a crash."""
    run.mkdir(parents=True, exist_ok=True)
    (run / "recipe.yaml").write_text("name: synthetic\nmonitor:\n  clipfrac_high: 0.4\n")
    lines = []
    for step in range(1, updates + 1):
        row = {
            "step": step,
            "objective/scores": -10 + 20 * (1 - math.exp(-step / 15)) + math.sin(step),
            "objective/rlhf_reward": -10.5 + 20 * (1 - math.exp(-step / 15)),
            "loss/policy_avg": -0.02 + 0.01 * math.sin(step / 3),
            "loss/value_avg": 10 * math.exp(-step / 20) + 0.5,
            "objective/kl": 8 * (1 - math.exp(-step / 10)),
            "eos_rate": min(1.0, step / 30),
            "policy/clipfrac_avg": 0.2 + 0.05 * math.sin(step),
            "response_length": 20 - 15 * (1 - math.exp(-step / 20)),
            "health/warnings": ["approx_kl_high"] if step >= 10 else [],
        }
        if step == 7:
            row["loss/value_avg"] = None  # NaN, as runs.JsonlWriter writes it
        if step == 8:
            row["objective/kl"] = "inf"
        lines.append(json.dumps(row))
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 61, "objective/sco')
    return run


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


@pytest.mark.slow
def test_plot_run_writes_a_readable_png(tmp_path):
    pytest.importorskip("matplotlib")
    run = write_metrics(tmp_path / "run")
    out = plot_run(run)
    assert out == run / "plots" / PLOT_NAME
    width, height = png_size(out)
    assert width >= 1000 and height >= 900
    assert out.stat().st_size > 50_000  # six panels of lines, not an empty canvas
    assert [p.name for p in out.parent.iterdir()] == [PLOT_NAME]  # no temporary file left behind


@pytest.mark.slow
def test_plot_run_replaces_an_existing_plot(tmp_path):
    pytest.importorskip("matplotlib")
    run = write_metrics(tmp_path / "run", updates=5)
    first = plot_run(run).read_bytes()
    write_metrics(run, updates=40)
    assert plot_run(run).read_bytes() != first


@pytest.mark.slow
def test_plot_handles_metrics_missing_from_the_log(tmp_path):
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "objective/scores": 1.0}\n')
    assert png_size(plot_run(run))[0] > 0


@pytest.mark.parametrize("setup, message", [
    (lambda run: None, "run directory not found"),
    (lambda run: run.mkdir(), "has no metrics.jsonl"),
    (lambda run: (run.mkdir(), (run / "metrics.jsonl").write_text("")), "has no updates yet"),
])
def test_plot_run_errors_are_one_line_usage_errors(tmp_path, setup, message):
    run = tmp_path / "run"
    setup(run)
    with pytest.raises(UsageError, match=message) as err:
        plot_run(run)
    assert "\n" not in err.value.message and err.value.hint


def test_missing_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(PpoError, match="matplotlib") as err:
        plot_run(write_metrics(tmp_path / "run"))
    assert "pip install" in err.value.hint


@pytest.mark.slow
def test_ppo_plot_command(tmp_path):
    pytest.importorskip("matplotlib")
    run = write_metrics(tmp_path / "run")
    result = runner.invoke(app, ["plot", str(run)])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"wrote {run / 'plots' / PLOT_NAME}"


def test_ppo_plot_command_error_is_one_line(tmp_path):
    result = runner.invoke(app, ["plot", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "error: run directory not found" in result.output and "Traceback" not in result.output


def test_read_metrics_skips_a_cut_line(tmp_path):
    rows = read_metrics(write_metrics(tmp_path / "run", updates=3) / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]


def test_first_warnings_gives_each_rule_its_first_update(tmp_path):
    rows = read_metrics(write_metrics(tmp_path / "run") / "metrics.jsonl")
    assert first_warnings(rows) == {"approx_kl_high": 10}


def test_smooth_keeps_a_constant_and_skips_non_finite_points():
    assert smooth([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # debiased: no pull towards 0
    assert smooth([1.0, math.nan, 3.0], 0.0) == [1.0, 1.0, 3.0]
    assert math.isnan(smooth([math.nan], 0.5)[0])


def test_smoothing_grows_with_the_run_length():
    assert smoothing_weight(5) == 0.0 and 0.5 < smoothing_weight(40) < smoothing_weight(1000) <= 0.98
