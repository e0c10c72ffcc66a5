"""`ppo train`: check everything cheap, load the engine, run the PPO loop, save final/.

Order matters for people: every check that needs no model (recipe, paths, prompts, reward
function, output directory, checkpoint to resume) runs before the first model is loaded.
"""

from __future__ import annotations

import contextlib

import json
import os
import random
import resource
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ppo_cli.errors import CheckpointError, Interrupted, PpoError, UsageError
from ppo_cli.recipe import Recipe
from ppo_cli.recipe_loading import dump_resolved, load_recipe

# Seconds past train.collective_timeout_s before the watchdog ends a process stuck in one collective
# (gloo raises at the timeout itself), and that a process leaving after a timeout may take.
WATCHDOG_GRACE_S = 60
EXIT_GRACE_S = 30

# Keys that may change between a run and its resume: how long it runs and how it logs.
RESUMABLE_CHANGES = ("train.total_updates", "train.save_every", "train.keep_checkpoints", "train.log_every",
                     "train.sample_every", "train.num_samples", "train.max_consecutive_skips", "train.device",
                     "train.num_threads", "train.fsdp_rollout", "train.collective_timeout_s", "monitor.", "logging.")


@dataclass
class TrainResult:
    run_dir: Path
    final_dir: Path
    summary: dict


def peak_memory_gb() -> float:
    """Peak resident memory of this process (CPU) or peak allocated CUDA memory, in GB."""
    import torch

    if torch.cuda.is_available() and torch.cuda.max_memory_allocated() > 0:
        return torch.cuda.max_memory_allocated() / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e9 if sys.platform == "darwin" else rss * 1024 / 1e9


# --- before any model is loaded ------------------------------------------------------------------


def preflight(recipe: Recipe) -> tuple[list[str], list[str]]:
    """Everything that can fail before a model is loaded: prompts, reward functions and servers, model paths."""
    from ppo_cli.engine.data import check_reward_reads_conversations, read_recipe_prompts
    from ppo_cli.model_refs import check_adapter_reference, check_model_reference
    from ppo_cli.reward_checks import check_reward_components

    from ppo_cli.commands.inputs import check_vllm_backend

    check_vllm_backend(recipe, int(os.environ.get("WORLD_SIZE", "1")))  # set by accelerate launch / torchrun
    prompts = read_recipe_prompts(recipe.data).prompts
    eval_prompts = read_recipe_prompts(recipe.data, "eval_prompts").prompts if recipe.data.eval_prompts else []
    check_reward_reads_conversations(recipe.reward, prompts + eval_prompts)
    for path in [recipe.policy.path, recipe.reference.path, recipe.value.path]:
        if path:
            check_model_reference(path)
    if recipe.policy.adapter:
        check_adapter_reference(recipe.policy.adapter)
    check_reward_components(recipe.reward, import_functions=True)  # files, credentials, and that each server answers
    from ppo_cli.tracking import check_trackers

    check_trackers(recipe.logging)  # e.g. wandb asked for but not installed
    return prompts, eval_prompts


