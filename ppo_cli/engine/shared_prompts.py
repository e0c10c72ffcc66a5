"""One forward per distinct prompt: the completions of a prompt share its positions.

GRPO, RLOO and every group estimator sample G completions of each prompt, and the rollout's, the
reference's and the update's forwards would run each prompt G times. Here the rows of a batch whose
prompt columns are the same (the same ids and padding) are packed instead, ``k`` completions to a row,

    [prompt | response 1 | ... | response k]       (R packed rows of width W = P + k * T)

under a 4D attention mask in which response j sees the prompt's real tokens and its own earlier tokens
only, and every token keeps the position id it had in its own row (position_ids_from_mask). Each real
token attends to exactly the keys, at exactly the positions, it did in the plain batch: the hidden
states are those of the plain forward up to float rounding (other matmul shapes), and so are their
gradients (tests/engine/test_shared_prompts.py, on the architecture matrix). Prefix Grouper (Liu et
al., 2025) shares a GRPO group's prefix the same way.

A packed row's attention costs W^2 query-key pairs where the plain batch costs (P + T)^2 per row:
``completions_per_row`` weighs the linear layers' work per token against attention's per pair and
keeps the plain batch where sharing would not pay (long responses, one completion per prompt).

Shapes: B rows of L = P + T tokens (left-padded prompt of P, right-padded response of T), R packed
rows of W tokens, H hidden.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn

from ppo_cli.engine.models import unwrap_causal_lm

# transformers' own classes whose forward takes a prepared 4D mask as is and its position_ids from the
# caller (transformers 5.24, masking_utils._preprocess_mask_arguments): each is checked against its plain
# forward by tests/engine/test_shared_prompts.py. A class not listed runs the plain batch.
SHARING_CLASSES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "GPT2LMHeadModel", "GPTNeoXForCausalLM",
    "OPTForCausalLM", "GraniteForCausalLM", "CohereForCausalLM", "Olmo2ForCausalLM",
})
# The mask each attention implementation reads: sdpa a boolean one (True attends), eager an additive one.
MASK_KINDS = ("sdpa", "eager")
ENABLED = True  # benchmarks/bench_shared_prompts.py switches it off for its A/B


def _cache_argument() -> str:
    """The name forward() and generate() take a prepared KV cache by: ``cache`` in transformers 5.24 (the
    version read; ``past_key_values`` warns there and leaves by 6), ``past_key_values`` before it."""
    import transformers
    from packaging.version import Version

    return "cache" if Version(transformers.__version__) >= Version("5.24") else "past_key_values"


CACHE_ARGUMENT = _cache_argument()
# The prefill's own forward call costs about a decoding step, whose B rows are dominated by per-layer
# overheads: measured (AMD EPYC, 2 threads, 16 rows) sharing saved 5% of sampling with 4 prompts of 37
# tokens (432 prefill tokens saved) and cost 6% with prompts of 5 (48 saved). Shared where it saves at
# least this many prompt tokens per row.
PREFILL_TOKENS_PER_STEP = 8


class SharedPrompts(NamedTuple):
    """A packed batch, and where each original row's response positions are in it."""

    input_ids: torch.Tensor  # (R, W)
    attention_mask: torch.Tensor  # (R, 1, W, W) bool: query attends key
    position_ids: torch.Tensor  # (R, W): each token's position in its own row
    rows: torch.Tensor  # (B,) the packed row of each original row
    predicting: torch.Tensor  # (B, T) the packed column whose hidden state predicts each response token


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """(B,) group index of each row: rows with the same prompt ids and padding share one."""
    real = attention_mask[:, :prompt_len].long()
    key = torch.cat([input_ids[:, :prompt_len] * real, real], dim=1)
    return torch.unique(key, dim=0, return_inverse=True)[1]


