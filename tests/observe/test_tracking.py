"""TensorBoard event files (accelerate's TensorBoardTracker) and accelerate's other trackers get the
metrics.jsonl names; a resumed run's event files drop the points logged after its checkpoint."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ppo_cli.errors import EXIT_USAGE, UsageError
from ppo_cli.recipe import LoggingConfig
from ppo_cli.tracking import TENSORBOARD_HINT, Trackers, check_trackers, scalar_metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_process_state_left_behind():
    """accelerate's tracker methods make the process-wide PartialState on first use; a later test that
    builds an Accelerator with its own settings must find none."""
    from accelerate.state import PartialState

    made_here = not PartialState._shared_state
    yield
    if made_here:
        PartialState._reset_state()


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard shows them: every event file in ``log_dir``, in file-name
    order, with the points that a later file's SessionLog START purges left out."""
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.SCALARS: 0})  # 0: keep all
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_event_file_holds_every_metric_under_its_metrics_jsonl_name(tmp_path):
    trackers = Trackers(LoggingConfig(tensorboard=True), tmp_path, "run")
    for step in (1, 2, 3):
        trackers.log({"step": step, "objective/kl": 0.5 * step, "eos_rate": 1.0, "health/warnings": ["eos_stuck"]}, step)
    trackers.close()
    assert trackers.tensorboard_dir == tmp_path / "tensorboard"
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    # The step is the x axis, the list of warnings no scalar: neither is a tag.
    assert read_scalars(tmp_path / "tensorboard") == {
        "objective/kl": [(1, 0.5), (2, 1.0), (3, 1.5)], "eos_rate": [(1, 1.0), (2, 1.0), (3, 1.0)]}


def test_each_update_is_on_disk_before_the_next(tmp_path):
    """A run killed mid-way keeps what it logged: every log call reaches the file (flushed)."""
    trackers = Trackers(LoggingConfig(tensorboard=True), tmp_path, "run")
    trackers.log({"policy/clipfrac_avg": 0.25}, 4)
    assert read_scalars(tmp_path / "tensorboard") == {"policy/clipfrac_avg": [(4, 0.25)]}
    trackers.close()


def _log_then_resume(tmp_path: Path, monkeypatch) -> None:
    """Steps 1-4 logged, the run resumed from its checkpoint at step 2 and logged 3-5 again."""
    # Event files are named after the second they are opened in, and TensorBoard reads them in name
    # order: the resumed run's file opens a second later, as it would after loading the models.
    now = [1_700_000_000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    first = Trackers(LoggingConfig(tensorboard=True), tmp_path, "run")
    for step in range(1, 5):
        first.log({"loss/value_avg": float(step)}, step)
    first.close()
    now[0] += 1
    second = Trackers(LoggingConfig(tensorboard=True), tmp_path, "run", resumed_at=2)
    for step in range(3, 6):
        second.log({"loss/value_avg": 10.0 * step}, step)
    second.close()


def test_tensorboard_drops_the_points_logged_after_the_checkpoint(tmp_path, monkeypatch):
    _log_then_resume(tmp_path, monkeypatch)
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one per start
    # Steps 3 and 4 of the first run (3.0, 4.0) are gone: each step once, the resumed run's values.
    assert read_scalars(tmp_path / "tensorboard") == {"loss/value_avg": [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0), (5, 50.0)]}


