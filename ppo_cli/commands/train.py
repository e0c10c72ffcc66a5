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
from typing import Callable, Sequence

from ppo_cli.errors import RESUME, Interrupted, PpoError, UsageError
from ppo_cli.metric_names import STEP
from ppo_cli.recipe import Recipe
from ppo_cli.recipe_loading import dump_resolved

Show = Callable[[str, dict], None]
"""What a run shows people, as ``show(what, data)`` calls from the main process (the CLI draws them;
nothing here prints):

    "loading"  {"name", "precision"}           before the models load
    "resumed"  {"checkpoint", "step", "changes"}  a resumed run's checkpoint, loaded; the resumable settings it changed
    "start"    {"total", "step", "log_every"}  the updates begin (at ``step``)
    "update"   the update's metrics            after each update
    "warning"  a health warning (monitor.HealthWarning as a dict)
    "note"     {"message"}                     a side remark (e.g. no plot drawn)
    "end"      {}                              the updates are over, finished or not
"""


def show_nothing(what: str, data: dict) -> None:
    """The default ``show``: a run called from code draws nothing."""

# Seconds past train.collective_timeout_s before the watchdog ends a process stuck in one collective
# (gloo raises at the timeout itself), and that a process leaving after a timeout may take.
WATCHDOG_GRACE_S = 60
EXIT_GRACE_S = 30

@dataclass
class TrainResult:
    run_dir: Path
    final_dir: Path
    summary: dict


def peak_memory_gb() -> float:
    """Peak resident memory of this process (CPU) or peak allocated CUDA memory, in GB."""
    import torch

    from ppo_cli.memory_peaks import run_peak_bytes

    if torch.cuda.is_available() and run_peak_bytes() > 0:
        return run_peak_bytes() / 1e9
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e9 if sys.platform == "darwin" else rss * 1024 / 1e9


# --- before any model is loaded ------------------------------------------------------------------


def preflight(recipe: Recipe) -> tuple[list[str], list[str]]:
    """Everything that can fail before a model is loaded: `ppo validate`'s file and server checks (with
    the reward functions imported), the vLLM backend for this many processes, the trackers."""
    from ppo_cli.commands.inputs import check_environment, check_vllm_backend
    from ppo_cli.commands.validate import check_recipe_files
    from ppo_cli.tracking import check_trackers

    check_vllm_backend(recipe, int(os.environ.get("WORLD_SIZE", "1")))  # set by accelerate launch / torchrun
    check_environment(recipe, int(os.environ.get("WORLD_SIZE", "1")))
    prompts, eval_prompts = check_recipe_files(recipe, import_functions=True)
    check_trackers(recipe.logging)  # e.g. wandb asked for but not installed
    return prompts, eval_prompts


# --- the run -------------------------------------------------------------------------------------


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
            STEP: step, "prompt": rollout.prompts[i], "response": rollout.responses[i],
            "score": float(rollout.scores[i]) if rollout.scored is None or rollout.scored[i] else None,
            "finished": bool(rollout.generation.finished[i]),
            # an episode of several turns: its transcript and how it went (response is its last message)
            **({"messages": rollout.episodes[i].messages, "turns": rollout.episodes[i].turns,
                "ended_by": rollout.episodes[i].ended_by} if rollout.episodes is not None else {}),
        })


def _train_loop(state, run_dir, stop: StopOnSignal, show: Show):
    """Updates until the end; metrics, samples, health warnings and progress from the main process only.
    Returns the main process's RunObserver (None elsewhere)."""
    from ppo_cli.checkpoint import save_checkpoint
    from ppo_cli.collectives import enter as enter_phase
    from ppo_cli.observe import RunObserver
    from ppo_cli.runs import JsonlWriter
    from ppo_cli.trainer import train

    recipe, main = state.recipe, state.dist.is_main
    metrics_writer = JsonlWriter(run_dir.metrics) if main else None
    samples_writer = JsonlWriter(run_dir.samples) if main else None
    observer = RunObserver(recipe, run_dir, resumed_at=state.step, show=show) if main else None
    if main:
        show("start", {"total": recipe.train.total_updates, "step": state.step, "log_every": recipe.train.log_every})
    try:
        for metrics, rollout in train(state):
            if main:
                observer.observe(metrics, state.step)  # shows new health warnings, adds health/warnings
                if state.step % recipe.train.log_every == 0 or state.step == recipe.train.total_updates:
                    metrics_writer.write(metrics)
                    observer.log(metrics, state.step)
                _write_samples(samples_writer, recipe, state.step, rollout)
                show("update", metrics)
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
                    hint=f"resume with: {RESUME}",
                )
    finally:
        if main:
            show("end", {})
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
        # The recipe the run goes on with (a new total_updates, save_every; what --force accepted), so
        # that the run's own recipe.yaml resumes it and compare / eval read what it ran with last.
        if dist.is_main:
            atomic_write_text(run_dir.recipe, dump_resolved(recipe))
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
    from ppo_cli.evaluation import held_out
    from ppo_cli.runs import atomic_write_text

    path = run_dir.path / "eval_before.json"
    if not eval_prompts:
        return None
    if dist.gather_objects(path.exists())[0]:  # the main process's view, so all skip or none
        return json.loads(path.read_text()) if dist.is_main else None
    before = held_out(engine, eval_prompts, recipe.seed, dist, before=True)
    if dist.is_main:
        atomic_write_text(path, json.dumps(before, indent=2))
    return before


