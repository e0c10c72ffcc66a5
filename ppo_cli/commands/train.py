"""`ppo train`: check everything cheap, load the engine, run the PPO loop, save final/."""

from __future__ import annotations

import json
import random
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ppo_cli.errors import UsageError
from ppo_cli.recipe import Recipe, dump_resolved


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


def preflight(recipe: Recipe) -> tuple[list[str], list[str]]:
    """Everything that can fail before a model is loaded: prompts, reward functions, model paths."""
    from ppo_cli.engine.data import read_prompts
    from ppo_cli.engine.models import check_model_reference
    from ppo_cli.engine.rewards import load_reward_function

    prompts = read_prompts(recipe.data.prompts, recipe.data.field).prompts
    eval_prompts = read_prompts(recipe.data.eval_prompts, recipe.data.field).prompts if recipe.data.eval_prompts else []
    for path in [recipe.policy.path, recipe.reference.path, recipe.value.path]:
        if path:
            check_model_reference(path)
    for component in recipe.reward.components:
        if component.type == "function":
            load_reward_function(component.function)
        else:
            check_model_reference(component.path)
    return prompts, eval_prompts


def evaluate(engine, prompts: list[str], seed: int) -> dict:
    """Mean score, EOS rate and length on held-out prompts, sampled with a fixed seed."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        generation = engine.generate(prompts)
        responses = engine.decode_responses(generation)
        result = engine.score(prompts, responses, generation)
    return {
        "score": sum(result.scores) / len(result.scores),
        "eos_rate": generation.finished.float().mean().item(),
        "response_length": generation.response_lengths.float().mean().item(),
        "samples": [
            {"prompt": p, "response": r, "score": s, "finished": bool(f)}
            for p, r, s, f in zip(prompts, responses, result.scores, generation.finished.tolist())
        ],
    }


def run(recipe: Recipe, recipe_path: Path | None = None, overwrite: bool = False, merge: bool = False,
        resume: str | None = None) -> TrainResult:
    if resume is not None:
        raise UsageError("--resume is not available yet", hint="start a new run (or --overwrite this one)")
    prompts, eval_prompts = preflight(recipe)

    import numpy as np
    import torch

    from ppo_cli import report
    from ppo_cli.checkpoint import save_checkpoint, save_final
    from ppo_cli.engine.models import resolve_dtype
    from ppo_cli.engine.session import load_engine
    from ppo_cli.runs import JsonlWriter, atomic_write_text, prepare_run_dir
    from ppo_cli.trainer import init_state, train

    run_dir = prepare_run_dir(recipe.output_dir, recipe.name, overwrite)
    atomic_write_text(run_dir.recipe, dump_resolved(recipe))
    random.seed(recipe.seed)
    np.random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)

    started = time.perf_counter()
    report.console.print(f"loading models for [bold]{recipe.name}[/] ...")
    engine = load_engine(recipe)
    state = init_state(engine, prompts)
    before = evaluate(engine, eval_prompts, recipe.seed) if eval_prompts else None

    metrics_writer, samples_writer = JsonlWriter(run_dir.metrics), JsonlWriter(run_dir.samples)
    try:
        with report.TrainProgress(recipe.train.total_updates, state.step, recipe.train.log_every) as progress:
            for metrics, rollout in train(state):
                if state.step % recipe.train.log_every == 0 or state.step == recipe.train.total_updates:
                    metrics_writer.write(metrics)
                sample_every = recipe.train.sample_every
                if sample_every and (state.step % sample_every == 0 or state.step == 1):
                    for i in range(min(recipe.train.num_samples, len(rollout.prompts))):
                        samples_writer.write({
                            "step": state.step, "prompt": rollout.prompts[i], "response": rollout.responses[i],
                            "score": float(rollout.scores[i]), "finished": bool(rollout.generation.finished[i]),
                        })
                progress.update(metrics)
                save_every = recipe.train.save_every
                if save_every and state.step % save_every == 0 and state.step < recipe.train.total_updates:
                    save_checkpoint(state, run_dir.checkpoints, recipe.train.keep_checkpoints)
    finally:
        metrics_writer.close()
        samples_writer.close()

    after = evaluate(engine, eval_prompts, recipe.seed) if eval_prompts else None
    info = {
        "policy_path": recipe.policy.path, "lora": recipe.policy.lora is not None, "value_kind": engine.actor_critic.value_kind,
        "step": state.step, "trust_remote_code": recipe.policy.trust_remote_code,
    }
    merge_dtype = resolve_dtype(recipe.policy.dtype, torch.device("cpu")) if merge else None
    save_final(engine.actor_critic, engine.tokenizer, run_dir.final, info, merge_dtype)
    if before is not None:
        atomic_write_text(run_dir.eval, json.dumps({"prompts": recipe.data.eval_prompts, "before": before, "after": after}, indent=2))
    summary = {
        "run_dir": str(run_dir.path), "final_dir": str(run_dir.final), "updates": state.step, "episodes": state.episodes,
        "seconds": time.perf_counter() - started, "peak_memory_gb": peak_memory_gb(),
        "before": {k: v for k, v in (before or {}).items() if k != "samples"},
        "after": {k: v for k, v in (after or {}).items() if k != "samples"},
    }
    atomic_write_text(run_dir.summary, json.dumps(summary, indent=2))
    report.print_train_summary(summary)
    return TrainResult(run_dir.path, run_dir.final, summary)
