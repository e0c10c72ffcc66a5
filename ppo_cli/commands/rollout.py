"""`ppo rollout`: sample responses from one model, one JSON object per (prompt, sample).

It samples as `ppo eval`, `ppo compare` and `ppo train`'s held-out evaluation do (evaluation.py's
``sample_rows``, on the shared Engine): same model, prompts, seed and settings -> the same responses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ppo_cli.evaluation import Progress, SamplingSettings, env_failures, sample_rows
from ppo_cli.model_refs import ResolvedModel
from ppo_cli.recipe import Recipe


@dataclass
class RolloutResult:
    out: Path
    rows: int
    prompts: int
    model: str  # the reference, described for people
    env_failed: int = 0  # episodes of several turns whose environment failed
    env_failure: str | None = None  # the first one's failure


def release(engine) -> None:
    """Free a model before loading the next one (compare loads two in turn)."""
    import gc

    import torch

    engine.actor_critic = None
    engine.sampler.close()  # vLLM's engine and its KV cache go with the last reference below
    engine.sampler = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(recipe: Recipe, model: ResolvedModel, prompts: list[str], settings: SamplingSettings, out: Path,
        progress: Progress | None = None, columns=None, tokens: bool = False) -> RolloutResult:
    """``columns``: the prompts' other columns (engine/data.PromptColumns): each row keeps its
    prompt's under "columns", for `ppo score` to give to the rewards that read them. ``tokens``: each row
    also gets token_ids, loss_mask and logprobs (evaluation.token_fields): what training would see."""
    from ppo_cli.engine.inference import load_inference_engine
    from ppo_cli.runs import write_jsonl_atomic

    engine = load_inference_engine(recipe, model, columns=columns)
    try:
        rows = sample_rows(engine, model, prompts, settings, with_tokens=tokens, progress=progress)
    finally:  # a vLLM server's copy of the adapter is unloaded, as eval and compare do
        release(engine)
    if columns is not None and columns.names:
        found = columns.columns_for([row["prompt"] for row in rows])
        for i, row in enumerate(rows):
            row["columns"] = {name: values[i] for name, values in found.items() if values[i] is not None}
    write_jsonl_atomic(out, rows)
    return RolloutResult(Path(out), len(rows), len(prompts), model.describe(), *env_failures(rows))
