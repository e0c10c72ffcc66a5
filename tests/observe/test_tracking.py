"""TensorBoard event files (built-in writer) and accelerate trackers get the metrics.jsonl names."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from ppo_cli.errors import UsageError
from ppo_cli.recipe import LoggingConfig
from ppo_cli.tracking import Trackers, check_trackers, crc32c, masked_crc32c, scalar_metrics

# --- a minimal reader, independent of the writer's helpers except the checksum ---------------------


def read_records(path: Path) -> list[bytes]:
    data, records, at = path.read_bytes(), [], 0
    while at < len(data):
        header = data[at : at + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[at + 8 : at + 12])[0] == masked_crc32c(header), "length checksum"
        body = data[at + 12 : at + 12 + length]
        assert struct.unpack("<I", data[at + 12 + length : at + 16 + length])[0] == masked_crc32c(body), "data checksum"
        records.append(body)
        at += 16 + length
    return records


def parse_fields(data: bytes) -> list[tuple[int, object]]:
    """Protocol-buffer wire format -> [(field number, int | bytes | raw fixed bytes)]."""
    fields, at = [], 0

    def varint():
        nonlocal at
        shift = value = 0
        while True:
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return value

    while at < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            fields.append((number, varint()))
        elif wire == 1:
            fields.append((number, data[at : at + 8]))
            at += 8
        elif wire == 5:
            fields.append((number, data[at : at + 4]))
            at += 4
        elif wire == 2:
            length = varint()
            fields.append((number, data[at : at + length]))
            at += length
        else:
            raise AssertionError(f"unexpected wire type {wire}")
    return fields


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from every event file in ``log_dir``."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for record in read_records(path):
            event = dict(parse_fields(record))
            for number, value in parse_fields(event.get(5, b"")):
                assert number == 1
                summary_value = dict(parse_fields(value))
                tag = summary_value[1].decode()
                scalars.setdefault(tag, []).append((event[2], struct.unpack("<f", summary_value[2])[0]))
    return scalars


def test_crc32c_matches_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C (Castagnoli) check value


def test_event_file_holds_every_metric_under_its_metrics_jsonl_name(tmp_path):
    trackers = Trackers(LoggingConfig(tensorboard=True), tmp_path, "run")
    for step in (1, 2, 3):
        trackers.log({"step": step, "objective/kl": 0.5 * step, "eos_rate": 1.0, "health/warnings": ["eos_stuck"]}, step)
    trackers.close()
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    first = dict(parse_fields(read_records(files[0])[0]))
    assert first[3] == b"brain.Event:2"  # the file-version record TensorBoard expects first
    scalars = read_scalars(tmp_path / "tensorboard")
    assert scalars == {"objective/kl": [(1, 0.5), (2, 1.0), (3, 1.5)], "eos_rate": [(1, 1.0), (2, 1.0), (3, 1.0)]}


def test_tensorboard_itself_reads_the_event_file(tmp_path):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    trackers = Trackers(LoggingConfig(tensorboard=True), tmp_path, "run")
    trackers.log({"step": 4, "policy/clipfrac_avg": 0.25}, 4)
    trackers.close()
    events = accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == ["policy/clipfrac_avg"]
    assert [(e.step, e.value) for e in events.Scalars("policy/clipfrac_avg")] == [(4, 0.25)]


def _log_then_resume(tmp_path: Path) -> None:
    """Steps 1-5 logged, the run resumed from its checkpoint at step 3 and logged 4-6 again."""
    first = Trackers(LoggingConfig(tensorboard=True), tmp_path, "run")
    for step in range(1, 6):
        first.log({"loss/value_avg": float(step)}, step)
    first.close()
    second = Trackers(LoggingConfig(tensorboard=True), tmp_path, "run", resumed_at=3)
    for step in range(4, 7):
        second.log({"loss/value_avg": 10.0 * step}, step)
    second.close()


def test_a_resumed_run_starts_its_event_file_with_a_session_start(tmp_path, monkeypatch):
    names = iter(["100", "200"])
    monkeypatch.setattr("ppo_cli.tracking.time.time", lambda: float(next(names, "300")))
    _log_then_resume(tmp_path)
    first, second = sorted((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    start = dict(parse_fields(read_records(second)[1]))
    assert start[2] == 4 and dict(parse_fields(start[7])) == {1: 1}  # SessionLog{status: START} at step 4


def test_tensorboard_drops_the_points_logged_after_the_checkpoint(tmp_path, monkeypatch):
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    clock = iter(range(100, 200))
    monkeypatch.setattr("ppo_cli.tracking.time.time", lambda: float(next(clock)))
    _log_then_resume(tmp_path)
    events = accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss/value_avg")] == [(1, 1), (2, 2), (3, 3), (4, 40), (5, 50), (6, 60)]


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
