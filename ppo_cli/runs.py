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

import contextlib
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ppo_cli.errors import UsageError

RUN_FILES = ("recipe.yaml", "metrics.jsonl", "samples.jsonl", "eval.json", "eval_before.json", "summary.json")
RUN_DIRS = ("checkpoints", "final", "plots", "tensorboard", "trackers")


def _umask() -> int:
    """The process's umask, read without changing it where Linux allows (a swap would let a file
    another thread creates meanwhile come out world-writable)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)  # private, should anything be created in between
    os.umask(mask)
    return mask


def default_mode(directory: bool = False) -> int:
    """The mode open() or mkdir() would give a new file or directory under the current umask.
    mkstemp and mkdtemp create theirs private (0600, 0700), which would hide runs from colleagues."""
    return (0o777 if directory else 0o666) & ~_umask()


def apply_default_modes(root: Path) -> None:
    """Give ``root`` and everything under it the umask's default modes (our outputs are never executable)."""
    file_mode, dir_mode = default_mode(), default_mode(directory=True)
    os.chmod(root, dir_mode if root.is_dir() else file_mode)
    if root.is_dir():
        for path in root.rglob("*"):
            if not path.is_symlink():
                os.chmod(path, dir_mode if path.is_dir() else file_mode)


def temp_file_beside(path: Path) -> tuple[int, str]:
    """A temporary file beside ``path`` with the mode a plain open() would give it."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.chmod(tmp, default_mode())  # os.fchmod is not on Windows before Python 3.13
    return fd, tmp


def atomic_write_text(path: Path, text: str) -> None:
    """Write to a temporary file in the same directory, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file_beside(path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_directory(new: Path, target: Path) -> None:
    """Move directory ``new`` to ``target``, replacing any directory there, so that ``target`` is never
    missing: on Linux the two are exchanged in one step (renameat2 RENAME_EXCHANGE) and the old one is
    removed after; elsewhere the old one is renamed aside before the new one goes in, and
    ``restore_replaced_directory`` puts it back if a crash fell between the two renames.
    """
    if not target.exists():
        new.rename(target)
        return
    if _exchange(new, target):
        shutil.rmtree(new)  # now the old directory
        return
    aside = _aside_name(target)
    shutil.rmtree(aside, ignore_errors=True)
    target.rename(aside)
    new.rename(target)
    shutil.rmtree(aside)


def restore_replaced_directory(target: Path) -> None:
    """Undo a replacement cut short between its renames: the old directory goes back to ``target``."""
    aside = _aside_name(target)
    if aside.is_dir() and not target.exists():
        aside.rename(target)


def _aside_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.replaced")


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directory entries with Linux's renameat2; False where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # musl, or glibc before 2.28
        return False
    at_fdcwd, rename_exchange = -100, 2
    done = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
    return done  # EINVAL on file systems without exchange: the caller falls back to rename-aside


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

    def holds_run_outputs(self) -> bool:
        """A run's recipe.yaml beside what training writes: stricter than is_run, so that a project
        folder holding a recipe.yaml of its own is not taken for a run."""
        return self.recipe.is_file() and (self.metrics.is_file() or self.checkpoints.is_dir() or self.final.is_dir())


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists: where a new file or directory would be made."""
    return next((p for p in (path, *path.parents) if p.exists()), Path("."))


def check_run_dir(run: RunDir, overwrite: bool) -> None:
    """Refuse a path that is a file, a run nested inside another run's directory (output_dir set to a
    run's own directory), or an existing run unless it may be overwritten. Reads only."""
    for parent in [run.path, *run.path.parents]:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"output path exists and is not a directory: {parent}", hint="set output_dir to a directory")
    for parent in run.path.parents:
        if RunDir(parent).holds_run_outputs():
            where = "is" if parent == run.path.parent else f"is inside {parent},"
            raise UsageError(
                f"output_dir {run.path.parent} {where} an existing run's directory, so this run would be nested "
                f"in it at {run.path}",
                hint=f"set output_dir to the directory that holds runs (--set output_dir={parent.parent}), "
                     "or pass --resume to continue that run",
            )
    existing = nearest_existing(run.path)
    if not os.access(existing, os.W_OK):
        raise UsageError(f"cannot write to the output directory {run.path}: {existing} is not writable",
                         hint="set output_dir to a directory you can write to")
    if run.is_run() and not overwrite:
        raise UsageError(
            f"run directory already holds a run: {run.path}",
            hint="pass --overwrite to replace it, --resume to continue it, or change `name` (--set name=my-run-2)",
        )


