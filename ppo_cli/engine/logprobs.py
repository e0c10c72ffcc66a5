"""A model's forward at the response positions: its logits (for per-token log-probs) or its hidden states
(what a value head reads; the ActorCritic's forwards that add values are engine/actor_critic.py).

Shapes: B sequences, L = P + T tokens (left-padded prompt of P, right-padded response of T), H hidden,
V vocabulary. Position t of the response is predicted by position P - 1 + t, so the outputs are
(B, T) and line up with ``response_ids``.

Log-probs come from the model's own forward (``model(...).logits``), never from applying the LM head
to hidden states here: several architectures change their logits after the LM head (Gemma 2/3's
final-logit soft-capping, Granite's ``logits_scaling``, Cohere's ``logit_scale``), and ``generate()``
samples from those real logits. Logits are divided by the sampling temperature in rollout and update
alike, so the PPO ratio is 1 at the first step.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from ppo_cli.engine.models import unwrap_causal_lm


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) positions counted over real tokens only, as generate() does with left padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


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
