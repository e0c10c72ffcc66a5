"""RunObserver, what `ppo train` does with each update's metrics, without a model: warnings shown
and recorded, trackers fed on the metrics.jsonl schedule, a resumed run keeping its warnings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ppo_cli.observe import RunObserver
from ppo_cli.recipe_loading import load_recipe
from ppo_cli.runs import RunDir

FIXTURE = Path(__file__).parents[1] / "fixtures" / "recipes" / "minimal.yaml"


def make_run(tmp_path: Path, rows: int = 0, *sets: str) -> tuple:
    recipe = load_recipe(FIXTURE, [f"output_dir={tmp_path}", "monitor.window=3", *sets])
    run = RunDir(tmp_path / recipe.name)
    run.path.mkdir(parents=True)
    (run.recipe).write_text("name: minimal\n")
    lines = [json.dumps({"step": s, "eos_rate": 0.0, "objective/scores": -1.0}) for s in range(1, rows + 1)]
    run.metrics.write_text("".join(line + "\n" for line in lines))
    return recipe, run


class Shown(list):
    """A run's ``show`` callback that keeps what it was given: (what, data) pairs."""

    def __call__(self, what: str, data: dict) -> None:
        self.append((what, data))

    def of(self, what: str) -> list[dict]:
        return [data for kind, data in self if kind == what]


def test_new_warnings_are_shown_and_added_to_the_metrics_line(tmp_path):
    recipe, run = make_run(tmp_path)
    shown = Shown()
    observer = RunObserver(recipe, run, show=shown)
    lines = []
    for step in (1, 2, 3, 4):
        metrics = {"step": step, "eos_rate": 0.0}
        observer.observe(metrics, step)
        lines.append(metrics["health/warnings"])
    observer.close()
    assert lines == [[], [], ["eos_stuck"], ["eos_stuck"]]
    assert [(what, w["rule"], w["step"]) for what, w in shown] == [("warning", "eos_stuck", 3)]
    assert {"message", "cause", "fix", "value", "since"} <= set(shown[0][1])


def test_a_resumed_run_rebuilds_its_warnings_quietly(tmp_path):
    recipe, run = make_run(tmp_path, rows=6)
    shown = Shown()
    observer = RunObserver(recipe, run, resumed_at=6, show=shown)
    assert observer.monitor.active == ["eos_stuck"]  # from the metrics already logged
    metrics = {"step": 7, "eos_rate": 0.0}
    observer.observe(metrics, 7)
    observer.close()
    assert shown == [] and metrics["health/warnings"] == ["eos_stuck"]  # announced before the resume


@pytest.mark.slow
def test_finish_adds_throughput_warnings_and_existing_files(tmp_path):
    pytest.importorskip("matplotlib")
    recipe, run = make_run(tmp_path, 4, "logging.tensorboard=true")
    observer = RunObserver(recipe, run)
    for step in range(1, 5):
        metrics = {"step": step, "eos_rate": 0.0}
        observer.observe(metrics, step)
        observer.log(metrics, step)
    observer.close()
    extra = observer.finish({"episodes": 64, "seconds": 8.0})
    assert extra["episodes_per_s"] == 8.0
    assert [w["rule"] for w in extra["warnings"]] == ["eos_stuck"]
    files = extra["files"]
    assert files["learning curves"] == str(run.plots / "learning_curves.png")
    assert files["tensorboard"] == str(run.path / "tensorboard") and files["metrics"] == str(run.metrics)
    assert "final model" not in files and files["summary"] == str(run.summary)  # final/ was never written


def test_finish_without_matplotlib_notes_it_and_goes_on(tmp_path, monkeypatch):
    import sys

    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    shown = Shown()
    recipe, run = make_run(tmp_path, 2)
    extra = RunObserver(recipe, run, show=shown).finish({"episodes": 1, "seconds": 1.0})
    assert "learning curves" not in extra["files"]
    notes = [data["message"] for data in shown.of("note")]
    assert len(shown) == 1 and "matplotlib" in notes[0] and "pip install" in notes[0]