def test_a_resumed_event_file_opens_with_a_session_start_at_the_first_new_step(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog

    _log_then_resume(tmp_path, monkeypatch)
    first, second = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    starts = [(e.step, e.session_log.status) for e in EventFileLoader(str(second)).Load() if e.HasField("session_log")]
    assert starts == [(3, SessionLog.START)]
    assert not any(e.HasField("session_log") for e in EventFileLoader(str(first)).Load())  # a fresh run purges nothing


def test_tensorboard_without_its_package_fails_before_training(monkeypatch):
    tracking = pytest.importorskip("accelerate.tracking")
    monkeypatch.setattr(tracking, "get_available_trackers", lambda: [])
    with pytest.raises(UsageError) as err:
        check_trackers(LoggingConfig(tensorboard=True))
    assert err.value.message == "logging.tensorboard: TensorBoard event files need the tensorboard package, which is not installed"
    assert err.value.hint == "pip install 'ppo_cli[tensorboard]'   (or: pip install tensorboard)" == TENSORBOARD_HINT


def test_ppo_train_without_tensorboard_is_one_line_and_a_usage_exit(monkeypatch, tmp_path):
    """Through the CLI: the error and its hint, exit code 2, no traceback, before any model loads."""
    from typer.testing import CliRunner

    from ppo_cli.cli import app

    tracking = pytest.importorskip("accelerate.tracking")
    monkeypatch.setattr(tracking, "get_available_trackers", lambda: [])
    monkeypatch.setattr("ppo_cli.commands.validate.check_recipe_files", lambda recipe, **kwargs: ([], []))  # no files
    recipe = ROOT / "tests" / "fixtures" / "recipes" / "minimal.yaml"
    result = CliRunner().invoke(app, ["train", str(recipe), "--set", "logging.tensorboard=true", "--set", f"output_dir={tmp_path}"])
    assert result.exit_code == EXIT_USAGE == 2
    assert result.stderr.splitlines() == [
        "error: logging.tensorboard: TensorBoard event files need the tensorboard package, which is not installed",
        f"hint: {TENSORBOARD_HINT}"]
    assert "Traceback" not in result.output and list(tmp_path.iterdir()) == []


def test_nothing_is_written_when_nothing_is_asked_for(tmp_path):
    trackers = Trackers(LoggingConfig(), tmp_path, "run")
    trackers.log({"step": 1, "eos_rate": 1.0}, 1)
    trackers.close()
    assert list(tmp_path.iterdir()) == [] and trackers.tensorboard_dir is None


def test_scalar_metrics_keeps_finite_numbers_only():
    metrics = {"step": 3, "a": 1, "b": 2.5, "nan": float("nan"), "inf": float("inf"), "list": ["x"], "flag": True, "s": "x"}
    assert scalar_metrics(metrics) == {"a": 1.0, "b": 2.5}


class FakeTracker:
    """Stands in for an accelerate GeneralTracker (e.g. wandb) to record what it is given."""

    requires_logging_directory = False
    made: list["FakeTracker"] = []

    def __init__(self, run_name, **kwargs):  # accelerate's name for what is the project (wandb.init(project=...))
        self.project, self.kwargs, self.calls = run_name, kwargs, []
        FakeTracker.made.append(self)

    def start(self):
        self.calls.append(("start",))

    def store_init_configuration(self, values):
        self.calls.append(("config", values))

    def log(self, values, step=None):
        self.calls.append(("log", values, step))

    def finish(self):
        self.calls.append(("finish",))


def test_accelerate_trackers_get_the_config_and_the_metrics(tmp_path, monkeypatch):
    tracking = pytest.importorskip("accelerate.tracking")
    monkeypatch.setitem(tracking.LOGGER_TYPE_TO_CLASS, "wandb", FakeTracker)
    FakeTracker.made.clear()
    trackers = Trackers(LoggingConfig(trackers=["wandb"]), tmp_path, "my-run", {"ppo": {"kl_coef": 0.05}, "tags": [1, 2]})
    trackers.log({"step": 7, "objective/kl": 2.0, "health/warnings": []}, 7)
    trackers.close()
    (tracker,) = FakeTracker.made
    assert (tracker.project, tracker.kwargs) == ("ppo_cli", {"name": "my-run"})  # one project, a run per recipe
    assert tracker.calls == [("start",), ("config", {"ppo.kl_coef": 0.05, "tags": "[1, 2]"}),
                             ("log", {"objective/kl": 2.0}, 7), ("finish",)]


def test_a_tracker_without_its_package_fails_before_training(monkeypatch):
    tracking = pytest.importorskip("accelerate.tracking")
    monkeypatch.setattr(tracking, "get_available_trackers", lambda: [])
    with pytest.raises(UsageError, match="'mlflow' needs the mlflow package") as err:
        check_trackers(LoggingConfig(trackers=["mlflow"]))
    assert err.value.hint.startswith("pip install mlflow")
    check_trackers(LoggingConfig())  # nothing asked for: nothing checked


def test_trackers_get_the_recipes_project_and_init_kwargs(tmp_path, monkeypatch):
    tracking = pytest.importorskip("accelerate.tracking")
    monkeypatch.setitem(tracking.LOGGER_TYPE_TO_CLASS, "wandb", FakeTracker)
    FakeTracker.made.clear()
    config = LoggingConfig(trackers=["wandb"], project="sentiment",
                           init_kwargs={"wandb": {"entity": "my-team", "tags": ["ppo"], "name": "custom"}})
    Trackers(config, tmp_path, "my-run").close()
    (tracker,) = FakeTracker.made
    assert tracker.project == "sentiment"
    assert tracker.kwargs == {"entity": "my-team", "tags": ["ppo"], "name": "custom"}  # the user's name wins


def test_init_kwargs_for_a_tracker_not_in_use_is_a_recipe_error():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="init_kwargs for mlflow, which is not in logging.trackers"):
        LoggingConfig(trackers=["wandb"], init_kwargs={"mlflow": {"tags": {"a": "b"}}})
