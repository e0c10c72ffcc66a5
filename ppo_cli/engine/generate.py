"""Batched sampling with left padding, truncation after the stop token, response masks."""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch

from ppo_cli.engine.lean_lora import lean_lora
from ppo_cli.engine.models import unwrap_causal_lm
from ppo_cli.engine.packed_linear import packed_product, packing_pays
from ppo_cli.engine.shared_prompts import CACHE_ARGUMENT, shared_prefill, sharing_model
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
    """transformers' settings for a generate() call: its greedy loop, whose argmax picks the token after
    sampling_processors has warped the scores and drawn one token (the rest -inf)."""
    from transformers import GenerationConfig as HFGenerationConfig

    return HFGenerationConfig(
        do_sample=False,
        max_new_tokens=gen.max_new_tokens,
        eos_token_id=stop_token_id,
        pad_token_id=pad_token_id,
        use_cache=True,
    )


def sampling_processors(gen: GenerationConfig):
    """Exactly the recipe's sampling: PPO's log-probs are those of the full softmax at the temperature,
    so the samples must come from it too. transformers' own warpers, in the order its sampling applies
    them (temperature, top-k, top-p, min-p), then an inverse-CDF draw in place of its softmax + multinomial."""
    from transformers import (LogitsProcessorList, MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)

    processors = LogitsProcessorList()
    if gen.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(gen.temperature))
    if gen.top_k > 0:
        processors.append(TopKLogitsWarper(gen.top_k))
    if gen.top_p < 1.0:
        processors.append(TopPLogitsWarper(gen.top_p))
    if gen.min_p > 0.0:
        processors.append(MinPLogitsWarper(gen.min_p))
    processors.append(BlockedInverseCdfDraw())
    return processors


class BlockedInverseCdfDraw:
    """A draw from softmax(s) by its cumulative distribution, in two levels: a block of BLOCK tokens by
    the blocks' masses, then a token within the block by theirs. A logits processor: scores (B, V) ->
    (B, V), 0 at the drawn token and -inf elsewhere, so that transformers' greedy loop picks it.

        p_v = exp(s_v - max s)                       (B, V) float32; masked scores (-inf) give 0
        m_k = sum of p_v over block k                (B, ceil(V / BLOCK)) float64
        k   = the first block with cumsum(m)_k > u_1 sum(m),  u_1 ~ Uniform(0, 1)
        v   = the first token of block k with cumsum(p)_v > u_2 m_k,  u_2 ~ Uniform(0, 1)

    P(v) = m_k / sum(m) x p_v / m_k = softmax(s)_v: the distribution torch.multinomial draws from, to
    float32's rounding of p. A token of zero mass (masked by top-k, top-p or min-p) is never drawn.
    Two uniforms a row where the Gumbel-max trick (docs/benchmarks.md, Round 8) drew one for each of
    the V scores and took two logs of each: at 16 x 49,152, 4.5 ms a step of a single-threaded random
    number generator, against about 1.5 ms here (Round 11)."""

    BLOCK = 256

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rows, vocab = scores.shape
        s = scores.float()
        p = (s - s.amax(dim=-1, keepdim=True)).exp_()
        whole = vocab // self.BLOCK * self.BLOCK
        masses = p[:, :whole].view(rows, -1, self.BLOCK).sum(dim=-1, dtype=torch.float64)
        if whole < vocab:
            masses = torch.cat([masses, p[:, whole:].sum(dim=-1, keepdim=True, dtype=torch.float64)], dim=1)
        u = torch.rand(rows, 2, dtype=torch.float64, device=scores.device)
        block_cdf = masses.cumsum(dim=-1)
        block = torch.searchsorted(block_cdf, u[:, :1] * block_cdf[:, -1:], right=True).clamp_(max=masses.shape[1] - 1)
        columns = block * self.BLOCK + torch.arange(self.BLOCK, device=scores.device)  # (B, BLOCK)
        inside = p.gather(1, columns.clamp(max=vocab - 1)).double().masked_fill_(columns >= vocab, 0.0)
        token_cdf = inside.cumsum(dim=-1)
        offset = torch.searchsorted(token_cdf, u[:, 1:] * token_cdf[:, -1:], right=True).clamp_(max=self.BLOCK - 1)
        drawn = torch.full_like(s, -math.inf)
        return drawn.scatter_(1, columns.gather(1, offset), 0.0)


