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
import difflib
import json
import math
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from ppo_cli.errors import ModelReferenceError, UsageError

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


def nearest_existing(path: Path) -> Path:
    """``path`` or its closest ancestor that exists: where a new file or directory would be made."""
    return next((p for p in (path, *path.parents) if p.exists()), Path("."))


def check_run_dir(run: RunDir, overwrite: bool) -> None:
    """Refuse a path that is a file, or an existing run unless it may be overwritten. Reads only."""
    for parent in [run.path, *run.path.parents]:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"output path exists and is not a directory: {parent}", hint="set output_dir to a directory")
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


# --- model references: base / aligned / run dir / checkpoint / local model / hub id -> paths ---

def looks_like_local_path(ref: str) -> bool:
    """A name that can only be a local path, never a hub id (``org/name``): relative or absolute
    markers, a trailing or second slash, or a backslash (no hub id has one)."""
    return ref.startswith((".", "/", "~")) or ref.endswith("/") or ref.count("/") > 1 or "\\" in ref


def check_model_reference(path: str) -> None:
    """Fail early and clearly when a model is neither a local directory nor reachable on the hub."""
    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ModelReferenceError(f"model path is a file, not a model directory: {path}")
        if not (local / "config.json").exists() and not (local / "adapter_config.json").exists():
            raise ModelReferenceError(
                f"{path}: no config.json here, so it is not a saved model",
                hint="point at a directory written by save_pretrained (or a hub id)",
            )
        return
    if looks_like_local_path(path):
        raise ModelReferenceError(f"model directory not found: {path}", hint="check the path (relative to the current directory)")
    if hub_offline():
        if _in_hub_cache(path):
            return  # downloaded before: transformers loads it from the cache
        raise ModelReferenceError(
            f"model '{path}' is not a local directory and the hub is offline (HF_HUB_OFFLINE=1)",
            hint="download it first (`hf download`) or point at a local directory",
        )
    # Without this, a machine with no network spends a minute in the hub client's retries per file.
    unreachable = hub_unreachable()
    if unreachable and not _in_hub_cache(path):
        raise ModelReferenceError(
            f"model '{path}' is not a local directory, and the hub cannot be reached ({unreachable})",
            hint="check the spelling of a local path and the network, or download the model first (`hf download`)",
        )


def check_adapter_reference(path: str, key: str = "policy.adapter") -> None:
    """A peft adapter (``key`` in the recipe): a local directory with adapter_config.json, or a hub id."""
    local = Path(path).expanduser()
    if local.is_dir() and not (local / "adapter_config.json").exists():
        hint = "it holds a full model: set it as policy.path instead" if (local / "config.json").exists() else \
            "point at a directory written by a peft model's save_pretrained (or a hub id)"
        raise ModelReferenceError(f"{key} {path}: no adapter_config.json here, so it is not a peft adapter", hint=hint)
    try:
        check_model_reference(path)
    except ModelReferenceError as err:
        raise ModelReferenceError(f"{key}: {err.message}", hint=err.hint) from None


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (1, true, yes or on)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached (its host name does not resolve), or None. A proxy is trusted to
    resolve names itself."""
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    host = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as err:
        return f"{host} does not resolve: {err.strerror or err}"
    return None


def _in_hub_cache(repo_id: str) -> bool:
    """Downloaded before: transformers loads it from the cache without the network."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return any(isinstance(try_to_load_from_cache(repo_id, name), str) for name in ("config.json", "adapter_config.json"))
    except Exception:  # an invalid repo id, or no huggingface_hub: not cached
        return False



