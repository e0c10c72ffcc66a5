"""`ppo rollout`: sample responses from one model, one JSON object per (prompt, sample).

``sample_rows`` is also the first half of `ppo eval` and `ppo compare`, so all three sample the same
way: the shared Engine (same loading, same generate()), prompts repeated ``num_samples`` times, split
into batches of ``batch_size``, and torch seeded once with ``seed`` before the first batch. Same
model, prompts, seed and settings -> the same responses.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ppo_cli.model_refs import ResolvedModel
from ppo_cli.recipe import Recipe

Progress = Callable[[int], None]  # called with the number of rows just finished


@dataclass(frozen=True)
class SamplingSettings:
    seed: int
    num_samples: int = 1  # responses per prompt
    batch_size: int = 16  # prompts per generate() call


@dataclass
class RolloutResult:
    out: Path
    rows: int
    prompts: int
    model: str  # the reference, described for people


def generation_settings(recipe: Recipe) -> dict:
    """The sampling settings a row records, so a rollout file says how it was made."""
    gen = recipe.generation
    return {"backend": gen.backend, "max_new_tokens": gen.max_new_tokens, "temperature": gen.temperature, "top_k": gen.top_k,
            "top_p": gen.top_p, "stop_token": gen.stop_token, "chat_template": recipe.data.chat_template,
            "system_prompt": recipe.data.system_prompt, "max_prompt_tokens": recipe.data.max_prompt_tokens}


def sample_rows(engine, model: ResolvedModel, prompts: list[str], settings: SamplingSettings, *,
                with_kl: bool = False, progress: Progress | None = None) -> list[dict]:
    """Sample ``settings.num_samples`` responses per prompt; one row dict per (prompt, sample).

    With ``with_kl`` each row also gets ``kl``: sum over its response tokens of the k1 estimate
    log pi(y_t) - log pi_ref(y_t), from the same log-prob code as training.
    """
    import torch

    torch.manual_seed(settings.seed)
    episodes = [(i, s, p) for i, p in enumerate(prompts) for s in range(settings.num_samples)]
    common = {"model": model.reference, "model_path": model_path(model), "seed": settings.seed,
              "generation": generation_settings(engine.recipe)}
    rows: list[dict] = []
    for start in range(0, len(episodes), settings.batch_size):
        batch = episodes[start : start + settings.batch_size]
        generation = engine.generate([p for _, _, p in batch])
        responses = engine.decode_responses(generation)
        kl = sequence_kl(engine, generation).tolist() if with_kl else None
        prompt_tokens = generation.prompt_mask.sum(dim=1).tolist()
        response_tokens = generation.response_lengths.tolist()
        for j, (index, sample, prompt) in enumerate(batch):
            row = {"prompt": prompt, "response": responses[j], "finished": bool(generation.finished[j]),
                   "prompt_tokens": int(prompt_tokens[j]), "response_tokens": int(response_tokens[j]),
                   "prompt_index": index, "sample": sample, **common}
            if kl is not None:
                row["kl"] = float(kl[j])
            rows.append(row)
        if progress is not None:
            progress(len(batch))
    return rows


def sequence_kl(engine, generation):
    """(B,) KL to the reference per response: sum_t k1_t over the response mask."""
    from ppo_cli.algo.kl import kl_penalty

    logprobs, ref_logprobs, _, _ = engine.evaluate_logprobs_and_values(generation, engine.recipe.ppo.micro_batch_size)
    kl = kl_penalty(logprobs, ref_logprobs, "k1").masked_fill(~generation.response_mask, 0.0)  # (B, T)
    return kl.sum(dim=1)


def model_path(model: ResolvedModel) -> str:
    """The directory a row names as its model: the adapter's, else the weights'."""
    return str(model.adapter_dir) if model.adapter_dir is not None else model.weights_path


def release(engine) -> None:
    """Free a model before loading the next one (compare loads two in turn)."""
    import gc

    import torch

    engine.actor_critic = None
    if engine.sampler is not None:  # vLLM's engine and its KV cache
        engine.sampler.close()
        engine.sampler = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run(recipe: Recipe, model: ResolvedModel, prompts: list[str], settings: SamplingSettings, out: Path,
        progress: Progress | None = None) -> RolloutResult:
    from ppo_cli.engine.inference import load_inference_engine
    from ppo_cli.runs import write_jsonl_atomic

    engine = load_inference_engine(recipe, model)
    rows = sample_rows(engine, model, prompts, settings, progress=progress)
    write_jsonl_atomic(out, rows)
    return RolloutResult(Path(out), len(rows), len(prompts), model.describe())