def _finish(state, run_dir, before, after, merge: bool, started: float, observer=None,
            full_state: dict | None = None, *, phase_peaks: dict[str, float], choices=None) -> dict:
    """final/, eval.json and summary.json, written by the main process (``full_state``: the gathered
    weights under FSDP, see save_policy_and_value; ``phase_peaks``: CUDA GB by phase, saving's added here)."""
    import torch

    from ppo_cli.checkpoint import save_final
    from ppo_cli.engine.models import resolve_dtype
    from ppo_cli.memory_peaks import phase_peak
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
    with phase_peak(state.dist.device, phase_peaks, "saving"):
        save_final(engine.actor_critic, engine.tokenizer, run_dir.final, info, merge_dtype, model_card=card,
                   full_state=full_state)
    if before is not None:
        atomic_write_text(run_dir.eval, json.dumps({"prompts": recipe.data.eval_prompts, "before": before, "after": after}, indent=2))
    summary = {
        "run_dir": str(run_dir.path), "final_dir": str(run_dir.final), "updates": state.step,
        "health_window": recipe.monitor.window if recipe.monitor.enabled else None,  # report.no_warnings_line
        "episodes": state.episodes * state.dist.world_size, "processes": state.dist.world_size,
        "mixed_precision": state.dist.mixed_precision,  # train.mixed_precision as resolved ('auto' made concrete)
        "mixed_precision_choice": precision_record(state.dist.precision),
        "gradient_checkpointing": engine.gradient_checkpointing,  # train.gradient_checkpointing resolved
        "cpu_heap_tuning": engine.device.type == "cpu" and engine.options.cpu_malloc_tuning,  # engine/malloc.py
        **({"memory_choices": choices.describe()} if choices is not None else {}),  # commands/plan.py planned_choices
        "seconds": time.perf_counter() - started, "peak_memory_gb": peak_memory_gb(), **numbers,
    }
    by_phase = {**phase_peaks, **state.memory_peaks}  # CUDA only: which phase set the peak
    if by_phase:
        summary["peak_memory_gb_by_phase"] = {k: round(v, 3) for k, v in by_phase.items()}
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


def advice_from_plan(err, recipe, recipe_path: Path | None, device, overrides: Sequence[str] = ()):
    """OutOfMemory ``err`` with what ``ppo plan`` expected and the `ppo train` line of the first change that fits
    (after the user's own ``overrides``, which the change's --set follow and so override)."""
    import shlex

    from ppo_cli.commands import plan
    from ppo_cli.plan_memory import model_shapes, suggestions
    from ppo_cli.resource_errors import OutOfMemory, machine_memory_gb

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
            given = [arg for item in overrides for arg in ("--set", item)]
            command = ["ppo", "train", str(recipe_path or "RECIPE"), *given, *plan.set_args(fitting[0].overrides)]
            hint = f"{fitting[0].change}: {shlex.join(command)}"
    return OutOfMemory(err.phase, detail, hint=hint)


def run(recipe: Recipe, recipe_path: Path | None = None, overwrite: bool = False, merge: bool = False,
        resume: str | None = None, force: bool = False, show: Show = show_nothing, overrides: Sequence[str] = ()) -> TrainResult:
    """Train as the recipe says; what happens along the way reaches people through ``show`` (Show).
    ``overrides``: the --set items the recipe was loaded with, for the hints that give a command."""
    if resume is not None and overwrite:
        raise UsageError("--resume and --overwrite cannot be used together", hint="--resume continues a run; --overwrite replaces it")
    from ppo_cli.resume import find_resume_checkpoint
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
    # A launcher SIGKILLed (a machine going down) leaves its processes running: they stop with it.
    launcher_watch = collectives.end_with_launcher(collectives.launcher_pid()) if several else None
    try:
        return _run_processes(recipe, prompts, eval_prompts, checkpoint, recipe_path, overwrite, merge, show, overrides)
    except RuntimeError as err:
        mapped = collectives.as_collective_error(err, timeout) if several else None
        if mapped is None:
            raise
        collectives.exit_soon(EXIT_GRACE_S)  # leaving may wait on the broken process group: never for long
        raise mapped from err
    finally:
        if watchdog is not None:
            watchdog.stop()
        if launcher_watch is not None:
            launcher_watch.set()


def _gathered_for_evaluation(dist, model, eval_prompts: list[str]):
    """dist.full_parameters for the evaluation (every process gathers and evaluates its share), or
    nothing without eval prompts: under FSDP the gather would hold the whole policy for nothing."""
    return dist.full_parameters(model) if eval_prompts else contextlib.nullcontext()


