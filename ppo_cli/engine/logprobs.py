"""A model's forward at the response positions: its logits (for per-token log-probs) or its hidden states
(what a value head reads; the ActorCritic's forwards that add values are engine/actor_critic.py).

Shapes: B sequences, L = P + T tokens (left-padded prompt of P, right-padded response of T), H hidden,
V vocabulary. Position t of the response is predicted by position P - 1 + t, so the outputs are
(B, T) and line up with ``response_ids``.

Log-probs (and entropies) come in chunks of response positions (``response_logprobs``): per chunk the
LM head, the model's own step after it, the temperature, log-softmax at the token and entropy, so no
(B, T, V) float32 logits are ever held; with gradients each chunk is recomputed in the backward
(``torch.utils.checkpoint``), which then holds one chunk's logits at a time. Several architectures
change their logits after the LM head (Gemma 2/3's final-logit soft-capping, Granite's
``logits_scaling``, Cohere's ``logit_scale``) and ``generate()`` samples from those real logits: the
step is reproduced only for the model classes whose transformers 5.24 forward was read
(``HEAD_STEPS``); any other class takes the model's own ``forward().logits`` (``causal_lm_forward``),
whole. Logits are divided by the sampling temperature in rollout and update alike, so the PPO ratio
is 1 at the first step.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ppo_cli.algo.losses import entropy_from_logits
from ppo_cli.engine.models import unwrap_causal_lm
from ppo_cli.engine.shared_prompts import model_mask, position_ids_from_mask, shared_layout

# Logits per chunk (positions x vocabulary): 32 MiB of float32, 170 positions at SmolLM2's 49,152
# tokens, 55 at Qwen2.5's 151,936. The softmax and entropy temporaries are a few times that.
LOGITS_PER_CHUNK = 2**23


def backbone_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Last hidden states (B, L, H) of a causal LM's decoder (no LM head) or of a bare backbone."""
    lm = unwrap_causal_lm(model)
    decoder = lm.get_decoder() if lm.get_output_embeddings() is not None else lm
    out = decoder(
        input_ids=input_ids,
        attention_mask=attention_mask.long(),
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return out.last_hidden_state


def response_slice(hidden: torch.Tensor, response_len: int) -> torch.Tensor:
    """Rows (B, T, ...) at the positions that predict the T response tokens, from (B, L, ...)."""
    return hidden[:, -response_len - 1 : -1]


@functools.lru_cache(maxsize=None)
def _accepts_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def causal_lm_forward(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                      temperature: float, keep_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's own logits at the response positions, divided by ``temperature`` (B, T, V) float32,
    and with ``keep_hidden`` its decoder's last hidden states there (B, T, H), from the same forward.

    ``logits_to_keep`` computes logits for the last T + 1 positions only (the last one predicts past
    the response and is dropped); models without it (remote code) compute them all and are sliced.
    """
    lm = unwrap_causal_lm(model)
    captured: list[torch.Tensor] = []
    handle = None
    if keep_hidden:
        handle = lm.get_decoder().register_forward_hook(lambda module, args, out: captured.append(out[0]))
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask.long(),
                  position_ids=position_ids_from_mask(attention_mask), use_cache=False)
    if _accepts_logits_to_keep(type(lm)):
        kwargs["logits_to_keep"] = response_len + 1
    try:
        logits = model(**kwargs).logits
    finally:
        if handle is not None:
            handle.remove()
    logits = response_slice(logits, response_len).float() / temperature
    return logits, (response_slice(captured[0], response_len) if keep_hidden else None)


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor, chunk_rows: int = 8) -> torch.Tensor:
    """log_softmax(logits)[..., index] as gather - logsumexp, (B, T, V), (B, T) -> (B, T).

    Never materialises a full (B, T, V) log-softmax; rows are processed in chunks so the
    logsumexp temporary stays small at large vocabularies. Half-precision rows are upcast chunk by
    chunk, so the result is float32 whatever the model dtype.
    """
    out = []
    for rows, idx in zip(logits.split(chunk_rows), index.split(chunk_rows)):
        rows = rows.float() if rows.dtype in (torch.float16, torch.bfloat16) else rows
        picked = rows.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        out.append(picked - torch.logsumexp(rows, dim=-1))
    return torch.cat(out)


# --- log-probs without whole logits -----------------------------------------------------------------

def _identity(logits: torch.Tensor) -> torch.Tensor:
    return logits


def _softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    # Gemma2ForCausalLM / Gemma3ForCausalLM.forward: three steps in this order (bitwise the same).
    logits = logits / cap
    logits = torch.tanh(logits)
    return logits * cap


def _divide(logits: torch.Tensor, by: float) -> torch.Tensor:
    return logits / by  # GraniteForCausalLM.forward: logits / config.logits_scaling


def _multiply(logits: torch.Tensor, by: float) -> torch.Tensor:
    return logits * by  # CohereForCausalLM.forward: logits * self.logit_scale


def _softcap_step(lm: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    cap = lm.config.final_logit_softcapping
    return _identity if cap is None else functools.partial(_softcap, cap=cap)


# Model class -> what its forward does to the LM head's output, read in transformers 5.24's modeling
# files (forward: hidden = decoder(...).last_hidden_state; logits = lm_head(hidden[:, -keep:]); then
# this). tests/engine/test_architectures.py checks each against forward().logits; a class not listed
# takes its own forward's logits.
HEAD_STEPS: dict[str, Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor]]] = {
    **{name: (lambda lm: _identity) for name in (
        "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
        "Phi3ForCausalLM", "GPT2LMHeadModel", "GPTNeoXForCausalLM", "OPTForCausalLM", "Olmo2ForCausalLM")},
    "Gemma2ForCausalLM": _softcap_step,
    "Gemma3ForCausalLM": _softcap_step,
    "GraniteForCausalLM": lambda lm: functools.partial(_divide, by=lm.config.logits_scaling),
    "CohereForCausalLM": lambda lm: functools.partial(_multiply, by=lm.logit_scale),
}


def logprob_path(model: nn.Module) -> str:
    """"chunked" where the model's step after its LM head is reproduced here, else "model logits"."""
    lm = unwrap_causal_lm(model)
    cls = type(lm)
    # transformers' own class, not remote code that reuses its name
    known = cls.__name__ in HEAD_STEPS and cls.__module__.startswith("transformers.models.")
    return "chunked" if known and _accepts_logits_to_keep(cls) and lm.get_output_embeddings() is not None else "model logits"


def response_hidden(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    response_len: int) -> torch.Tensor:
    """The decoder's last hidden states (B, T, H) at the positions predicting the response, from the
    model's own forward (peft's, the hooks of a distributed wrapper) asked for one position's logits;
    rows that share a prompt run it once (engine/shared_prompts.py), where the model and the cost allow."""
    lm = unwrap_causal_lm(model)
    captured: list[torch.Tensor] = []
    handle = lm.get_decoder().register_forward_hook(lambda module, args, out: captured.append(out[0]))
    shared = shared_layout(model, input_ids, attention_mask, response_len)
    if shared is None:
        ids, mask, positions = input_ids, attention_mask.long(), position_ids_from_mask(attention_mask)
    else:  # each distinct prompt once for its completions (engine/shared_prompts.py)
        ids, mask, positions = shared.input_ids, model_mask(model, shared.attention_mask), shared.position_ids
    kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    if _accepts_logits_to_keep(type(lm)):
        kwargs["logits_to_keep"] = 1
    try:
        model(**kwargs)
    finally:
        handle.remove()
    if shared is None:
        return response_slice(captured[0], response_len)
    return captured[0][shared.rows[:, None], shared.predicting]


def _chunk_logprobs(hidden: torch.Tensor, index: torch.Tensor, head: nn.Module, step, temperature: float,
                    entropy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, H), (n,) -> log-probs (n,) and entropies (n,) float32 (zeros with ``entropy`` "none"):
    the ops of causal_lm_forward + selective_log_softmax + entropy_from_logits, on n positions."""
    logits = step(head(hidden)).float() / temperature  # (n, V)
    logprobs = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    if entropy == "none":
        return logprobs, torch.zeros_like(logprobs)
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        return logprobs, entropy_from_logits(logits)


def chunked_logprobs(hidden: torch.Tensor, response_ids: torch.Tensor, head: nn.Module, step, temperature: float,
                     entropy: str = "none", logits_per_chunk: int = LOGITS_PER_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``response_ids`` and entropies, (B, T, H), (B, T) -> (B, T), (B, T) float32, a chunk of
    positions at a time through ``step(head(hidden)) / temperature``.

    ``entropy``: "none" (zeros), "value" (no gradient), "grad" (differentiable, for an entropy bonus).
    With gradients each chunk runs under ``torch.utils.checkpoint``: the forward keeps only the chunk's
    (n, H) input, the backward recomputes its (n, V) logits, so one chunk's logits live at a time.
    """
    B, T, H = hidden.shape
    rows = max(1, logits_per_chunk // head.weight.shape[0])
    flat, index = hidden.reshape(B * T, H), response_ids.reshape(B * T)
    logprobs, entropies = [], []
    for part, idx in zip(flat.split(rows), index.split(rows)):
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_logprobs, part, idx, head, step, temperature, entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(part, idx, head, step, temperature, entropy)
        logprobs.append(lp)
        entropies.append(ent)
    return torch.cat(logprobs).view(B, T), torch.cat(entropies).view(B, T)


def response_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      response_ids: torch.Tensor, temperature: float, entropy: str = "none", keep_hidden: bool = False,
                      logits_per_chunk: int = LOGITS_PER_CHUNK):
    """(log-probs (B, T), entropies (B, T), hidden (B, T, H) or None) of the response tokens under the model
    at ``temperature``, with input (B, L) and ``response_ids`` (B, T) its last T tokens.

    Chunked (``chunked_logprobs``) where ``logprob_path`` says so; else the model's own logits (B, T, V)
    and the same arithmetic over them. ``entropy`` as in chunked_logprobs.
    """
    T = response_ids.shape[1]
    if logprob_path(model) == "chunked":
        lm = unwrap_causal_lm(model)
        hidden = response_hidden(model, input_ids, attention_mask, T)
        logprobs, entropies = chunked_logprobs(hidden, response_ids, lm.get_output_embeddings(), HEAD_STEPS[type(lm).__name__](lm),
                                               temperature, entropy, logits_per_chunk)
        return logprobs, entropies, (hidden if keep_hidden else None)
    logits, hidden = causal_lm_forward(model, input_ids, attention_mask, T, temperature, keep_hidden=keep_hidden)
    logprobs = selective_log_softmax(logits, response_ids)
    if entropy == "none":
        return logprobs, torch.zeros_like(logprobs), hidden
    with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
        return logprobs, entropy_from_logits(logits), hidden