def _flatten(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def recipe_differences(saved: Recipe, new: Recipe) -> list[str]:
    """'key: saved -> new' for every setting that changes what the run computes."""
    old_flat, new_flat = _flatten(saved.model_dump(mode="json")), _flatten(new.model_dump(mode="json"))
    keys = sorted(set(old_flat) | set(new_flat))
    return [
        f"{key}: {old_flat.get(key)!r} -> {new_flat.get(key)!r}"
        for key in keys
        if old_flat.get(key) != new_flat.get(key) and not key.startswith(RESUMABLE_CHANGES)
    ]


def find_resume_checkpoint(recipe: Recipe, resume: str, force: bool) -> Path:
    """The checkpoint to resume: 'latest' (or the run directory) or one checkpoints/step-N of this run."""
    from ppo_cli.checkpoint import check_same_launcher, latest_checkpoint, verify_manifest
    from ppo_cli.runs import RunDir

    run = RunDir(recipe.run_dir)
    if not run.is_run():
        raise UsageError(f"no run to resume at {run.path}",
                         hint="drop --resume to start it, or set name and output_dir to those of the run to continue")
    if resume == "latest" or Path(resume).resolve() == run.path.resolve():
        checkpoint = latest_checkpoint(run.checkpoints) if run.checkpoints.is_dir() else None
        _check_not_complete(run, recipe.train.total_updates, checkpoint is not None)  # a named checkpoint may redo updates
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


def _check_not_complete(run, total_updates: int, has_checkpoints: bool = True) -> None:
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


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop lines written after the checkpoint, so a resumed run never duplicates a step."""
    from ppo_cli.runs import atomic_write_text

    if not path.exists():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True)
            if line.strip() and json.loads(line).get("step", 0) <= last_step]
    atomic_write_text(path, "".join(kept))


# --- the run -------------------------------------------------------------------------------------


def share_of(items: list, rank: int, world_size: int) -> list:
    """Process ``rank``'s contiguous share of ``items`` (sizes differ by at most one, possibly empty):
    concatenated in rank order, the shares are ``items``."""
    per, extra = divmod(len(items), world_size)
    start = rank * per + min(rank, extra)
    return items[start:start + per + (1 if rank < extra else 0)]


def _evaluate_share(engine, prompts: list[str], seed: int) -> dict:
    """Responses and per-response numbers for ``prompts``, sampled alone (no collective: the caller
    holds the full parameters) with the torch RNG seeded to ``seed``."""
    import torch

    from ppo_cli.commands.rollout import sequence_kl

    if not prompts:
        return {"responses": [], "scores": [], "finished": torch.zeros(0, dtype=torch.bool),
                "lengths": torch.zeros(0, dtype=torch.long), "kl": torch.zeros(0), "failures": []}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        generation = engine.generate(prompts)
        responses = engine.decode_responses(generation)
        result = engine.score(prompts, responses, generation)
        kl = sequence_kl(engine, generation)
    return {"responses": responses, "scores": list(result.scores), "finished": generation.finished,
            "lengths": generation.response_lengths, "kl": kl, "failures": list(result.failures.values())}


def evaluate(engine, prompts: list[str], seed: int, dist=None) -> dict | None:
    """Mean score, EOS rate, length and KL to the reference (summed over each response, as `ppo eval`
    reports it) on held-out prompts, sampled with a fixed seed.

    Collective with ``dist``: every process samples its share of the prompts (share_of) with the seed
    plus its rank, so one process computes exactly what it always did; the main process gets every
    prompt's result in the prompts' order, the others None. Under FSDP or ZeRO-3 call it inside
    ``dist.full_parameters``: generation then needs no communication."""
    import torch

    rank, world_size = (dist.rank, dist.world_size) if dist is not None else (0, 1)
    mine = _evaluate_share(engine, share_of(prompts, rank, world_size), seed + rank)
    if world_size > 1:
        parts = dist.gather_objects({k: v.cpu() if torch.is_tensor(v) else v for k, v in mine.items()})
        if not dist.is_main:
            return None
        mine = {k: torch.cat([p[k] for p in parts]) if torch.is_tensor(mine[k]) else [x for p in parts for x in p[k]]
                for k in mine}
    mine["failures"] = [f for f in mine["failures"] if f]
    scored = [s for s in mine["scores"] if s is not None]  # a prompt a reward failed to score is left out, and counted
    if not scored:
        from ppo_cli.errors import RewardServerError

        raise RewardServerError(f"no held-out prompt got a reward: {mine['failures'][0] if mine['failures'] else 'every reward failed'}",
                                hint="check that the reward server or judge answers; checkpoints written so far are intact (--resume)")
    return {
        "score": sum(scored) / len(scored),
        "reward_failed": len(mine["scores"]) - len(scored),
        "eos_rate": mine["finished"].float().mean().item(),
        "response_length": mine["lengths"].float().mean().item(),
        "kl": mine["kl"].mean().item(),
        "samples": [
            {"prompt": p, "response": r, "score": s, "finished": bool(f)}
            for p, r, s, f in zip(prompts, mine["responses"], mine["scores"], mine["finished"].tolist())
        ],
    }


class StopOnSignal:
    """First Ctrl-C / SIGTERM: finish the current update, checkpoint, exit. Second: exit at once."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt  # files are written atomically, so stopping anywhere is safe
        self.requested = True


def _write_samples(writer, recipe: Recipe, step: int, rollout) -> None:
    every = recipe.train.sample_every
    if not every or not (step % every == 0 or step == 1):
        return
    for i in range(min(recipe.train.num_samples, len(rollout.prompts))):
        writer.write({
            "step": step, "prompt": rollout.prompts[i], "response": rollout.responses[i],
            "score": float(rollout.scores[i]) if rollout.scored is None or rollout.scored[i] else None,
            "finished": bool(rollout.generation.finished[i]),
        })


def _train_loop(state, run_dir, stop: StopOnSignal, recipe_path):
    """Updates until the end; metrics, samples, health warnings and progress from the main process only.
    Returns the main process's RunObserver (None elsewhere)."""
    from ppo_cli import report
    from ppo_cli.checkpoint import save_checkpoint
    from ppo_cli.collectives import enter as enter_phase
    from ppo_cli.observe import RunObserver
    from ppo_cli.runs import JsonlWriter
    from ppo_cli.trainer import train

    recipe, main = state.recipe, state.dist.is_main
    metrics_writer = JsonlWriter(run_dir.metrics) if main else None
    samples_writer = JsonlWriter(run_dir.samples) if main else None
    progress = report.TrainProgress(recipe.train.total_updates, state.step, recipe.train.log_every, enabled=main)
    observer = RunObserver(recipe, run_dir, resumed_at=state.step) if main else None
    try:
        with progress:
            for metrics, rollout in train(state):
                if main:
                    observer.observe(metrics, state.step)  # prints new health warnings, adds health/warnings
                    if state.step % recipe.train.log_every == 0 or state.step == recipe.train.total_updates:
                        metrics_writer.write(metrics)
                        observer.log(metrics, state.step)
                    _write_samples(samples_writer, recipe, state.step, rollout)
                    progress.update(metrics)
                last = state.step == recipe.train.total_updates
                stopping = state.dist.any(stop.requested)  # every process stops after the same update
                due = (recipe.train.save_every and state.step % recipe.train.save_every == 0) or stopping
                # A skipped update is not checkpointed: the newest checkpoint stays the last good state.
                # The last update is checkpointed too when due, so raising total_updates resumes after it.
                if due and state.consecutive_skips == 0:
                    enter_phase("checkpoint")
                    save_checkpoint(state, run_dir.checkpoints, recipe.train.keep_checkpoints)
                if stopping and not last:
                    raise Interrupted(
                        f"interrupted after update {state.step}; checkpoint saved",
                        hint=f"resume with: ppo train {recipe_path or 'RECIPE'} --resume",
                    )
    finally:
        for writer in (metrics_writer, samples_writer, observer):
            if writer is not None:
                writer.close()
    return observer


def _open_run_dir(recipe: Recipe, overwrite: bool, resuming: bool, dist):
    """Create (main process) the run directory and its recipe.yaml, once the models have loaded: a
    run that fails to load leaves nothing behind (check_run_dir ran before loading). Returns the
    run directory and, for a new run on the main process, what was there before (RunFootprint)."""
    from ppo_cli.runs import RunDir, atomic_write_text, prepare_run_dir

    run_dir, footprint = RunDir(recipe.run_dir), None
    if resuming:
        return run_dir, None
    dist.wait()  # nobody may see the directory the main process is about to create as "existing"
    if dist.is_main:
        run_dir, footprint = prepare_run_dir(recipe.output_dir, recipe.name, overwrite)
        atomic_write_text(run_dir.recipe, dump_resolved(recipe))
    dist.wait()
    return run_dir, footprint


def _evaluate_before(engine, eval_prompts, run_dir, recipe, dist):
    """Held-out scores of the starting policy, saved so a resumed run reports the same 'before'.
    Collective: every process takes its share (None on the others)."""
    from ppo_cli.runs import atomic_write_text

    path = run_dir.path / "eval_before.json"
    if not eval_prompts:
        return None
    if dist.gather_objects(path.exists())[0]:  # the main process's view, so all skip or none
        return json.loads(path.read_text()) if dist.is_main else None
    before = evaluate(engine, eval_prompts, recipe.seed, dist)
    if dist.is_main:
        atomic_write_text(path, json.dumps(before, indent=2))
    return before


def _finish(state, run_dir, before, after, merge: bool, started: float, observer=None,
            full_state: dict | None = None) -> dict:
    """final/, eval.json and summary.json, written by the main process (``full_state``: the gathered
    weights under FSDP, see save_policy_and_value)."""
    import torch

    from ppo_cli.checkpoint import save_final
    from ppo_cli.engine.models import resolve_dtype
    from ppo_cli.model_card import render_model_card
    from ppo_cli.runs import atomic_write_text

    recipe, engine = state.recipe, state.engine
    numbers = {when: {k: v for k, v in (result or {}).items() if k != "samples"} for when, result in
               (("before", before), ("after", after))}
    info = {
        "name": recipe.name, "policy_path": recipe.policy.path, "policy_adapter": recipe.policy.adapter,
        "lora": recipe.policy.lora is not None, "value_kind": engine.actor_critic.value_kind,
        "advantage": recipe.ppo.advantage, "step": state.step, "trust_remote_code": recipe.policy.trust_remote_code,
        "mixed_precision": state.dist.mixed_precision,
    }
    card = render_model_card(info, dump_resolved(recipe), numbers["before"], numbers["after"])
    merge_dtype = resolve_dtype(recipe.policy.dtype, torch.device("cpu")) if merge else None
    save_final(engine.actor_critic, engine.tokenizer, run_dir.final, info, merge_dtype, model_card=card,
               full_state=full_state)
    if before is not None:
        atomic_write_text(run_dir.eval, json.dumps({"prompts": recipe.data.eval_prompts, "before": before, "after": after}, indent=2))
    summary = {
        "run_dir": str(run_dir.path), "final_dir": str(run_dir.final), "updates": state.step,
        "episodes": state.episodes * state.dist.world_size, "processes": state.dist.world_size,
        "mixed_precision": state.dist.mixed_precision,  # train.mixed_precision as resolved ('auto' made concrete)
        "mixed_precision_choice": precision_record(state.dist.precision),
        "seconds": time.perf_counter() - started, "peak_memory_gb": peak_memory_gb(), **numbers,
    }
    if observer is not None:
        summary.update(observer.finish(summary))  # learning-curve plot, warnings, files
    atomic_write_text(run_dir.summary, json.dumps(summary, indent=2))
    return summary


def precision_record(choice) -> dict:
    """How train.mixed_precision was resolved, with the probe's timings: for summary.json."""
    probe = choice.probe
    timings = {} if probe is None else {"probe_fp32_ms": probe.fp32_ms, "probe_bf16_ms": probe.bf16_ms, "cpu": probe.cpu}
    return {"setting": choice.setting, "value": choice.value, "reason": choice.reason, **timings,
            "described": choice.describe()}


def advice_from_plan(err, recipe, recipe_path: Path | None, device):
    """OutOfMemory ``err`` with what ``ppo plan`` expected and the `ppo train` line of the first change that fits."""
    import shlex

    from ppo_cli.commands import plan
    from ppo_cli.memory import model_shapes, suggestions
    from ppo_cli.memory_errors import OutOfMemory, machine_memory_gb

    try:
        result = plan.run(recipe, device=device.type)
    except PpoError:
        return err
    memory = machine_memory_gb(device)
    peak = result.estimate.total_gb
    detail = f"{err.detail}; ppo plan expects a peak of {peak:.1f} GB" + (f" on {memory:.1f} GB" if memory else "")
    budget_option = f" --gpu-memory {memory:.0f}" if memory and device.type == "cuda" else ""
    hint = f"run `ppo plan {recipe_path or 'RECIPE'}{budget_option}` for what each role needs and the changes that would fit"
    if memory is not None:
        # The estimate is within about 25% of measured peaks: ask for room below the machine's memory.
        budget = min(memory, peak) * 0.75
        fitting = [s for s in suggestions(result.settings, model_shapes(recipe), budget) if s.fits]
        if fitting:
            command = ["ppo", "train", str(recipe_path or "RECIPE"), *plan.set_args(fitting[0].overrides)]
            hint = f"{fitting[0].change}: {shlex.join(command)}"
    return OutOfMemory(err.phase, detail, hint=hint)


def run(recipe: Recipe, recipe_path: Path | None = None, overwrite: bool = False, merge: bool = False,
        resume: str | None = None, force: bool = False) -> TrainResult:
    if resume is not None and overwrite:
        raise UsageError("--resume and --overwrite cannot be used together", hint="--resume continues a run; --overwrite replaces it")
    from ppo_cli.runs import RunDir, check_run_dir

    prompts, eval_prompts = preflight(recipe)
    checkpoint = find_resume_checkpoint(recipe, resume, force) if resume is not None else None
    if checkpoint is None:
        check_run_dir(RunDir(recipe.run_dir), overwrite)  # reads only; the directory is made after loading

    from ppo_cli import collectives

    collectives.enter("loading")
    timeout = recipe.train.collective_timeout_s
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1  # set by accelerate launch / torchrun
    # A process stuck in one collective well past the timeout (a wait that does not raise) prints the
    # line and exits; the launcher then stops the others.
    watchdog = collectives.Watchdog(timeout + WATCHDOG_GRACE_S, timeout).start() if several else None
    try:
        return _run_processes(recipe, prompts, eval_prompts, checkpoint, recipe_path, overwrite, merge)
    except RuntimeError as err:
        mapped = collectives.as_collective_error(err, timeout) if several else None
        if mapped is None:
            raise
        collectives.exit_soon(EXIT_GRACE_S)  # leaving may wait on the broken process group: never for long
        raise mapped from err
    finally:
        if watchdog is not None:
            watchdog.stop()


def _gathered_for_evaluation(dist, model, eval_prompts: list[str]):
    """dist.full_parameters for the evaluation (every process gathers and evaluates its share), or
    nothing without eval prompts: under FSDP the gather would hold the whole policy for nothing."""
    return dist.full_parameters(model) if eval_prompts else contextlib.nullcontext()


def _run_processes(recipe: Recipe, prompts, eval_prompts, checkpoint, recipe_path, overwrite: bool,
                   merge: bool) -> TrainResult:
    """run() from the process group on: every process runs all of it (collectives inside)."""
    import numpy as np
    import torch

    from ppo_cli import report
    from ppo_cli.checkpoint import gathered_model_state, load_policy_and_value, load_training_state
    from ppo_cli.collectives import enter as enter_phase
    from ppo_cli.distributed import Distributed
    from ppo_cli.engine.session import load_engine
    from ppo_cli.memory_errors import OutOfMemory
    from ppo_cli.memory_errors import phase as memory_phase
    from ppo_cli.runs import discard_unstarted_run
    from ppo_cli.trainer import init_state

    dist = Distributed.for_recipe(recipe)
    random.seed(recipe.seed)
    np.random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)

    started = time.perf_counter()
    if dist.is_main:
        report.console.print(f"loading models for [bold]{recipe.name}[/] ({dist.precision.describe()}) ...", soft_wrap=True)
    try:
        with memory_phase("loading the models"):
            engine = load_engine(recipe, dist.device, dist.mixed_precision)
        if checkpoint is not None:  # before accelerate prepares the models: FSDP shards the loaded weights
            load_policy_and_value(engine.actor_critic, checkpoint)
        state = init_state(engine, prompts, dist)
    except OutOfMemory as err:
        raise advice_from_plan(err, recipe, recipe_path, dist.device) from err
    run_dir, footprint = _open_run_dir(recipe, overwrite, checkpoint is not None, dist)
    if checkpoint is not None:
        load_training_state(state, checkpoint)
        if dist.is_main:
            _truncate_jsonl(run_dir.metrics, state.step)
            _truncate_jsonl(run_dir.samples, state.step)
            report.console.print(f"resumed from {checkpoint} at update {state.step}")
    try:
        enter_phase("evaluation")
        with _gathered_for_evaluation(dist, state.model, eval_prompts):
            before = _evaluate_before(engine, eval_prompts, run_dir, recipe, dist)
        with StopOnSignal() as stop:
            observer = _train_loop(state, run_dir, stop, recipe_path)
    except BaseException as err:
        if footprint is not None and state.step == 0:
            discard_unstarted_run(run_dir, footprint)  # no update finished: leave no run to block or mislead
        if isinstance(err, OutOfMemory):
            raise advice_from_plan(err, recipe, recipe_path, dist.device) from err
        raise

    enter_phase("evaluation")
    with _gathered_for_evaluation(dist, state.model, eval_prompts):
        after = evaluate(engine, eval_prompts, recipe.seed, dist) if eval_prompts else None
    enter_phase("checkpoint")
    full_state = gathered_model_state(state)  # FSDP: what trains, whole, gathered by every process
    # FSDP: final/ is written from full_state (--merge reloads the base from disk), so the sharded
    # weights need no gathering; ZeRO-3 saves from the modules, gathered here by every process.
    with contextlib.nullcontext() if dist.shards_parameters else dist.full_parameters(state.model):
        summary = _finish(state, run_dir, before, after, merge, started, observer, full_state) if dist.is_main else {}
    dist.wait()
    return TrainResult(run_dir.path, run_dir.final, summary)