def _run_processes(recipe: Recipe, prompts, eval_prompts, checkpoint, recipe_path, overwrite: bool,
                   merge: bool, show: Show, overrides: Sequence[str] = ()) -> TrainResult:
    """run() from the process group on: every process runs all of it (collectives inside)."""
    import numpy as np
    import torch

    from ppo_cli.checkpoint import gathered_model_state, load_policy_and_value, load_training_state, recorded_mixed_precision
    from ppo_cli.collectives import enter as enter_phase
    from ppo_cli.commands.plan import planned_choices
    from ppo_cli.engine.engine import EngineOptions
    from ppo_cli.distributed import Distributed
    from ppo_cli.engine.engine import load_engine
    from ppo_cli.evaluation import held_out
    from ppo_cli.memory_peaks import phase_peak
    from ppo_cli.resource_errors import OutOfMemory
    from ppo_cli.resource_errors import phase as memory_phase
    from ppo_cli.resume import truncate_jsonl
    from ppo_cli.runs import discard_unstarted_run
    from ppo_cli.train_setup import init_state

    dist = Distributed.for_recipe(recipe, resumed_precision=recorded_mixed_precision(checkpoint))
    random.seed(recipe.seed)
    np.random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)

    started = time.perf_counter()
    phase_peaks: dict[str, float] = {}  # CUDA only: the most memory each phase outside the updates held
    choices = planned_choices(recipe, dist.device.type, dist.mixed_precision)
    checkpointing = choices.checkpointing
    if dist.is_main:
        show("loading", {"name": recipe.name, "precision": dist.precision.describe(),
                         "checkpointing": choices.describe()})
    try:
        with memory_phase("loading the models"), phase_peak(dist.device, phase_peaks, "loading"):
            engine = load_engine(recipe, dist.device, dist.mixed_precision, gradient_checkpointing=checkpointing.value,
                                 # FSDP on CPU: the option hands each gathered block back (Distributed.prepare)
                                 options=EngineOptions(cpu_malloc_tuning=choices.heap_tuning or dist.shards_parameters))
        if checkpoint is not None:  # before accelerate prepares the models: FSDP shards the loaded weights
            load_policy_and_value(engine.actor_critic, checkpoint)
        state = init_state(engine, prompts, dist)
    except OutOfMemory as err:
        raise advice_from_plan(err, recipe, recipe_path, dist.device, overrides) from err
    from ppo_cli.engine.chat import cut_prompts_note, plain_text_note

    if dist.is_main:
        for note in (plain_text_note(prompts, engine.tokenizer, recipe.data),
                     cut_prompts_note(prompts, engine.tokenizer, recipe.data) if recipe.environment is None else None):
            if note:
                show("note", {"message": note})
    if checkpoint is not None:  # read before _open_run_dir writes the recipe the run goes on with
        from ppo_cli.recipe_loading import load_recipe
        from ppo_cli.resume import resume_changes
        from ppo_cli.runs import RunDir

        changes = resume_changes(load_recipe(RunDir(recipe.run_dir).recipe), recipe)
    run_dir, footprint = _open_run_dir(recipe, overwrite, checkpoint is not None, dist)
    if checkpoint is not None:
        load_training_state(state, checkpoint)
        if dist.is_main:
            truncate_jsonl(run_dir.metrics, state.step)
            truncate_jsonl(run_dir.samples, state.step)
            show("resumed", {"checkpoint": str(checkpoint), "step": state.step, "changes": changes})
    try:
        enter_phase("evaluation")
        with (_gathered_for_evaluation(dist, state.model, eval_prompts),
              phase_peak(dist.device, phase_peaks, "evaluation before")):
            before = _evaluate_before(engine, eval_prompts, run_dir, recipe, dist)
        with StopOnSignal() as stop:
            observer = _train_loop(state, run_dir, stop, show)
    except BaseException as err:
        engine.sampler.close()  # a vLLM server's adapter directory goes before the run's files are taken back
        if footprint is not None and state.step == 0:
            discard_unstarted_run(run_dir, footprint)  # no update finished: leave no run to block or mislead
        if isinstance(err, OutOfMemory):
            raise advice_from_plan(err, recipe, recipe_path, dist.device, overrides) from err
        raise

    enter_phase("evaluation")
    with _gathered_for_evaluation(dist, state.model, eval_prompts), phase_peak(dist.device, phase_peaks, "evaluation after"):
        after = held_out(engine, eval_prompts, recipe.seed, dist) if eval_prompts else None
    enter_phase("checkpoint")
    full_state = gathered_model_state(state)  # FSDP: what trains, whole, gathered by every process
    # FSDP: final/ is written from full_state (--merge reloads the base from disk), so the sharded
    # weights need no gathering; ZeRO-3 saves from the modules, gathered here by every process.
    with contextlib.nullcontext() if dist.shards_parameters else dist.full_parameters(state.model):
        summary = _finish(state, run_dir, before, after, merge, started, observer, full_state,
                          phase_peaks=phase_peaks, choices=choices) if dist.is_main else {}
    dist.wait()
    engine.sampler.close()
    return TrainResult(run_dir.path, run_dir.final, summary)