def rank_in_group(groups: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B,): 0, 1, 2, ... for the rows of each group, in row order."""
    order = torch.sort(groups, stable=True).indices
    in_order = groups[order]
    first = torch.searchsorted(in_order, in_order)  # each row's group starts here in sorted order
    rank = torch.empty_like(groups)
    rank[order] = torch.arange(groups.numel(), device=groups.device) - first
    return rank


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) positions counted over real tokens only, as generate() does with left padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def packed_rows(group_sizes: list[int], prompt_len: int, response_len: int, per_row: int) -> tuple[int, int]:
    """(R, W): the packed rows of groups of these sizes, ``per_row`` completions to a row (a group of n
    takes ceil(n / per_row) rows), and their width W = prompt_len + per_row * response_len (fewer where
    no group has that many)."""
    rows = sum(math.ceil(n / per_row) for n in group_sizes)
    return rows, prompt_len + min(per_row, max(group_sizes)) * response_len


def completions_per_row(group_sizes: list[int], prompt_len: int, response_len: int, token_cost: float,
                        pair_cost: float) -> int:
    """k (1 = the plain batch) minimising sum over the packed rows (packed_rows) of W * token_cost +
    W^2 * pair_cost."""
    def cost(k: int) -> float:
        rows, width = packed_rows(group_sizes, prompt_len, response_len, k)
        return rows * (width * token_cost + width * width * pair_cost)

    return min(range(1, max(group_sizes) + 1), key=lambda k: (cost(k), k))


def pair_and_token_cost(hidden: int, intermediate: int) -> tuple[float, float]:
    """(token_cost, pair_cost) for completions_per_row, in multiply-adds per layer: per token the attention
    projections and a gated MLP; per query-key pair the scores and the weighted values over every head."""
    return 4 * hidden * hidden + 3 * hidden * intermediate, 2 * hidden


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_len: int, groups: torch.Tensor,
         per_row: int) -> SharedPrompts:
    """The packed batch of (B, L) rows grouped by ``groups``, ``per_row`` completions to a packed row."""
    B, L = input_ids.shape
    T, P, device = response_len, L - response_len, input_ids.device
    rank = rank_in_group(groups)
    slot = rank % per_row  # the response's place in its packed row
    rows = torch.unique(groups * B + rank // per_row, return_inverse=True)[1]
    R, W = int(rows.max()) + 1, P + (int(slot.max()) + 1) * T

    real = attention_mask.bool()
    positions = position_ids_from_mask(attention_mask)
    packed_ids = torch.zeros(R, W, dtype=input_ids.dtype, device=device)
    packed_real = torch.zeros(R, W, dtype=torch.bool, device=device)
    packed_positions = torch.zeros(R, W, dtype=torch.long, device=device)
    segment = torch.zeros(R, W, dtype=torch.long, device=device)  # 0 the prompt, j the j-th response
    # A group's rows have the same prompt columns: each writes them, identically.
    packed_ids[rows, :P], packed_real[rows, :P], packed_positions[rows, :P] = input_ids[:, :P], real[:, :P], positions[:, :P]
    columns = P + slot[:, None] * T + torch.arange(T, device=device)  # (B, T)
    at = (rows[:, None].expand(B, T), columns)
    packed_ids[at], packed_real[at], packed_positions[at] = input_ids[:, P:], real[:, P:], positions[:, P:]
    segment[at] = (slot + 1)[:, None].expand(B, T)

    index = torch.arange(W, device=device)
    causal = index[None, :] <= index[:, None]  # (W query, W key)
    same_or_prompt = (segment[:, None, :] == 0) | (segment[:, None, :] == segment[:, :, None])
    mask = causal[None] & packed_real[:, None, :] & same_or_prompt
    # A padding position attends itself: no query row is all masked (softmax of nothing is NaN, and a NaN
    # there would reach the real positions' gradients through 0 * NaN); no real token ever reads it.
    mask |= torch.eye(W, dtype=torch.bool, device=device)
    # Response token t is predicted at the column before it: the prompt's last for t = 0.
    predicting = torch.cat([torch.full((B, 1), P - 1, device=device), columns[:, :-1]], dim=1)
    return SharedPrompts(packed_ids, mask[:, None], packed_positions, rows, predicting)


def sharing_model(model: nn.Module) -> bool:
    """Whether the model's forward takes a packed batch (its class read, a mask kind it reads)."""
    lm = unwrap_causal_lm(model)
    cls = type(lm)
    return (ENABLED and cls.__name__ in SHARING_CLASSES and cls.__module__.startswith("transformers.models.")
            and getattr(lm.config, "_attn_implementation", None) in MASK_KINDS)