@contextlib.contextmanager
def without_hub_generation_defaults(model):
    """generate() fills every field left None with the model's generation_config.json (a hub model's
    top_k 20, repetition_penalty 1.05, suppress_tokens...) and then transformers' own defaults: a
    blank config for the duration of the call leaves only transformers' defaults, which are all off in
    its greedy loop (sampling_config): the recipe's warpers are sampling_processors'."""
    from transformers import GenerationConfig as HFGenerationConfig

    lm = unwrap_causal_lm(model)
    saved = lm.generation_config
    lm.generation_config = HFGenerationConfig()
    try:
        yield
    finally:
        lm.generation_config = saved


def reserved_cache_for(model, length: int):
    """A KV cache of ``length`` positions reserved up front (engine/reserved_cache.py) where the model
    takes a DynamicCache from its caller (the classes shared_prompts checked), else None: generate()'s own."""
    if not sharing_model(model):
        return None
    from ppo_cli.engine.reserved_cache import reserved_cache

    return reserved_cache(unwrap_causal_lm(model), length)


@contextlib.contextmanager
def no_checkpointing(model):
    """Gradient checkpointing off inside: for a generate() call.

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


@contextlib.contextmanager
def head_cast_once(model, pack_rows: int = 0):
    """Inside, under autocast, the LM head computes with its weight cast to the autocast dtype once, not
    at every decoding step: for a generate() call.

    A tied head (SmolLM2, Qwen2.5 up to 3B, Gemma) shares the embedding's float32 weight, which
    frozen_weights leaves float32 (the embedding's lookup is not autocast), and autocast caches casts
    only of leaves that require grad: at SmolLM2's 49,152 x 576 the cast took 6.5 ms a step, 5% of the
    sampling phase (AMD EPYC, 2 threads). The same numbers (autocast's cast is this ``.to``) for a
    copy of the head held while sampling (54 MiB at SmolLM2, 260 MiB at Qwen2.5's 151,936 x 896).
    With ``pack_rows`` (packed_linear.packing_pays) the bf16 copy is laid out for oneDNN once as well,
    a float32 or a bf16 head alike. A head that is not a plain Linear, or is trained, or whose weight
    is sharded or gathered by its own forward, is left as it is.
    """
    head = unwrap_causal_lm(model).get_output_embeddings()
    weight = head.weight if type(head) is torch.nn.Linear else None
    if (weight is None or weight.requires_grad
            or type(weight.data) is not torch.Tensor or weight.numel() == 0
            or not torch.is_autocast_enabled(weight.device.type)):
        yield
        return
    dtype = torch.get_autocast_dtype(weight.device.type)
    if pack_rows and dtype == torch.bfloat16:
        product = packed_product(weight, head.bias, pack_rows)
        head.forward = lambda hidden: product(hidden.to(dtype))
    elif weight.dtype == torch.float32:
        cast_weight = weight.detach().to(dtype)
        cast_bias = None if head.bias is None else head.bias.detach().to(dtype)
        head.forward = lambda hidden: torch.nn.functional.linear(hidden, cast_weight, cast_bias)
    else:
        yield
        return
    try:
        yield
    finally:
        del head.forward


# Set on a model by Distributed.rollout_parameters when its blocks gather in their own forwards.
DECODE_IN_STEP = "_ppo_cli_decode_in_step"

# Rows whose stop token was just sampled, with their response ids so far (stop token included).
OnFinished = Callable[[list[int], list[list[int]]], None]


def finished_rows_watcher(prompt_width: int, stop_token_id: int, on_finished: OnFinished):
    """A transformers StoppingCriteria that never stops anything: after each decoding step it hands
    the rows that have just sampled their stop token to ``on_finished`` (reward requests go out while
    the other rows are still decoding: engine/rewards/stream.py). A finished row is padded from then
    on, possibly with the stop token itself, so each row is handed over once."""
    from transformers import StoppingCriteria

    class FinishedRows(StoppingCriteria):
        def __init__(self):
            self.done: torch.Tensor | None = None  # (B,) bool

        def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
            ended = input_ids[:, -1] == stop_token_id
            if self.done is None:
                self.done = torch.zeros_like(ended)
            new = ended & ~self.done
            if new.any():  # syncs with the GPU once a step, as transformers' own stop check does
                self.done |= new
                rows = new.nonzero().squeeze(-1).tolist()
                on_finished(rows, input_ids[rows, prompt_width:].tolist())
            return torch.zeros_like(ended)

    return FinishedRows()


# no_grad, not inference_mode: inference tensors could not be fed to the update's autograd later.
@torch.no_grad()
def generate(model, prompt_ids, prompt_mask, gen: GenerationConfig, stop_token_id: int, pad_token_id: int,
             on_finished: OnFinished | None = None, share_prompts: bool = True) -> Generation:
    """Sample one response per prompt row. The global torch RNG drives sampling (seed it first).
    ``on_finished``: told of each row as soon as its stop token is sampled (finished_rows_watcher).
    ``share_prompts``: rows with the same prompt prefill it once (shared_prompts.shared_prefill).

    A collective only inside Distributed.rollout_parameters under FSDP per_block, which marks the
    model: each block all-gathers in its forward, so every process decodes in step until all have
    finished (transformers' synced_gpus). Everywhere else callers hold the full parameters and each
    process decodes alone: left to itself, transformers would turn ``synced_gpus`` on for any
    FSDP-managed model with several processes, and a process that generates alone (or for fewer
    prompts, or stops earlier) would wait forever."""
    config = sampling_config(gen, stop_token_id, pad_token_id)
    in_step = bool(getattr(model, DECODE_IN_STEP, False))
    extra = {}
    if on_finished is not None:
        from transformers import StoppingCriteriaList

        extra["stopping_criteria"] = StoppingCriteriaList([finished_rows_watcher(prompt_ids.shape[1], stop_token_id, on_finished)])
    packs = gen.pack_weights and not in_step and packing_pays(prompt_ids.device, gen.max_new_tokens)
    pack_rows = prompt_ids.shape[0] if packs else 0
    lean = contextlib.nullcontext() if in_step else lean_lora(model, pack_rows)
    with (no_checkpointing(model), without_hub_generation_defaults(model), head_cast_once(model, pack_rows),
          lean):
        # a per-block gather decodes in step: every process the same calls, transformers' own cache
        cache = None if in_step else reserved_cache_for(model, prompt_ids.shape[1] + gen.max_new_tokens)
        if share_prompts and not in_step:
            prefilled = shared_prefill(model, prompt_ids, prompt_mask, cache)
            cache = cache if prefilled is None else prefilled
        if cache is not None:
            extra[CACHE_ARGUMENT] = cache
        out = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask.long(), generation_config=config,
                             logits_processor=sampling_processors(gen), synced_gpus=in_step, **extra)
    raw_response = out[:, prompt_ids.shape[1]:]
    response_ids, response_mask, finished = truncate_after_stop(raw_response, stop_token_id, pad_token_id)
    # generate() stops early when every row is done; pad to a fixed T so shapes never vary.
    missing = gen.max_new_tokens - response_ids.shape[1]
    if missing > 0:
        response_ids = torch.nn.functional.pad(response_ids, (0, missing), value=pad_token_id)
        response_mask = torch.nn.functional.pad(response_mask, (0, missing), value=False)
    return Generation(prompt_ids, prompt_mask, response_ids, response_mask, finished, response_mask)  # one turn: all sampled


class _SampledTokenLogprobs:
    """Forward hook on a causal LM inside generate(): the log-prob of each sampled token under the
    distribution it was sampled from, log_softmax(model logits / temperature), taken from the model's
    own output (so after any soft-capping or logit scaling its forward applies).

    Step t's logits are kept until step t + 1's forward, whose input is the token sampled from them;
    only one (B, V) row block is held at a time. The last step's token never goes back into the model,
    so ``finish`` takes it from the returned response.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.pending: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def _resolve(self, tokens: torch.Tensor) -> None:
        logprobs = self.pending.log_softmax(-1)
        self.steps.append(logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
        self.pending = None

    def __call__(self, module, args, kwargs, output) -> None:
        if self.pending is not None:
            self._resolve(kwargs["input_ids"][:, -1])
        self.pending = output.logits[:, -1].float() / self.temperature

    def finish(self, response_ids: torch.Tensor) -> torch.Tensor:
        """(B, S) log-probs of the S generated steps. ``response_ids`` (B, T): the sampled tokens; past a
        row's stop token they are padding, but those columns lie outside its response mask."""
        if self.pending is not None:
            self._resolve(response_ids[:, len(self.steps)])
        return torch.stack(self.steps, dim=1)


@torch.no_grad()
def generate_with_logprobs(model, prompt_ids, prompt_mask, gen: GenerationConfig, stop_token_id: int,
                           pad_token_id: int, keep_hidden: bool,
                           on_finished: OnFinished | None = None) -> tuple[Generation, torch.Tensor, torch.Tensor | None]:
    """generate(), plus the log-prob (B, T) of every sampled token under the distribution it was
    sampled from, and with ``keep_hidden`` the decoder's last hidden state (B, T, H) that sampled it.

    Taken from the generation's own KV-cached forward passes, so the rollout needs no second policy
    forward for the old log-probs (and values, with a value head on the policy). Row t is what
    logprobs.causal_lm_forward gives at response position t for the finished sequences. Columns after
    the last generation step (all rows stopped) are 0 and lie outside every response mask.
    """
    lm = unwrap_causal_lm(model)
    sampled = _SampledTokenLogprobs(gen.temperature)
    hidden_steps: list[torch.Tensor] = []
    handles = [lm.register_forward_hook(sampled, with_kwargs=True)]
    if keep_hidden:
        handles.append(lm.get_decoder().register_forward_hook(lambda module, args, out: hidden_steps.append(out[0][:, -1])))
    try:
        # no shared prefill: its decoder call would reach the hidden-state hook as a step
        generation = generate(model, prompt_ids, prompt_mask, gen, stop_token_id, pad_token_id, on_finished,
                              share_prompts=False)
    finally:
        for handle in handles:
            handle.remove()
    T = generation.response_ids.shape[1]
    logprobs = _pad_columns(sampled.finish(generation.response_ids), T)
    hidden = _pad_columns(torch.stack(hidden_steps, dim=1), T) if keep_hidden else None
    return generation, logprobs, hidden


def _pad_columns(steps: torch.Tensor, width: int) -> torch.Tensor:
    """(B, S, ...) -> (B, width, ...), zeros after the S generated steps."""
    missing = width - steps.shape[1]
    if missing <= 0:
        return steps[:, :width]
    pad = torch.zeros((steps.shape[0], missing, *steps.shape[2:]), dtype=steps.dtype, device=steps.device)
    return torch.cat([steps, pad], dim=1)


def trim_padding(generation: Generation) -> Generation:
    """Drop response columns after the longest real response: no training forward pays for them."""
    longest = int(generation.response_mask.sum(dim=1).max().item()) if generation.response_mask.numel() else 0
    longest = max(longest, 1)
    return generation._replace(
        response_ids=generation.response_ids[:, :longest],
        response_mask=generation.response_mask[:, :longest],
        action_mask=generation.action_mask[:, :longest],
    )
