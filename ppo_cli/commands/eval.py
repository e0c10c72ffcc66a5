"""`ppo eval`: sample, score and summarise one model on a set of prompts.

It is `ppo rollout` (``sample_rows``) then `ppo score` (``score_rows``) in one process, plus the KL
to the reference (all three in evaluation.py); so rollout -> score on the same prompts, seed and
settings gives the same mean reward as eval.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ppo_cli.evaluation import (
    Progress,
    SamplingSettings,
    generation_settings,
    model_path,
    sample_rows,
    score_rows,
    summarize_rows,
)
from ppo_cli.model_refs import ResolvedModel
from ppo_cli.recipe import Recipe


@dataclass
class EvalResult:
    summary: dict  # JSON-ready: settings and metrics (see summarize_rows)
    out: Path | None


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
        prompts_source: str, out: Path | None = None, progress: Progress | None = None, columns=None) -> EvalResult:
    """``columns``: the prompts' other columns (engine/data.PromptColumns), given to rewards that read them."""
    from ppo_cli.engine.inference import load_reward_stack
    from ppo_cli.runs import atomic_write_text

    rows = evaluate_model(recipe, model, prompts, settings, load_reward_stack(recipe, columns, prompts_source), progress)
    summary = {**describe_run(recipe, model, prompts_source, len(prompts), settings), **summarize_rows(rows)}
    if out is not None:
        atomic_write_text(Path(out), json.dumps(summary, indent=2) + "\n")
    return EvalResult(summary, Path(out) if out is not None else None)
