"""Batched sampling with left padding, truncation after the stop token, response masks."""

from __future__ import annotations

import contextlib

import torch

from ppo_cli.engine.models import unwrap_causal_lm
from ppo_cli.errors import RecipeError
from ppo_cli.recipe import GenerationConfig
from ppo_cli.types import Generation


def resolve_stop_token_id(tokenizer, stop_token: str | None) -> int:
    """The id that ends a response: the tokenizer's EOS by default (TRL: stop_token='eos')."""
    if stop_token is None or stop_token == "eos":
        if tokenizer.eos_token_id is None:
            raise RecipeError("the tokenizer has no EOS token", hint="set generation.stop_token to a token of the vocabulary")
        return tokenizer.eos_token_id
    ids = tokenizer.convert_tokens_to_ids([stop_token])
    if not ids or ids[0] is None or ids[0] == tokenizer.unk_token_id:
        raise RecipeError(f"generation.stop_token {stop_token!r} is not a single token of the vocabulary")
    return ids[0]


def truncate_after_stop(response_ids: torch.Tensor, stop_token_id: int, pad_token_id: int):
    """Keep tokens up to and including the first stop token; pad after it.

    (B, T) -> response_ids (B, T), response_mask (B, T) bool, finished (B,) bool.
    """
    is_stop = response_ids == stop_token_id
    finished = is_stop.any(dim=1)
    # Index of the first stop token, T when there is none.
    first_stop = torch.where(finished, is_stop.int().argmax(dim=1), response_ids.shape[1])
    positions = torch.arange(response_ids.shape[1], device=response_ids.device)
    response_mask = positions.unsqueeze(0) <= first_stop.unsqueeze(1)
    return response_ids.masked_fill(~response_mask, pad_token_id), response_mask, finished


def sampling_config(gen: GenerationConfig, stop_token_id: int, pad_token_id: int):
    """Exactly the recipe's sampling: PPO's log-probs are those of the full softmax at the temperature,
    so the samples must come from it too (top_k 0 is passed as 0: None would become transformers' 50)."""
    from transformers import GenerationConfig as HFGenerationConfig

    return HFGenerationConfig(
        do_sample=True,
        max_new_tokens=gen.max_new_tokens,
        temperature=gen.temperature,
        top_k=gen.top_k,
        top_p=gen.top_p,
        eos_token_id=stop_token_id,
        pad_token_id=pad_token_id,
        use_cache=True,
    )


@contextlib.contextmanager
def without_hub_generation_defaults(model):
    """generate() fills every field left None with the model's generation_config.json (a hub model's
    top_k 20, repetition_penalty 1.05, suppress_tokens...) and then transformers' own defaults: a
    blank config for the duration of the call leaves only transformers' defaults, which are all off
    except top_k (set explicitly by sampling_config)."""
    from transformers import GenerationConfig as HFGenerationConfig

    lm = unwrap_causal_lm(model)
    saved = lm.generation_config
    lm.generation_config = HFGenerationConfig()
    try:
        yield
    finally:
        lm.generation_config = saved


@contextlib.contextmanager
def no_checkpointing(model):
    """Gradient checkpointing off for the duration of a generate() call.

    transformers drops the KV cache inside a checkpointed layer in train mode (the policy always is:
    see models.py), so with checkpointing on, generate() would attend over the newest token only.
    """
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True


# no_grad, not inference_mode: inference tensors could not be fed to the update's autograd later.
@torch.no_grad()
def generate(model, prompt_ids, prompt_mask, gen: GenerationConfig, stop_token_id: int, pad_token_id: int) -> Generation:
    """Sample one response per prompt row. The global torch RNG drives sampling (seed it first)."""
    config = sampling_config(gen, stop_token_id, pad_token_id)
    with no_checkpointing(model), without_hub_generation_defaults(model):
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(), generation_config=config)
    raw_response = out[:, prompt_ids.shape[1]:]
    response_ids, response_mask, finished = truncate_after_stop(raw_response, stop_token_id, pad_token_id)
    # generate() stops early when every row is done; pad to a fixed T so shapes never vary.
    missing = gen.max_new_tokens - response_ids.shape[1]
    if missing > 0:
        response_ids = torch.nn.functional.pad(response_ids, (0, missing), value=pad_token_id)
        response_mask = torch.nn.functional.pad(response_mask, (0, missing), value=False)
    return Generation(prompt_ids, prompt_mask, response_ids, response_mask, finished)


@torch.no_grad()
def generate_with_hidden(model, prompt_ids, prompt_mask, gen: GenerationConfig, stop_token_id: int,
                         pad_token_id: int) -> tuple[Generation, torch.Tensor]:
    """generate(), plus the decoder's last hidden state (B, T, H) that sampled each response token.

    Row t is the state at position P - 1 + t (the one that predicts response token t), exactly what
    logprobs.response_slice(backbone_hidden(...)) gives for the finished sequences, but taken from the
    generation's own KV-cached forward passes, so the rollout needs no second policy forward for the
    old log-probs (and values, with a value head on the policy). Columns after the last generation step
    (all rows stopped) are 0 and lie outside every response mask.
    """
    steps: list[torch.Tensor] = []
    decoder = unwrap_causal_lm(model).get_decoder()
    handle = decoder.register_forward_hook(lambda module, args, out: steps.append(out[0][:, -1]))
    try:
        generation = generate(model, prompt_ids, prompt_mask, gen, stop_token_id, pad_token_id)
    finally:
        handle.remove()
    B, T = generation.response_ids.shape
    hidden = torch.stack(steps[:T], dim=1)
    if hidden.shape[1] < T:
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, T - hidden.shape[1]))
    return generation, hidden


def trim_padding(generation: Generation) -> Generation:
    """Drop response columns after the longest real response: no training forward pays for them."""
    longest = int(generation.response_mask.sum(dim=1).max().item()) if generation.response_mask.numel() else 0
    longest = max(longest, 1)
    return generation._replace(
        response_ids=generation.response_ids[:, :longest],
        response_mask=generation.response_mask[:, :longest],
    )
