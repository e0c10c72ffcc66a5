"""`ppo eval`: sample, score and summarise one model on a set of prompts.

It is `ppo rollout` (``sample_rows``) then `ppo score` (``score_rows``) in one process, plus the KL
to the reference; so rollout -> score on the same prompts, seed and settings gives the same mean
reward as eval.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ppo_cli.commands.rollout import Progress, SamplingSettings, generation_settings, model_path, sample_rows
from ppo_cli.commands.score import score_rows
from ppo_cli.model_refs import ResolvedModel
from ppo_cli.recipe import Recipe


@dataclass
class EvalResult:
    summary: dict  # JSON-ready: settings and metrics (see summarize_rows)
    out: Path | None


def summarize_rows(rows: list[dict]) -> dict:
    """Metrics of scored rows (each with reward, reward_components, finished, response, response_tokens, kl)."""
    from ppo_cli.commands.score import scored_mean
    from ppo_cli.stats import distinct_n, mean, summarize

    rewards = [r["reward"] for r in rows if r["reward"] is not None]  # rows a reward failed to score: counted apart
    names = list(rows[0]["reward_components"]) if rows else []
    return {
        "reward": summarize(rewards),
        "reward_failed": len(rows) - len(rewards),
        "reward_components": {n: scored_mean([r["reward_components"][n] for r in rows]) for n in names},
        "eos_rate": mean([1.0 if r["finished"] else 0.0 for r in rows]),
        "response_length": mean([float(r["response_tokens"]) for r in rows]),
        "kl": mean([r["kl"] for r in rows]) if rows and "kl" in rows[0] else None,
        "distinct_1": distinct_n([r["response"] for r in rows], 1),
        "distinct_2": distinct_n([r["response"] for r in rows], 2),
    }


def evaluate_model(recipe: Recipe, model: ResolvedModel, prompts: list[str], settings: SamplingSettings,
                   reward, progress: Progress | None = None) -> list[dict]:
    """Scored rows (with ``kl``) of one model; the model is loaded, used and released."""
    from ppo_cli.commands.rollout import release
    from ppo_cli.engine.inference import load_inference_engine

    engine = load_inference_engine(recipe, model, reward)
    try:
        rows = sample_rows(engine, model, prompts, settings, with_kl=True, progress=progress)
    finally:
        release(engine)
    return score_rows(reward, rows)


def describe_run(recipe: Recipe, model: ResolvedModel, prompts_source: str, n_prompts: int, settings: SamplingSettings) -> dict:
    return {
        "model": model.reference, "model_path": model_path(model), "base_model": model.base_path,
        "description": model.describe(), "recipe": recipe.name, "prompts": prompts_source,
        "num_prompts": n_prompts, "num_samples": settings.num_samples, "seed": settings.seed,
        "generation": generation_settings(recipe),
    }


def run(recipe: Recipe, model: ResolvedModel, prompts: list[str], settings: SamplingSettings, *,
        prompts_source: str, out: Path | None = None, progress: Progress | None = None) -> EvalResult:
    from ppo_cli.engine.inference import load_reward_stack
    from ppo_cli.runs import atomic_write_text

    rows = evaluate_model(recipe, model, prompts, settings, load_reward_stack(recipe), progress)
    summary = {**describe_run(recipe, model, prompts_source, len(prompts), settings), **summarize_rows(rows)}
    if out is not None:
        atomic_write_text(Path(out), json.dumps(summary, indent=2) + "\n")
    return EvalResult(summary, Path(out) if out is not None else None)
