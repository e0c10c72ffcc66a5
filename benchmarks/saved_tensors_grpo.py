#!/usr/bin/env python
"""What the update's forward keeps for the backward, by kind: one GRPO micro-batch of SmolLM2 through
ppo_cli's own log-prob path (engine/logprobs.py response_logprobs), LoRA r16 all-linear, counted with
torch.autograd.graph.saved_tensors_hooks (each storage once). Issue 33 item 0: which tensors put the
update's forward above TRL's.

    python benchmarks/saved_tensors_grpo.py [--rows 16] [--new-tokens 48] [--autocast bf16] [--checkpointing]

No backward runs: the forward alone is what the phase trace (bench_vs_trl_grpo.py) shows growing.
Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def kind_of(shape: tuple, hidden: int, inter: int, r: int, vocab: int, heads: int) -> str:
    """A saved tensor's kind from its shape (SmolLM2: hidden 576, intermediate 1536, LoRA r 16)."""
    last = shape[-1] if shape else 0
    if len(shape) == 4 and shape[1] in (heads, 3):
        return "attention (B, heads, L, L or head_dim)"
    if last == vocab:
        return "logits chunk (rows, V)"
    if last == hidden:
        return "hidden (B, L, H)"
    if last == inter:
        return "MLP intermediate (B, L, I)"
    if last == r:
        return "LoRA A output (B, L, r)"
    if last in (192, 64):  # k/v projections (3 KV heads x 64)
        return "k/v projection (B, L, 192)"
    return "other"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / ".cache" / "smollm2-0.1.2"))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--autocast", choices=("no", "bf16"), default="no")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    from ppo_cli.engine.logprobs import response_logprobs

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    cfg = model.config
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()  # as ppo_cli's policy (dropout is 0): transformers checkpoints layers only in train mode
    L = args.prompt_tokens + args.new_tokens
    ids = torch.randint(0, cfg.vocab_size, (args.rows, L))
    mask = torch.ones_like(ids)
    response = ids[:, -args.new_tokens:]
    seen, by_kind = set(), defaultdict(lambda: [0, 0])
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # saved by reference: no memory

    def pack(t):
        try:
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        except RuntimeError:
            return t
        if key not in seen and key[0] not in weights:  # parameters are not activations
            seen.add(key)
            entry = by_kind[kind_of(tuple(t.shape), cfg.hidden_size, cfg.intermediate_size, 16, cfg.vocab_size,
                                    cfg.num_attention_heads)]
            entry[0] += key[1]
            entry[1] += 1
        return t

    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if args.autocast == "bf16" else contextlib.nullcontext())
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        out = response_logprobs(model, ids, mask, response, 1.0)
    del out
    total = sum(b for b, _ in by_kind.values())
    print(json.dumps({"rows": args.rows, "L": L, "autocast": args.autocast, "checkpointing": args.checkpointing,
                      "total_gb": total / 1e9,
                      "by_kind_gb": {k: [round(b / 1e9, 3), n] for k, (b, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0])}},
                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
