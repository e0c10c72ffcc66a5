#!/usr/bin/env python
"""Where a gradient-checkpointed update's memory goes at the SmolLM2 shape: live tensor bytes against RSS.

    python benchmarks/checkpointed_update_memory.py [--checkpointing on|off] [--malloc tuned|off]
        [--rows 8] [--prompt-tokens 43] [--new-tokens 96] [--threads 1] [--steps 2]

Loads the engine as `ppo train recipes/smollm2_concise.yaml` does (LoRA r16 all-linear, value head,
float32, .cache/smollm2-0.1.2), then runs ``--steps`` update micro-batches (the PolicyAndValue forward
the trainer calls, a loss over its outputs, the backward) on random token ids of the recipe's shape
(8 x (43 + 96)). For each step it prints, in GB:

- ``saved``: what the forward keeps for the backward (saved-tensor hooks, each storage once, the
  parameters left out), and how many decoder layers ran under checkpointing (a hook on each layer's
  ``_gradient_checkpointing_func``);
- ``live_*``: torch's CPU allocations alive (torch.profiler's memory events summed over time) at the
  forward's start, its end and its peak, and the backward's peak, relative to the step's start;
- ``rss_*``: the resident set at the same points (a thread samples /proc/self/statm every 2 ms) and
  glibc's heap (mallinfo2: bytes in use, and held in total).

``--malloc off`` leaves glibc's thresholds as they are (EngineOptions
cpu_malloc_tuning False). Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_bytes() -> tuple[int, int]:
    """glibc: (bytes in use, bytes held: the heap arenas + mmapped blocks)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd, info.arena + info.hblkhd


class RssPeak:
    """The largest RSS seen since ``reset`` (a sampler thread; torch releases the GIL in its kernels)."""

    def __init__(self, interval_s: float = 0.002):
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(interval_s)

    def reset(self) -> int:
        """The peak so far (with the RSS now), then start again from the RSS now."""
        now = rss_bytes()
        peak, self.peak = max(self.peak, now), now
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def live_bytes_timeline(prof) -> list[tuple[int, int]]:
    from torch.autograd import DeviceType

    """(time ns, torch CPU bytes alive relative to the profile's start) after each allocation or free."""
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == DeviceType.CPU)
    out, live = [], 0
    for t, delta in events:
        live += delta
        out.append((t, live))
    return out


def large_allocations(prof, start: int, end: int, at_least: int = 2**20) -> dict[str, int]:
    """{size in MB: count} of the allocations of ``at_least`` bytes or more between ``start`` and ``end``."""
    from collections import Counter

    from torch.autograd import DeviceType

    sizes = Counter(round(e.nbytes() / 2**20, 1) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and e.device_type() == DeviceType.CPU and e.nbytes() >= at_least
                    and start <= e.start_ns() <= end)
    return {f"{mb:g}": n for mb, n in sorted(sizes.items(), key=lambda kv: -kv[0] * kv[1])[:12]}


