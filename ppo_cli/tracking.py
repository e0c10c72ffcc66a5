"""Metrics beyond metrics.jsonl: TensorBoard event files and accelerate's experiment trackers.

``logging.tensorboard: true`` writes RUN_DIR/tensorboard/events.out.tfevents.* with a small built-in
writer, so TensorBoard needs no extra package in the training environment (``pip install tensorboard``
only where you run ``tensorboard --logdir runs``). The format is TFRecord framing around
``tensorflow.Event`` protocol buffers with one scalar ``Summary.Value`` per metric:

    record = uint64 length | uint32 masked_crc32c(length) | data | uint32 masked_crc32c(data)
    Event  = 1: wall_time (double) | 2: step (int64) | 3: file_version (string) | 5: summary
             | 7: session_log (SessionLog: 1: status, START = 1)
    Summary.Value = 1: tag (string) | 2: simple_value (float)

A resumed run appends a new event file that opens with a SessionLog START at the first new step:
TensorBoard then drops the older files' points from that step on (logged after the checkpoint, before
the interruption), as metrics.jsonl drops those lines.

``logging.trackers: [wandb, mlflow, ...]`` goes through accelerate's tracker classes (each needs its
own package; ``check_trackers`` says which one is missing before any model loads). Every tracker gets
the metrics with the same names as metrics.jsonl; values that are not finite numbers are left out.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from pathlib import Path
from typing import Mapping

from ppo_cli.errors import UsageError
from ppo_cli.metric_names import STEP
from ppo_cli.recipe import LoggingConfig

TENSORBOARD_DIR = "tensorboard"
TRACKERS_DIR = "trackers"

# --- TensorBoard event files ----------------------------------------------------------------------


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli polynomial, reflected
        table.append(crc)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: the CRC rotated right by 15 bits plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    value &= 0xFFFFFFFFFFFFFFFF  # int64 as protobuf writes it
    while True:
        bits, value = value & 0x7F, value >> 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def encode_event(wall_time: float, step: int | None = None, file_version: str | None = None,
                 scalars: Mapping[str, float] | None = None, session_start: bool = False) -> bytes:
    """One serialized ``tensorflow.Event``."""
    data = _varint(1 << 3 | 1) + struct.pack("<d", wall_time)
    if step is not None:
        data += _varint(2 << 3 | 0) + _varint(step)
    if file_version is not None:
        data += _field_bytes(3, file_version.encode())
    if scalars:
        values = b"".join(
            _field_bytes(1, _field_bytes(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value))
            for tag, value in scalars.items()
        )
        data += _field_bytes(5, values)
    if session_start:
        data += _field_bytes(7, _varint(1 << 3 | 0) + _varint(1))
    return data


def frame_record(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


class EventFileWriter:
    """Appends scalar events to a new events.out.tfevents.* file in ``log_dir``; flushed every write."""

    def __init__(self, log_dir: Path, resumed_at: int = 0):
        log_dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.0"
        self.path = log_dir / name
        self._file = open(self.path, "ab")
        self._write(encode_event(time.time(), file_version="brain.Event:2"))
        if resumed_at:
            self._write(encode_event(time.time(), step=resumed_at + 1, session_start=True))

    def _write(self, data: bytes) -> None:
        self._file.write(frame_record(data))
        self._file.flush()

    def add_scalars(self, scalars: Mapping[str, float], step: int) -> None:
        if scalars:
            self._write(encode_event(time.time(), step=step, scalars=scalars))

    def close(self) -> None:
        self._file.close()


# --- accelerate's trackers ------------------------------------------------------------------------


def check_trackers(config: LoggingConfig) -> None:
    """Fail before any model loads when a tracker the recipe asks for cannot run here."""
    if not config.trackers:
        return
    from accelerate import tracking

    available = {str(name) for name in tracking.get_available_trackers()}
    for name in config.trackers:
        if name not in tracking.LOGGER_TYPE_TO_CLASS:
            raise UsageError(f"logging.trackers: this accelerate version has no '{name}' tracker",
                             hint="upgrade accelerate or remove it from logging.trackers")
        if name not in available:
            raise UsageError(f"logging.trackers: '{name}' needs the {name} package, which is not installed",
                             hint=f"pip install {name.replace('_', '-')}   (or remove it from logging.trackers)")


def _flat_config(values: Mapping, prefix: str = "") -> dict:
    """The recipe as tracker hyperparameters: dotted keys, lists as text."""
    flat = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flat_config(value, name + "."))
        else:
            flat[name] = value if isinstance(value, (bool, int, float, str)) or value is None else str(value)
    return flat


def scalar_metrics(metrics: Mapping[str, object]) -> dict[str, float]:
    """The finite numbers of a metrics line; the step is the x axis, not a metric, and lists (such as
    health/warnings) and NaN are left out."""
    return {
        name: float(value) for name, value in metrics.items()
        if name != STEP and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    }


# How each tracker names a run inside its project (the others name runs themselves).
RUN_NAME_ARGUMENT = {"wandb": "name", "mlflow": "run_name", "trackio": "name"}


def _run_name_kwarg(tracker: str, run_name: str) -> dict[str, str]:
    argument = RUN_NAME_ARGUMENT.get(tracker)
    return {argument: run_name} if argument else {}


class Trackers:
    """Everything that receives the metrics besides metrics.jsonl; a no-op when nothing is asked for."""

    def __init__(self, config: LoggingConfig, run_dir: Path, run_name: str, recipe_values: Mapping | None = None,
                 resumed_at: int = 0):
        self.tensorboard = EventFileWriter(run_dir / TENSORBOARD_DIR, resumed_at) if config.tensorboard else None
        self.trackers = []
        if config.trackers:
            from accelerate import tracking

            for name in config.trackers:
                cls = tracking.LOGGER_TYPE_TO_CLASS[name]
                # As accelerate's init_trackers: the project first, then the tracker's own init kwargs.
                kwargs = {**_run_name_kwarg(name, run_name), **config.init_kwargs.get(name, {})}
                if cls.requires_logging_directory:
                    kwargs.setdefault("logging_dir", run_dir / TRACKERS_DIR)
                tracker = cls(config.project, **kwargs)
                tracker.start()
                tracker.store_init_configuration(_flat_config(recipe_values or {}))
                self.trackers.append(tracker)

    @property
    def tensorboard_dir(self) -> Path | None:
        return self.tensorboard.path.parent if self.tensorboard is not None else None

    def log(self, metrics: Mapping[str, object], step: int) -> None:
        scalars = scalar_metrics(metrics)
        if self.tensorboard is not None:
            self.tensorboard.add_scalars(scalars, step)
        for tracker in self.trackers:
            tracker.log(scalars, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        for tracker in self.trackers:
            tracker.finish()