@dataclass(frozen=True)
class RunFootprint:
    """What was there before a new run wrote anything: so that a run failing before its first
    update can take back exactly what it made, and nothing of the user's."""

    kept: frozenset[str]  # run file and directory names already present (not the run's to delete)
    created_root: Path | None  # the topmost directory prepare_run_dir created, if any


def prepare_run_dir(output_dir: str, name: str, overwrite: bool) -> tuple[RunDir, RunFootprint]:
    """Create runs/<name>; an existing run is only replaced with overwrite (and only its own files)."""
    run = RunDir(Path(output_dir) / name)
    check_run_dir(run, overwrite)
    if run.is_run():
        for file_name in RUN_FILES:
            (run.path / file_name).unlink(missing_ok=True)
        for dir_name in RUN_DIRS:
            shutil.rmtree(run.path / dir_name, ignore_errors=True)
    missing = [p for p in (run.path, *run.path.parents) if not p.exists()]
    try:
        run.path.mkdir(parents=True, exist_ok=True)
        probe = run.path / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise UsageError(f"cannot write to the output directory {run.path}: {err.strerror}") from None
    kept = frozenset(n for n in RUN_FILES + RUN_DIRS if (run.path / n).exists())
    return run, RunFootprint(kept, missing[-1] if missing else None)


def discard_unstarted_run(run: RunDir, footprint: RunFootprint) -> None:
    """Take back what a run made before its first update finished (recipe.yaml, an empty
    metrics.jsonl, the directories it created), never what was there before. Best effort: a
    failure here must not hide the error that stopped the run."""
    for name in RUN_FILES + RUN_DIRS:
        path = run.path / name
        if name in footprint.kept or not path.exists():
            continue
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    with contextlib.suppress(OSError):
        if footprint.created_root is not None:
            for directory in (run.path, *run.path.parents):
                directory.rmdir()  # stops (OSError) at the first one holding anything else
                if directory == footprint.created_root:
                    break


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# --- output files written whole or not at all ---


def check_output_path(path: Path, option: str = "--out") -> Path:
    """Fail before any model loads when ``path`` cannot be an output file (a directory, an unwritable folder)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option} {path} is a directory", hint=f"give a file name, e.g. {option} {path / 'out.jsonl'}")
    parent = path.parent if str(path.parent) else Path(".")
    existing = nearest_existing(parent)
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise UsageError(f"{option} {path}: cannot write to {existing}", hint="check the path and its permissions")
    return path


class AtomicJsonlWriter:
    """JSONL rows go to a temporary file beside ``path``, renamed onto it only when the block ends cleanly.

    On any exception (or Ctrl-C) the temporary file is deleted and an existing ``path`` is left as it
    was, so a reader never finds half an output file.

        with AtomicJsonlWriter(out) as writer:
            writer.write({"prompt": ..., "response": ...})
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._tmp: Path | None = None
        self._file = None
        self.rows = 0

    def __enter__(self) -> "AtomicJsonlWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = temp_file_beside(self.path)
        self._tmp, self._file = Path(tmp), os.fdopen(fd, "w", encoding="utf-8")
        return self

    def write(self, row: dict) -> None:
        self._file.write(json.dumps({k: _json_safe(v) for k, v in row.items()}, ensure_ascii=False) + "\n")
        self.rows += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._file.flush()
                os.fsync(self._file.fileno())
            self._file.close()
            if exc_type is None:
                os.replace(self._tmp, self.path)
        finally:
            if self._tmp is not None and self._tmp.exists():
                self._tmp.unlink()


def write_jsonl_atomic(path: Path, rows) -> int:
    """Write ``rows`` (dicts) as JSONL in one atomic step; return how many were written."""
    with AtomicJsonlWriter(path) as writer:
        for row in rows:
            writer.write(row)
    return writer.rows
