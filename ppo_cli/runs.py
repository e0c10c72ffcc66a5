"""The run directory: its layout, its JSONL writers, and atomic file writes.

    runs/<name>/
      recipe.yaml      the resolved recipe (re-runnable)
      metrics.jsonl    one line per update
      samples.jsonl    periodic prompt / response / score samples
      eval.json        before/after evaluation on held-out prompts (when data.eval_prompts is set)
      checkpoints/     step-NNNNNN/ directories, each complete or absent
      final/           the trained policy (adapter or weights), value head, tokenizer [, merged/]
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ppo_cli.errors import UsageError

RUN_FILES = ("recipe.yaml", "metrics.jsonl", "samples.jsonl", "eval.json", "summary.json")
RUN_DIRS = ("checkpoints", "final", "plots")


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file in the same directory, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


class JsonlWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most the line in progress."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self._file.write(json.dumps({k: _json_safe(v) for k, v in row.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class RunDir:
    path: Path

    recipe = property(lambda self: self.path / "recipe.yaml")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    samples = property(lambda self: self.path / "samples.jsonl")
    eval = property(lambda self: self.path / "eval.json")
    summary = property(lambda self: self.path / "summary.json")
    checkpoints = property(lambda self: self.path / "checkpoints")
    final = property(lambda self: self.path / "final")
    plots = property(lambda self: self.path / "plots")

    def is_run(self) -> bool:
        return self.recipe.exists() or self.metrics.exists() or self.final.exists()


def prepare_run_dir(output_dir: str, name: str, overwrite: bool) -> RunDir:
    """Create runs/<name>; an existing run is only replaced with overwrite (and only its own files)."""
    run = RunDir(Path(output_dir) / name)
    if run.path.exists() and not run.path.is_dir():
        raise UsageError(f"output path exists and is not a directory: {run.path}")
    if run.is_run():
        if not overwrite:
            raise UsageError(
                f"run directory already holds a run: {run.path}",
                hint="pass --overwrite to replace it, or change `name` (e.g. --set name=my-run-2)",
            )
        for file_name in RUN_FILES:
            (run.path / file_name).unlink(missing_ok=True)
        for dir_name in RUN_DIRS:
            shutil.rmtree(run.path / dir_name, ignore_errors=True)
    try:
        run.path.mkdir(parents=True, exist_ok=True)
        probe = run.path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"cannot write to the output directory {run.path}: {err.strerror}") from None
    return run


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
