"""Model references: what a name on the command line or in a recipe points at, and whether it can be had.

``base`` / ``aligned`` (of a run), a run directory, final/ or a checkpoint, a local model directory,
a peft adapter, or a hub id -> the paths to load (ResolvedModel); and the checks that fail early,
in one line, when a local path is missing or the hub is offline or out of reach.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from ppo_cli.errors import ModelReferenceError
from ppo_cli.runs import RunDir, restore_replaced_directory


def looks_like_local_path(ref: str) -> bool:
    """A name that can only be a local path, never a hub id (``org/name``): relative or absolute
    markers, a trailing or second slash, or a backslash (no hub id has one)."""
    return ref.startswith((".", "/", "~")) or ref.endswith("/") or ref.count("/") > 1 or "\\" in ref


TINY_MODELS_HINT = ("build the tiny models: python scripts/make_tiny_models.py, from the repository root (it writes "
                    "models/tiny/ and models/tiny-tools/; scripts/demo.sh builds models/tiny/ only)")


def missing_directory_hint(path: str) -> str:
    """How to get a model directory that is not there: the shipped recipes' models/tiny*/ are built."""
    parts = Path(path).parts
    if len(parts) >= 2 and parts[0] == "models" and parts[1].startswith("tiny"):
        if Path("scripts/make_tiny_models.py").is_file():  # the repository root: not built yet
            return TINY_MODELS_HINT
        # elsewhere (a recipe of one's own, a run's recipe.yaml read from another directory): the path is the
        # repository's, relative to where ppo runs
        return (f"the path is relative to the current directory ({Path.cwd()}): run ppo from the repository root "
                "(python scripts/make_tiny_models.py there builds models/tiny/ and models/tiny-tools/), or give "
                "an absolute path")
    return "check the path (relative to the current directory)"


def is_gguf(path: str) -> bool:
    """A model given as a single GGUF file (llama.cpp's format), loaded dequantized by transformers."""
    return str(path).lower().endswith(".gguf")


def gguf_location(path: str) -> tuple[str, str]:
    """(directory, file name): transformers loads a GGUF as ``from_pretrained(directory, gguf_file=name)``."""
    local = Path(path).expanduser()
    return str(local.parent), local.name


def check_gguf_file(path: str) -> None:
    """A local file that starts with the GGUF magic bytes, and the ``gguf`` package to read it."""
    import importlib.util

    local = Path(path).expanduser()
    if not local.is_file():
        raise ModelReferenceError(f"GGUF file not found: {path}", hint="check the path (relative to the current directory)")
    with open(local, "rb") as file:
        if file.read(4) != b"GGUF":
            raise ModelReferenceError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)",
                                      hint="point at a .gguf file written by llama.cpp's converter, or at a model directory")
    if importlib.util.find_spec("gguf") is None:
        raise ModelReferenceError(f"reading the GGUF file {path} needs the gguf package, which is not installed",
                                  hint="pip install gguf")


def check_model_reference(path: str) -> None:
    """Fail early and clearly when a model is neither a local directory (or GGUF file) nor reachable on the hub."""
    if is_gguf(path):
        check_gguf_file(path)
        return
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
        raise ModelReferenceError(f"model directory not found: {path}", hint=missing_directory_hint(path))
    if hub_offline():
        if _in_hub_cache(path):
            return  # downloaded before: transformers loads it from the cache
        raise ModelReferenceError(
            f"model '{path}' is not a local directory and the hub is offline (HF_HUB_OFFLINE=1)",
            hint=shipped_model_hint(path) or "download it first (`hf download`) or point at a local directory",
        )
    # Without this, a machine with no network spends a minute in the hub client's retries per file.
    unreachable = hub_unreachable()
    if unreachable and not _in_hub_cache(path):
        raise ModelReferenceError(
            f"model '{path}' is not a local directory, and the hub cannot be reached ({unreachable})",
            hint=shipped_model_hint(path)
            or "check the spelling of a local path and the network, or download the model first (`hf download`)",
        )


def shipped_model_hint(path: str) -> str | None:
    """models/smollm2, which the SmolLM2 recipes name, reads like a hub id (owner/name): say what writes it."""
    if Path(path).parts[:1] == ("models",) and Path(path).name.startswith("smollm2"):
        return ("the SmolLM2 recipes' models/smollm2 is written by python scripts/fetch_smollm2.py, run from the "
                f"repository root (paths are relative to the current directory, {Path.cwd()})")
    return None


def has_chat_template(path: str) -> bool | None:
    """Whether a local model directory's tokenizer files define a chat template, read without loading the
    tokenizer (transformers 5 writes chat_template.jinja; older saves keep it in tokenizer_config.json);
    None when ``path`` is not a local directory (a hub id: its tokenizer is checked when it loads)."""
    import json

    local = Path(path).expanduser()
    if not local.is_dir():
        return None
    if (local / "chat_template.jinja").is_file() or (local / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((local / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return bool(config.get("chat_template"))


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
    "a local model directory or .gguf file, or a hub id"
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
    if is_gguf(ref):
        check_gguf_file(ref)
        return ResolvedModel(ref, "model", ref)
    if path.exists():
        raise ModelReferenceError(f"model reference {ref} is a file, not a model directory", hint=MODEL_REFERENCE_HINT)
    if looks_like_local_path(ref):
        raise ModelReferenceError(f"model directory not found: {ref}", hint=missing_directory_hint(ref))
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
