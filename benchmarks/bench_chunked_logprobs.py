#!/usr/bin/env python
"""Peak memory and CPU seconds of one update's policy forward + backward: whole logits against chunks.

    python benchmarks/bench_chunked_logprobs.py [--sequences 16] [--prompt 16] [--response 48] [--threads 2]
                                                 [--layers 30] [--vocab 49152] [--entropy-bonus]
                                                 [--malloc tuned|return|glibc]

At SmolLM2-135M's shape (LlamaConfig: hidden 576, 30 layers, 9 heads of 64, 3 KV heads, MLP 1536,
vocabulary 49,152, tied embeddings), random weights (no download), LoRA r16 on every linear layer as
the GRPO recipes train it, float32. Each path runs in a fresh child process so that its peak RSS is
its own (``ru_maxrss``):

- ``whole``: the model's own ``forward().logits`` (B, T, V), then gather - logsumexp and the entropy
  over them (the path before issue 33, kept as the fallback for classes not in HEAD_STEPS);
- ``chunked``: engine/logprobs.py's response_logprobs (LM head per chunk, checkpointed).

The loss is GRPO's shape: -mean(log-probs x advantages) (+ 0.01 x entropy with --entropy-bonus),
one backward. ``--malloc``: ``tuned`` (default) as ``ppo train`` runs on CPU (engine/malloc.py's
keep_freed_memory: blocks up to 32 MB stay in the heap), ``return`` (every block of 1 MB or more mapped
on its own and unmapped when freed: the RSS then follows the live tensors), ``glibc`` (its defaults).
Reported per path: the RSS after building the model (the base), the peak during the
update, the update's own increment (peak - base), CPU seconds of the update (process_time, all
threads) and its wall seconds. Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e9


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


def child(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    import ppo_cli.engine.logprobs as lp

    from ppo_cli.engine import malloc

    {"tuned": malloc.keep_freed_memory, "return": malloc.return_freed_memory, "glibc": lambda: None}[args.malloc]()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True,
                         max_position_embeddings=2048, rms_norm_eps=1e-5)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.train()
    if args.path == "whole":  # the fallback: the model's own forward().logits, whole (the path before chunking)
        lp.logprob_path = lambda model: "model logits"
    B, P, T = args.sequences, args.prompt, args.response
    sequences = torch.randint(3, config.vocab_size, (B, P + T))
    attention_mask = torch.ones(B, P + T, dtype=torch.bool)
    attention_mask[: B // 2, : P // 2] = False  # half the rows left-padded
    advantages = torch.randn(B, T)
    base = rss_gb()
    cpu, wall = time.process_time(), time.perf_counter()
    logprobs, entropies, _ = lp.response_logprobs(model, sequences, attention_mask, sequences[:, -T:], 0.7,
                                                  "grad" if args.entropy_bonus else "value")
    loss = -(logprobs * advantages).mean() - (0.01 * entropies.mean() if args.entropy_bonus else 0.0)
    loss.backward()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"path": args.path, "base_gb": base, "peak_gb": peak_rss_gb(), "update_gb": peak_rss_gb() - base,
            "cpu_s": cpu, "wall_s": wall, "loss": float(loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--response", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=49152, help="151936: Qwen2.5's vocabulary on the same layers")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--entropy-bonus", action="store_true")
    parser.add_argument("--malloc", choices=["tuned", "return", "glibc"], default="tuned")
    parser.add_argument("--path", choices=["whole", "chunked"], help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    if args.path:
        print(json.dumps(child(args)))
        return
    rows = []
    for path in ("whole", "chunked"):
        argv = [sys.executable, __file__, "--path", path] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("path", "entropy_bonus")]
        argv += ["--entropy-bonus"] if args.entropy_bonus else []
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{args.sequences} sequences x ({args.prompt} + {args.response}) tokens, vocabulary {args.vocab}, "
          f"{args.layers} layers, LoRA r16, float32, {args.threads} threads, entropy {'bonus' if args.entropy_bonus else 'metric'}, "
          f"malloc {args.malloc}")
    print("| path | RSS after load | peak RSS | update's increment | CPU s | wall s | loss |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['path']} | {r['base_gb']:.2f} GB | {r['peak_gb']:.2f} GB | {r['update_gb']:.2f} GB | "
              f"{r['cpu_s']:.1f} | {r['wall_s']:.1f} | {r['loss']:.6f} |")
    whole, chunked = rows
    print(f"chunked / whole: peak {chunked['peak_gb'] / whole['peak_gb']:.2f}x, "
          f"increment {chunked['update_gb'] / whole['update_gb']:.2f}x, CPU {chunked['cpu_s'] / whole['cpu_s']:.2f}x")


if __name__ == "__main__":
    main()