def shared_layout(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  response_len: int) -> SharedPrompts | None:
    """The packed batch where the model takes one and sharing pays (``completions_per_row``), else None."""
    if not sharing_model(model):
        return None
    B, L = input_ids.shape
    P = L - response_len
    config = unwrap_causal_lm(model).config.get_text_config()
    window = getattr(config, "sliding_window", None)
    if window is not None and L > window:  # a 4D mask replaces the window, which would then apply
        return None
    groups = prompt_groups(input_ids, attention_mask, P)
    sizes = torch.bincount(groups).tolist()
    if max(sizes) == 1:
        return None
    hidden = config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    per_row = completions_per_row(sizes, P, response_len, *pair_and_token_cost(hidden, intermediate))
    return None if per_row == 1 else pack(input_ids, attention_mask, response_len, groups, per_row)


def model_mask(model: nn.Module, mask: torch.Tensor) -> torch.Tensor:
    """The packed boolean mask as the model's attention reads it: eager adds 0 or the dtype's minimum."""
    lm = unwrap_causal_lm(model)
    if lm.config._attn_implementation == "sdpa":
        return mask
    dtype = lm.get_input_embeddings().weight.dtype
    dtype = dtype if dtype.is_floating_point else torch.float32
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def whole_local_weights(model: nn.Module) -> bool:
    """Every parameter a plain, whole tensor of this process: the decoder can be called on its own, outside
    the causal LM's forward (not FSDP's DTensors, whose hooks the root's forward sets up, nor ZeRO-3's
    empty partitions)."""
    return all(type(p.data) is torch.Tensor and p.numel() > 0 for p in model.parameters())


@torch.no_grad()
def shared_prefill(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, cache=None):
    """A KV cache of every row's prompt but its last token, (B, P - 1), computed once per distinct prompt
    and repeated over its rows, for ``generate(past_key_values=...)``, whose first step then runs the
    last prompt token of every row; None where too few prompt tokens repeat, the model is not listed or
    its weights are sharded. ``cache``: an empty cache to fill (else a DynamicCache).

    Only the decoder runs (the cache is all generate needs), so hooks on the causal LM see no extra call.
    """
    if not sharing_model(model) or not whole_local_weights(model):
        return None
    groups = prompt_groups(prompt_ids, prompt_mask, prompt_ids.shape[1])
    B, distinct = prompt_ids.shape[0], int(groups.max()) + 1
    if (B - distinct) * (prompt_ids.shape[1] - 1) < PREFILL_TOKENS_PER_STEP * B:
        return None  # the prefill saved would not pay for the extra forward call (none for a 1-token prompt)
    from transformers import DynamicCache

    lm = unwrap_causal_lm(model)
    first = torch.empty(distinct, dtype=torch.long, device=groups.device)
    first[groups] = torch.arange(groups.numel(), device=groups.device)  # a row of each group (any: the same prompt)
    ids, mask = prompt_ids[first, :-1], prompt_mask[first, :-1].long()
    cache = DynamicCache(config=lm.config) if cache is None else cache
    lm.get_decoder()(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                     use_cache=True, **{CACHE_ARGUMENT: cache})
    cache.reorder_cache(groups)
    return cache