def range_of(prof, name: str) -> tuple[int, int]:
    (e,) = [e for e in prof.profiler.kineto_results.events() if e.name() == name]
    return e.start_ns(), e.end_ns()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpointing", choices=("on", "off"), default="on")
    ap.add_argument("--malloc", choices=("tuned", "off"), default="tuned")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=43)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--model", default=str(ROOT / ".cache" / "smollm2-0.1.2"))
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--mmap-threshold-mib", type=float, default=None,
                    help="after loading, mallopt(M_MMAP_THRESHOLD): blocks of this size or more mapped on their own")
    ap.add_argument("--reentrant", action="store_true",
                    help="torch.utils.checkpoint(use_reentrant=True) (the layers' forward under no_grad) instead of ppo_cli's")
    ap.add_argument("--no-profile", action="store_true", help="RSS and heap only (the profiler's own records off)")
    ap.add_argument("--logits-per-chunk", type=int, default=None, help="engine/logprobs.LOGITS_PER_CHUNK")
    args = ap.parse_args(argv)
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from ppo_cli.engine.actor_critic import PolicyAndValue
    from ppo_cli.engine.engine import EngineOptions, load_engine
    from ppo_cli.recipe_loading import load_recipe

    torch.set_num_threads(args.threads)
    sets = [f"policy.path={args.model}", "train.total_updates=5", "train.sample_every=0", *args.set]
    recipe = load_recipe(ROOT / "recipes" / "smollm2_concise.yaml", sets)
    rss_start = rss_bytes()
    engine = load_engine(recipe, torch.device("cpu"), "no", EngineOptions(cpu_malloc_tuning=args.malloc == "tuned"),
                         gradient_checkpointing=args.checkpointing == "on")
    ac = engine.actor_critic
    if args.mmap_threshold_mib is not None:
        from ppo_cli.engine.malloc import M_MMAP_THRESHOLD, _mallopt

        _mallopt()(M_MMAP_THRESHOLD, int(args.mmap_threshold_mib * 2**20))
    if args.logits_per_chunk is not None:
        import ppo_cli.engine.logprobs as logprobs_module

        defaults = list(logprobs_module.chunked_logprobs.__defaults__)
        defaults[-1] = args.logits_per_chunk
        logprobs_module.chunked_logprobs.__defaults__ = tuple(defaults)
        defaults = list(logprobs_module.response_logprobs.__defaults__)
        defaults[-1] = args.logits_per_chunk
        logprobs_module.response_logprobs.__defaults__ = tuple(defaults)
    model = PolicyAndValue(ac)
    layers = [m for m in ac.policy.modules() if hasattr(m, "_gradient_checkpointing_func")]
    if args.reentrant:
        import functools

        from torch.utils.checkpoint import checkpoint

        ac.policy.enable_input_require_grads()  # reentrant: the layer inputs must require grad
        for layer in layers:
            layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=True)
    checkpointed = {"calls": 0}
    for layer in layers:  # count the layers whose forward goes through the checkpoint function
        original = layer._gradient_checkpointing_func

        def counting(*a, _original=original, **k):
            checkpointed["calls"] += 1
            return _original(*a, **k)

        layer._gradient_checkpointing_func = counting
    print(json.dumps({"torch": torch.__version__, "threads": args.threads, "malloc": args.malloc,
                      "mmap_threshold_mib": args.mmap_threshold_mib, "logits_per_chunk": args.logits_per_chunk,
                      "reentrant": args.reentrant,
                      "checkpointing": args.checkpointing, "loaded_rss_gb": rss_bytes() / 1e9,
                      "process_rss_before_load_gb": rss_start / 1e9,
                      "decoder_layers_with_flag": sum(bool(getattr(m, "gradient_checkpointing", False)) for m in layers),
                      "decoder_layers": len(layers), "policy_training": ac.policy.training}), flush=True)
    params = {p.untyped_storage().data_ptr() for p in ac.parameters()}
    g = torch.Generator().manual_seed(0)
    B, P, T = args.rows, args.prompt_tokens, args.new_tokens
    vocab = ac.policy.get_output_embeddings().weight.shape[0]
    peak = RssPeak()
    for step in range(args.steps):
        sequences = torch.randint(0, vocab, (B, P + T), generator=g)
        attention_mask = torch.ones(B, P + T, dtype=torch.bool)
        response_ids = sequences[:, -T:]
        saved: dict[tuple[int, int], int] = {}

        def pack(t):
            try:
                storage = t.untyped_storage()
            except RuntimeError:
                return t
            if storage.data_ptr() not in params:
                saved[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
            return t

        checkpointed["calls"] = 0
        cpu0 = time.process_time()
        rss0, heap0 = rss_bytes(), heap_bytes()
        peak.reset()
        profiler = (contextlib.nullcontext() if args.no_profile
                    else profile(activities=[ProfilerActivity.CPU], profile_memory=True))
        with profiler as prof:
            with record_function("forward"):
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    logprobs, entropies, values = model(sequences, attention_mask, response_ids, 0.7, None, entropy="value")
                    loss = -(logprobs.mean() + entropies.mean() * 0) + (values ** 2).mean()
            fwd_rss_peak, fwd_heap = peak.reset(), heap_bytes()
            fwd_rss_end = rss_bytes()
            with record_function("backward"):
                loss.backward()
            bwd_rss_peak = peak.reset()
            del logprobs, entropies, values, loss
            ac.zero_grad(set_to_none=True)
        end_rss, end_heap = rss_bytes(), heap_bytes()
        timeline = live_bytes_timeline(prof) if prof is not None else []
        (f0, f1), (b0, b1) = (range_of(prof, "forward"), range_of(prof, "backward")) if prof is not None else ((0, 0), (0, 0))
        last = lambda t: ([live for s, live in timeline if s <= t] or [0])[-1]  # noqa: E731
        live_fwd_peak = max([live for s, live in timeline if f0 <= s <= f1] or [0])
        live_bwd_peak = max([live for s, live in timeline if b0 <= s <= b1] or [0])
        gb = lambda x: round(x / 1e9, 3)  # noqa: E731
        print(json.dumps({
            "step": step, "cpu_s": round(time.process_time() - cpu0, 1),
            "layers_checkpointed_in_forward": checkpointed["calls"],
            "saved_gb": gb(sum(saved.values())), "saved_tensors": len(saved),
            "live_fwd_end_gb": gb(last(f1)), "live_fwd_peak_gb": gb(live_fwd_peak), "live_bwd_peak_gb": gb(live_bwd_peak),
            "live_end_gb": gb(last(b1)),
            "rss_start_gb": gb(rss0), "rss_fwd_peak_gb": gb(fwd_rss_peak), "rss_fwd_end_gb": gb(fwd_rss_end),
            "rss_bwd_peak_gb": gb(bwd_rss_peak), "rss_end_gb": gb(end_rss),
            "heap_in_use_gb": [gb(heap0[0]), gb(fwd_heap[0]), gb(end_heap[0])],
            "heap_held_gb": [gb(heap0[1]), gb(fwd_heap[1]), gb(end_heap[1])],
            "forward_allocations_mib": large_allocations(prof, f0, f1) if prof is not None else None,
            "backward_allocations_mib": large_allocations(prof, b0, b1) if prof is not None else None,
        }), flush=True)
    peak.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
