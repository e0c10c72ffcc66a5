#!/usr/bin/env python
"""Log-probs of the sampled tokens: gather - logsumexp (ppo_cli) against log_softmax + gather.

    python benchmarks/bench_logprobs.py [--batch 8] [--tokens 24] [--vocab 1090 151936] [--repeats 5]

For each vocabulary size: median seconds of forward + backward through each, and the extra memory the
forward keeps for the backward (bytes of the tensors autograd saves, measured with saved-tensor hooks).
The update's logits themselves (B x T x V float32) are the same for both and not counted.
Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ppo_cli.engine.logprobs import selective_log_softmax


def full_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)


def measure(fn, logits: torch.Tensor, index: torch.Tensor, repeats: int) -> tuple[float, int]:
    saved = []

    def pack(tensor):
        shares_logits = tensor.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
        saved.append(0 if shares_logits else tensor.numel() * tensor.element_size())
        return tensor

    times = []
    for i in range(repeats + 1):
        x = logits.detach().requires_grad_(True)
        saved.clear()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(x, index)
        out.sum().backward()
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return statistics.median(times), sum(saved)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--vocab", type=int, nargs="+", default=[1090, 151936])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from ppo_cli.engine.precision_probe import machine_record

    print(f"machine: {machine_record()}", flush=True)  # every figure below was measured on it
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print("| vocab | logits MB | log_softmax + gather s | saved MB | gather - logsumexp s | saved MB |")
    print("|---|---|---|---|---|---|")
    for vocab in args.vocab:
        logits = torch.randn(args.batch, args.tokens, vocab)
        index = torch.randint(vocab, (args.batch, args.tokens))
        full_s, full_saved = measure(full_log_softmax, logits, index, args.repeats)
        ours_s, ours_saved = measure(selective_log_softmax, logits, index, args.repeats)
        print(f"| {vocab:,} | {logits.numel() * 4 / 1e6:.0f} | {full_s:.4f} | {full_saved / 1e6:.1f} | "
              f"{ours_s:.4f} | {ours_saved / 1e6:.1f} |")


if __name__ == "__main__":
    main()
