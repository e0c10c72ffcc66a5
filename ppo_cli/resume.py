"""Resuming a run: which checkpoint (`ppo train --resume`), whether the recipe may differ from the
one the run started with, and the run's logs cut back to the checkpoint's update.

Every check reads files only, so `ppo train --resume` refuses a bad resume before any model loads.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Sequence

from ppo_cli.errors import CheckpointError, UsageError
from ppo_cli.metric_names import STEP
from ppo_cli.recipe import Recipe
from ppo_cli.recipe_loading import load_recipe
from ppo_cli.runs import RunDir, atomic_write_text

# Keys that may change between a run and its resume: how long it runs, how it logs, how long it waits.
RESUMABLE_CHANGES = ("train.total_updates", "train.save_every", "train.keep_checkpoints", "train.log_every",
                     "train.sample_every", "train.num_samples", "train.max_consecutive_skips", "train.device",
                     "train.num_threads", "train.fsdp_rollout", "train.collective_timeout_s", "monitor.", "logging.",
                     # how long an environment's call may take and how often it is retried: not what it answers
                     "environment.timeout_s", "environment.retries", "environment.retry_backoff_s",
                     "environment.max_concurrency", "environment.headers")


def _flatten(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _changes(saved: Recipe, new: Recipe, resumable: bool) -> list[str]:
    old_flat, new_flat = _flatten(saved.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    keys = sorted(set(old_flat) | set(new_flat))
    return [
        f"{key}: {old_flat.get(key)!r} -> {new_flat.get(key)!r}"
        for key in keys
        if old_flat.get(key) != new_flat.get(key) and key.startswith(RESUMABLE_CHANGES) == resumable
    ]


def recipe_differences(saved: Recipe, new: Recipe) -> list[str]:
    """'key: saved -> new' for every setting that changes what the run computes."""
    return _changes(saved, new, resumable=False)


def resume_changes(saved: Recipe, new: Recipe) -> list[str]:
    """'key: saved -> new' for the settings a resume may change (RESUMABLE_CHANGES): said when it
    resumes, as a recipe file without a --set the run started with (train.save_every) changes them too.
    A checkpointing run resumed with train.save_every 0 gets the consequence spelled out."""
    changes = _changes(saved, new, resumable=True)
    if saved.train.save_every > 0 and new.train.save_every == 0:
        changes.append("so this run writes no more checkpoints (pass --set train.save_every=N to keep them)")
    return changes


def resume_command(recipe: Recipe, recipe_path: Path | str, overrides: Sequence[str] = (), options: Sequence[str] = (),
                   resuming: bool = False, force: bool = False) -> str:
    """The `ppo train` line that continues this run from its latest checkpoint, for the hints that say so
    (errors.RESUME). A run started with --set overrides: its saved recipe, which holds them (the recipe
    file alone would name another run, or differ from the saved one). A command that resumed: itself,
    which was accepted once already (--set may have changed train.total_updates, --force more). ``options``:
    the other `ppo train` options to repeat (--merge, the launcher's)."""
    if overrides and not resuming:
        recipe_path, overrides = RunDir(recipe.run_dir).recipe, ()
    sets = [arg for item in overrides for arg in ("--set", item)]
    return shlex.join(["ppo", "train", str(recipe_path), *sets, *options, "--resume", *(["--force"] if force else [])])


def find_resume_checkpoint(recipe: Recipe, resume: str, force: bool) -> Path:
    """The checkpoint to resume: 'latest' (or the run directory) or one checkpoints/step-N of this run."""
    from ppo_cli.checkpoint import check_same_launcher, latest_checkpoint, verify_manifest  # torch: after the cheap checks

    run = RunDir(recipe.run_dir)
    if not run.is_run():
        raise UsageError(f"no run to resume at {run.path}",
                         hint="drop --resume to start it, or set name and output_dir to those of the run to continue")
    if resume == "latest" or Path(resume).resolve() == run.path.resolve():
        checkpoint = latest_checkpoint(run.checkpoints) if run.checkpoints.is_dir() else None
        check_not_complete(run, recipe.train.total_updates, checkpoint is not None)  # a named checkpoint may redo updates
        if checkpoint is None:
            raise UsageError(
                f"no complete checkpoint to resume in {run.checkpoints}",
                hint="checkpoints are written only with train.save_every > 0; start again with --overwrite "
                     "(and set train.save_every), or " + _start_from_final(run),
            )
    else:
        checkpoint = Path(resume)
        if not checkpoint.is_dir():
            raise UsageError(f"checkpoint not found: {resume}", hint=f"give a directory under {run.checkpoints}")
        if checkpoint.resolve() == run.final.resolve():
            raise UsageError(f"{resume} holds the trained weights but no optimizer, scheduler or data state, "
                             "so a run cannot resume from it", hint=_start_from_final(run))
        if checkpoint.resolve().parent != run.checkpoints.resolve():
            raise UsageError(f"{resume} is not a checkpoint of run {run.path}",
                             hint="resume with the recipe (name, output_dir) of the run it belongs to")
    verify_manifest(checkpoint)
    from ppo_cli.distributed import launched_with_deepspeed

    check_same_launcher(checkpoint, launched_with_deepspeed())
    if not run.recipe.exists():
        raise CheckpointError(f"{run.recipe} is missing, so the run cannot be resumed safely")
    differences = recipe_differences(load_recipe(run.recipe), recipe)
    if differences and not force:
        raise UsageError(
            f"the recipe differs from the one the run started with: {'; '.join(differences)}",
            hint="resume with the same recipe, or pass --force to accept the differences",
        )
    return checkpoint


def _start_from_final(run) -> str:
    """How to train further from a run's result when it cannot be resumed: a new run that starts there."""
    return (f"train further from its result in a new run: --set policy.adapter={run.final} (a LoRA run) or "
            f"--set policy.path={run.final} (full weights), with another name")


def check_not_complete(run, total_updates: int, has_checkpoints: bool = True) -> None:
    """A run whose final/ already holds update ``total_updates`` has nothing left to resume."""
    info = run.final / "ppo_cli.json"
    try:
        done = int(json.loads(info.read_text(encoding="utf-8"))["step"]) if info.exists() else None
    except (OSError, ValueError, KeyError, TypeError):
        done = None
    if done is not None and done >= total_updates:
        further = (f"raise train.total_updates to train further (--set train.total_updates={done * 2})" if has_checkpoints
                   else "it wrote no checkpoints (train.save_every: 0), so it cannot continue; " + _start_from_final(run))
        raise UsageError(f"run {run.path} is already complete ({done}/{total_updates} updates)",
                         hint=f"{further}; or start a new run with --overwrite or another name")


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop lines written after the checkpoint, so a resumed run never duplicates a step."""
    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
            if line.strip() and json.loads(line).get(STEP, 0) <= last_step]
    atomic_write_text(path, "".join(kept))
