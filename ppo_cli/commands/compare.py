"""`ppo compare A B`: both models on the same prompts with the same seed, side by side.

Each model is evaluated exactly as `ppo eval` does (``evaluate_model``), one after the other with a
shared reward; rows are paired by (prompt, sample). The summary adds the mean reward difference
B - A with a paired bootstrap 95% interval and B's win rate (ties count half).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ppo_cli.commands.eval import describe_run, evaluate_model
from ppo_cli.evaluation import Progress, SamplingSettings, summarize_rows
from ppo_cli.model_refs import ResolvedModel
from ppo_cli.recipe import Recipe

OUT_FILES = ("compare.md", "compare.json", "rows.jsonl")


@dataclass
class CompareResult:
    a: dict  # settings and metrics of model A (as `ppo eval` reports them)
    b: dict
    pairs: list[dict]  # per (prompt, sample): prompt, a_response, a_reward, a_finished, b_... (+ tokens, kl)
    difference: dict  # mean_reward_diff (B - A), ci95 [low, high], win_rate_b, pairs, bootstrap settings
    files: list[Path] = field(default_factory=list)


def pair_rows(rows_a: list[dict], rows_b: list[dict]) -> list[dict]:
    """One row per (prompt, sample) with both models' response, reward, EOS, length and KL."""
    pairs = []
    for a, b in zip(rows_a, rows_b, strict=True):
        pair = {"prompt_index": a["prompt_index"], "sample": a["sample"], "prompt": a["prompt"]}
        for side, row in (("a", a), ("b", b)):
            pair.update({f"{side}_response": row["response"], f"{side}_reward": row["reward"],
                         f"{side}_finished": row["finished"], f"{side}_response_tokens": row["response_tokens"],
                         f"{side}_kl": row["kl"]})
            if "messages" in row:  # an episode of several turns: the response is its last message
                pair.update({f"{side}_turns": row["turns"], f"{side}_tool_calls": row["tool_calls"],
                             f"{side}_ended_by": row["ended_by"], f"{side}_messages": row["messages"]})
        pairs.append(pair)
    return pairs


def difference(pairs: list[dict], seed: int, n_resamples: int = 2000) -> dict:
    from ppo_cli.stats import bootstrap_mean_diff_ci, mean, win_rate

    # a pair in which either reward failed (None) compares nothing: left out, and counted
    scored = [p for p in pairs if p["a_reward"] is not None and p["b_reward"] is not None]
    a, b = [p["a_reward"] for p in scored], [p["b_reward"] for p in scored]
    low, high = bootstrap_mean_diff_ci(a, b, seed=seed, n_resamples=n_resamples)
    return {"mean_reward_diff": mean(b) - mean(a), "ci95": [low, high], "win_rate_b": win_rate(a, b),
            "pairs": len(scored), "pairs_without_reward": len(pairs) - len(scored), "bootstrap": {"resamples": n_resamples, "seed": seed, "method": "paired percentile"}}


def run(recipe: Recipe, model_a: ResolvedModel, model_b: ResolvedModel, prompts: list[str],
        settings: SamplingSettings, *, prompts_source: str, out_dir: Path | None = None,
        progress: Progress | None = None, columns=None) -> CompareResult:
    from ppo_cli.engine.inference import load_reward_stack

    reward = load_reward_stack(recipe, columns, prompts_source)
    rows_a = evaluate_model(recipe, model_a, prompts, settings, reward, progress)
    rows_b = evaluate_model(recipe, model_b, prompts, settings, reward, progress)
    pairs = pair_rows(rows_a, rows_b)
    result = CompareResult(
        a={**describe_run(recipe, model_a, prompts_source, len(prompts), settings), **summarize_rows(rows_a)},
        b={**describe_run(recipe, model_b, prompts_source, len(prompts), settings), **summarize_rows(rows_b)},
        pairs=pairs,
        difference=difference(pairs, settings.seed),
    )
    if out_dir is not None:
        result.files = write_outputs(result, Path(out_dir))
    return result


def write_outputs(result: CompareResult, out_dir: Path) -> list[Path]:
    """compare.md, compare.json and rows.jsonl in ``out_dir``, each written atomically."""
    from ppo_cli.report import compare_markdown
    from ppo_cli.runs import atomic_write_text, write_jsonl_atomic

    md, js, rows = (out_dir / name for name in OUT_FILES)
    summary = {"a": result.a, "b": result.b, "difference": result.difference}
    atomic_write_text(md, compare_markdown(result.a, result.b, result.difference, result.pairs))
    atomic_write_text(js, json.dumps({**summary, "rows": result.pairs}, indent=2, ensure_ascii=False) + "\n")
    write_jsonl_atomic(rows, result.pairs)
    return [md, js, rows]