MODEL_ALIASES = ("base", "aligned")
MODEL_REFERENCE_HINT = (
    "a model is 'base' or 'aligned' (of --run DIR, default the latest run), a run or checkpoint directory, "
    "a local model directory, or a hub id"
)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model reference points. The weights are ``adapter_dir`` applied on ``base_path``,
    or ``full_model_dir``, or ``base_path`` itself; ``base_path`` is what the model was trained from."""

    reference: str  # as given on the command line: 'aligned', 'runs/x/final', 'gpt2'
    kind: str  # 'base' | 'aligned' | 'checkpoint' | 'model' | 'hub'
    base_path: str
    adapter_dir: Path | None = None
    full_model_dir: Path | None = None
    recipe_path: Path | None = None  # the resolved recipe of the run the model belongs to
    run_dir: Path | None = None
    # An adapter (the run's policy.adapter, e.g. from SFT) merged into ``base_path`` before anything
    # else: the run's starting model is base + this adapter. Never set with ``full_model_dir``,
    # whose weights already include it.
    base_adapter: str | None = None

    @property
    def weights_path(self) -> str:
        """The directory (or hub id) whose weights are loaded first."""
        return str(self.full_model_dir) if self.full_model_dir is not None else self.base_path

    @property
    def tokenizer_path(self) -> str:
        """The model's own tokenizer when saved beside it (final/, checkpoints), else the base's."""
        for directory in (self.full_model_dir, self.adapter_dir):
            if directory is not None and (directory / "tokenizer_config.json").exists():
                return str(directory)
        return self.base_path

    def describe(self) -> str:
        """One line for people: 'aligned = runs/x/final (LoRA adapter on models/tiny/policy)'."""
        base = self.base_path + (f" + adapter {self.base_adapter}" if self.base_adapter is not None else "")
        if self.adapter_dir is not None:
            where = f"{self.adapter_dir} (LoRA adapter on {base})"
        elif self.full_model_dir is not None:
            where = f"{self.full_model_dir} (fine-tuned from {self.base_path})"
        else:
            where = base + (" (hub)" if self.kind == "hub" else "")
        return where if self.reference == where else f"{self.reference} = {where}"


def _run_mtime(run: Path) -> float:
    return max(p.stat().st_mtime for p in (run, run / "recipe.yaml", run / "metrics.jsonl", run / "final") if p.exists())


def latest_run(output_root: str | Path = "runs") -> Path:
    """The most recently modified run directory under ``output_root``."""
    root = Path(output_root)
    runs = [p for p in root.iterdir() if p.is_dir() and RunDir(p).recipe.exists()] if root.is_dir() else []
    if not runs:
        raise ModelReferenceError(
            f"no run found under {root}/", hint="train one with `ppo train RECIPE`, or point at a run with --run DIR"
        )
    return max(runs, key=_run_mtime)


def open_run(run_dir: str | Path) -> Path:
    """Check that ``run_dir`` is a run directory (it has the run's recipe.yaml)."""
    run = Path(run_dir)
    if not run.exists():
        raise ModelReferenceError(f"run directory not found: {run}", hint="check --run (relative to the current directory)")
    if not RunDir(run).recipe.exists():
        raise ModelReferenceError(
            f"{run} is not a run directory (no recipe.yaml)", hint="--run takes a directory written by `ppo train`, e.g. runs/NAME"
        )
    return run


def run_policy_path(run: Path) -> str:
    """The model a run trained from: final/ppo_cli.json's policy_path, else policy.path in its recipe."""
    info = RunDir(run).final / "ppo_cli.json"
    if info.exists():
        try:
            return str(json.loads(info.read_text(encoding="utf-8"))["policy_path"])
        except (ValueError, KeyError, TypeError):
            pass  # fall back to the recipe
    try:
        return str(yaml.safe_load(RunDir(run).recipe.read_text(encoding="utf-8"))["policy"]["path"])
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        raise ModelReferenceError(f"{RunDir(run).recipe}: cannot read policy.path from the run's recipe") from None


def run_policy_adapter(run: Path) -> str | None:
    """The adapter merged into a run's policy at load (policy.adapter), or None: final/ppo_cli.json's
    policy_adapter when final/ exists, else the run's recipe."""
    info = RunDir(run).final / "ppo_cli.json"
    if info.exists():
        try:
            data = json.loads(info.read_text(encoding="utf-8"))
            if "policy_path" in data:  # a final/ saved before policy.adapter existed had none
                return data.get("policy_adapter")
        except (ValueError, TypeError):
            pass
    try:
        return yaml.safe_load(RunDir(run).recipe.read_text(encoding="utf-8"))["policy"].get("adapter")
    except (OSError, ValueError, KeyError, TypeError, AttributeError, yaml.YAMLError):
        return None


def _owning_run(directory: Path) -> Path | None:
    """The run a final/, final/merged/ or checkpoints/step-N/ directory belongs to."""
    if directory.name in ("", ".", ".."):  # keep paths as the user wrote them, unless they say nothing
        directory = directory.resolve()
    if directory.name == "final":
        candidate = directory.parent
    elif directory.parent.name == "checkpoints" or (directory.name == "merged" and directory.parent.name == "final"):
        candidate = directory.parent.parent
    else:
        return None
    return candidate if RunDir(candidate).recipe.exists() else None


def _resolve_alias(ref: str, run_dir: str | Path | None, output_root: str | Path) -> ResolvedModel:
    run = open_run(run_dir) if run_dir is not None else latest_run(output_root)
    if ref == "base":
        return ResolvedModel(ref, "base", run_policy_path(run), recipe_path=RunDir(run).recipe, run_dir=run,
                             base_adapter=run_policy_adapter(run))
    return _resolve_directory(ref, run, "aligned")


def _resolve_directory(ref: str, directory: Path, kind: str | None = None) -> ResolvedModel:
    if RunDir(directory).recipe.exists():  # a run directory stands for its final model
        final = RunDir(directory).final
        restore_replaced_directory(final)
        if not (final / "manifest.json").exists() and not (final / "adapter_config.json").exists():
            checkpoints = sorted(RunDir(directory).checkpoints.glob("step-*"))
            hint = f"use a checkpoint instead, e.g. {checkpoints[-1]}" if checkpoints else "the run may still be training or have stopped before saving"
            raise ModelReferenceError(f"run {directory} has no final/ model", hint=hint)
        return _resolve_directory(ref, final, kind or "aligned")
    run = _owning_run(directory)
    recipe_path = RunDir(run).recipe if run is not None else None
    if (directory / "adapter_config.json").exists():
        base = run_policy_path(run) if run is not None else _adapter_base(directory)
        base_adapter = run_policy_adapter(run) if run is not None else _final_info(directory).get("policy_adapter")
        kind = kind or ("checkpoint" if directory.parent.name == "checkpoints" else "aligned")
        return ResolvedModel(ref, kind, base, adapter_dir=directory, recipe_path=recipe_path, run_dir=run,
                             base_adapter=base_adapter)
    if (directory / "config.json").exists():
        if run is None:
            return ResolvedModel(ref, "model", str(directory))
        kind = kind or ("checkpoint" if directory.parent.name == "checkpoints" else "aligned")
        return ResolvedModel(ref, kind, run_policy_path(run), full_model_dir=directory, recipe_path=recipe_path, run_dir=run)
    raise ModelReferenceError(
        f"{ref}: not a model, run or checkpoint directory (no config.json or adapter_config.json)", hint=MODEL_REFERENCE_HINT
    )


def _final_info(directory: Path) -> dict:
    """ppo_cli.json of a final/ directory (empty when absent or unreadable): a final/ copied out of
    its run still says which adapter its base had merged in."""
    try:
        data = json.loads((directory / "ppo_cli.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _adapter_base(adapter_dir: Path) -> str:
    try:
        base = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))["base_model_name_or_path"]
    except (OSError, ValueError, KeyError, TypeError):
        base = None
    if not base:
        raise ModelReferenceError(f"{adapter_dir}: the adapter does not name its base model (base_model_name_or_path)")
    return str(base)


def resolve_model_reference(ref: str, run_dir: str | Path | None = None, *, output_root: str | Path = "runs") -> ResolvedModel:
    """Turn a MODEL argument into paths, without loading anything.

    ``base`` / ``aligned`` are the policy a run started from and the run's final/ policy, for the run
    at ``run_dir`` or else the most recently modified run under ``output_root``. A run directory means
    its final/ model; final/ and checkpoints/step-N/ hold a LoRA adapter (its base is the run's
    policy) or full weights; any other directory with a config.json is a plain local model; anything
    else that looks like ``org/name`` is a hub id.
    """
    if ref in MODEL_ALIASES:
        return _resolve_alias(ref, run_dir, output_root)
    path = Path(ref).expanduser()
    if path.is_dir():
        return _resolve_directory(ref, path)
    if path.exists():
        raise ModelReferenceError(f"model reference {ref} is a file, not a model directory", hint=MODEL_REFERENCE_HINT)
    if looks_like_local_path(ref):
        raise ModelReferenceError(f"model directory not found: {ref}", hint="check the path (relative to the current directory)")
    close = difflib.get_close_matches(ref, MODEL_ALIASES, n=1, cutoff=0.6)
    if close or not HUB_ID.match(ref):
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ModelReferenceError(f"unknown model reference '{ref}'", hint=hint + MODEL_REFERENCE_HINT)
    if hub_offline() and not _in_hub_cache(ref):
        raise ModelReferenceError(
            f"unknown model reference '{ref}': not base/aligned, not a directory, and the hub is offline (HF_HUB_OFFLINE=1)",
            hint=MODEL_REFERENCE_HINT,
        )
    return ResolvedModel(ref, "hub", ref)


def recipe_for_models(models: list[ResolvedModel], run_dir: str | Path | None = None, *, output_root: str | Path = "runs") -> Path:
    """The recipe that sets reward, tokenizer options and generation when --recipe is not given:
    the first model's run, else --run DIR's, else the latest run's."""
    for model in models:
        if model.recipe_path is not None:
            return model.recipe_path
    try:
        run = open_run(run_dir) if run_dir is not None else latest_run(output_root)
    except ModelReferenceError as err:
        names = ", ".join(m.reference for m in models)
        what = f"no recipe for {names}: it is not part of a run, and {err.message}" if names else f"no recipe: {err.message}"
        raise ModelReferenceError(what, hint="pass --recipe RECIPE for the reward and generation settings (or --run DIR)") from None
    return RunDir(run).recipe
