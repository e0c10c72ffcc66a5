#!/usr/bin/env python
"""Where one PPO update of `ppo train` spends its time and memory, phase by phase.

    python benchmarks/profile_ppo.py RECIPE [--set k=v ...] [--updates 4] [--warmup 1] [--lever NAME=off ...]

Loads the engine exactly as `ppo train` does, then runs updates with timers around each phase:

    generate     sampling (transformers generate with the KV cache)
    policy       the rollout's policy forward for the old log-probs (0 with ppo.rollout_logprobs: generation)
    reference    reference log-probs (adapter disabled, or the frozen copy)
    values       the critic's rollout forward (0 for value.kind: head: it comes with the policy forward)
    reward       decoding + the reward model(s)
    advantages   KL, reward shaping, GAE, whitening
    update_fwd   the update's forward passes + losses (all epochs, all micro-batches)
    update_bwd   their backward passes
    optim_step   gradient clipping + optimizer steps

and prints the median seconds per phase after warm-up, plus the process's resident memory after
loading and its peak (ru_maxrss) after each phase. ``--lever`` turns a speed lever off to measure it:

    trim=off             keep the padding after the longest response (no trim_padding, no per-micro-batch trim)
    logsumexp=off        full log_softmax over the vocabulary instead of gather - logsumexp, chunked
    inference_mode=off   reference/critic rollout forwards under no_grad instead of inference_mode
    fused_adamw=off      for-loop AdamW instead of the fused kernel
    malloc=off           glibc's defaults: freed activations go back to the kernel and are faulted in again
    frozen_bf16=off      a LoRA policy's frozen Linear weights stay float32 under bf16 autocast (cast at each call)
    defer_old=off        GRPO: the rollout's own policy forward for the old log-probs, not the update's first epoch

The old log-probs lever is a recipe key: --set ppo.rollout_logprobs=forward (a second policy forward)
or generation (reuse the sampling passes).

Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def rss_gb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def rss_parts_gb() -> tuple[float, float]:
    """(anonymous, file-backed) resident memory: safetensors weights are mapped files until copied."""
    anon = file = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024 / 1e9
            elif line.startswith("RssFile:"):
                file = int(line.split()[1]) * 1024 / 1e9
    return anon, file


class Timers:
    """Seconds per phase, and (from a 20 ms sampler thread) the largest resident memory seen in each."""

    def __init__(self):
        self.current: dict[str, float] = defaultdict(float)
        self.memory: dict[tuple[int, str], tuple[float, float]] = {}  # (update, phase) -> (anon, file), largest
        self.name = "other"
        self.update = 0
        self.depth = 0
        import threading

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self):
        while not self._stop.wait(0.02):
            anon, file = rss_parts_gb()
            key = (self.update, self.name)
            best = self.memory.get(key)
            if best is None or anon + file > sum(best):
                self.memory[key] = (anon, file)

    def stop(self):
        self._stop.set()

    @contextmanager
    def phase(self, name: str):
        if self.depth:  # nested (e.g. value_forward -> policy_forward): charge the outer phase
            yield
            return
        self.depth += 1
        self.name = name
        started = time.perf_counter()
        try:
            yield
        finally:
            self.current[name] += time.perf_counter() - started
            self.name = "other"
            self.depth -= 1


def wrap(owner, name: str, timers: Timers, phase: str):
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        with timers.phase(phase):
            return original(*args, **kwargs)

    setattr(owner, name, wrapped)
    return original


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lever", action="append", default=[], help="NAME=off")
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args(argv)
    levers_off = {item.split("=")[0] for item in args.lever if item.endswith("=off")}

    t0 = time.perf_counter()
    import numpy as np
    import torch

    from ppo_cli import train_setup, trainer
    from ppo_cli.engine import logprobs as lp
    from ppo_cli.engine import engine as engine_module
    from ppo_cli.engine import sampler as sampler_module
    from ppo_cli.recipe_loading import load_recipe

    after_imports = rss_gb()
    recipe = load_recipe(Path(args.recipe), args.overrides)
    np.random.seed(recipe.seed)
    torch.manual_seed(recipe.seed)

    # as `ppo train` takes them (commands/train.py): checkpointing `auto` and the heap tuning from the plan
    from ppo_cli.commands.plan import planned_choices
    from ppo_cli.engine.models import resolve_device
    from ppo_cli.engine.precision import recipe_mixed_precision

    device = resolve_device(recipe.train.device)
    choices = planned_choices(recipe, device.type, recipe_mixed_precision(recipe, device))
    print(f"memory choices: {choices.describe()}", flush=True)
    options = engine_module.EngineOptions(inference_mode="inference_mode" not in levers_off,
                                          cpu_malloc_tuning=choices.heap_tuning and "malloc" not in levers_off)
    if "logsumexp" in levers_off:
        def naive(logits, index, chunk_rows=8):
            return torch.log_softmax(logits.float(), dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
        engine_module.selective_log_softmax = trainer.selective_log_softmax = lp.selective_log_softmax = naive
    if "trim" in levers_off:
        sampler_module.trim_padding = lambda generation: generation
    if "frozen_bf16" in levers_off:
        engine_module.Engine.store_frozen_weights_in_compute_dtype = lambda self: 0
    if "defer_old" in levers_off:
        trainer.defer_old_logprobs = lambda *args: False
    if "fused_adamw" in levers_off:
        original_adamw = torch.optim.AdamW

        def unfused(*a, **kw):
            kw["fused"] = None
            kw["foreach"] = False
            return original_adamw(*a, **kw)

        trainer.torch.optim.AdamW = unfused

    started = time.perf_counter()
    engine = engine_module.load_engine(recipe, options=options, gradient_checkpointing=choices.checkpointing.value)
    state = train_setup.init_state(engine, [line.strip() for line in Path(recipe.data.prompts).read_text().splitlines() if line.strip()])
    if "fused_adamw" in levers_off:
        torch.optim.AdamW = original_adamw
    load_s, after_load, peak_after_load = time.perf_counter() - started, rss_gb(), peak_gb()
    if "trim" in levers_off:
        # The update trims each micro-batch to its longest response; pad it back to max_new_tokens
        # (masked columns on the right, so the real positions' outputs are unchanged) to pay for them.
        model, width = state.model, recipe.generation.max_new_tokens

        def untrimmed(sequences, attention_mask, response_len, temperature):
            extra = width - response_len
            if extra > 0:
                sequences = torch.nn.functional.pad(sequences, (0, extra), value=engine.pad_token_id)
                attention_mask = torch.nn.functional.pad(attention_mask, (0, extra), value=False)
            logits, values = model(sequences, attention_mask, response_len + extra, temperature)
            return logits[:, :response_len], values[:, :response_len]

        state.model = untrimmed

    timers = Timers()
    Engine = engine_module.Engine
    wrap(Engine, "sample", timers, "generate")
    wrap(engine_module, "policy_forward", timers, "policy")
    wrap(engine_module, "reference_logprobs", timers, "reference")
    wrap(engine_module, "value_forward", timers, "values")
    wrap(Engine, "decode_responses", timers, "reward")
    wrap(Engine, "score", timers, "reward")
    wrap(trainer, "compute_advantages", timers, "advantages")
    wrap(trainer, "micro_batch_loss", timers, "update_fwd")
    original_backward = torch.Tensor.backward

    def backward(self, *a, **kw):
        with timers.phase("update_bwd"):
            return original_backward(self, *a, **kw)

    torch.Tensor.backward = backward
    wrap(torch.nn.utils, "clip_grad_norm_", timers, "optim_step")
    wrap(state.optimizer, "step", timers, "optim_step")

    per_update, totals, lengths = [], [], []
    for update in range(args.updates):
        timers.current = defaultdict(float)
        timers.update = update + 1
        t = time.perf_counter()
        metrics, rollout = trainer.train_step(state)
        total = time.perf_counter() - t
        per_update.append(dict(timers.current))
        totals.append(total)
        lengths.append(metrics["response_length"])
        print(f"update {update + 1}: {total:.2f} s  " + "  ".join(f"{k} {v:.2f}" for k, v in timers.current.items()),
              flush=True)
    torch.Tensor.backward = original_backward
    timers.stop()

    measured = per_update[args.warmup:] or per_update
    phases = ["generate", "policy", "reference", "values", "reward", "advantages", "update_fwd", "update_bwd", "optim_step"]
    medians = {p: statistics.median(u.get(p, 0.0) for u in measured) for p in phases}
    total = statistics.median(totals[args.warmup:] or totals)
    medians["other"] = max(0.0, total - sum(medians.values()))
    result = {
        "recipe": args.recipe, "overrides": args.overrides, "levers_off": sorted(levers_off),
        "threads": torch.get_num_threads(), "updates": args.updates, "warmup": args.warmup,
        "s_per_update": total, "phases": medians, "response_length": lengths,
        "rss_after_imports_gb": after_imports, "rss_after_load_gb": after_load, "peak_after_load_gb": peak_after_load,
        "rss_by_phase_gb": {f"{u}:{k}": {"anon": a, "file": f} for (u, k), (a, f) in timers.memory.items()},
        "peak_gb": peak_gb(), "load_s": load_s,
        "load_average": float(Path("/proc/loadavg").read_text().split()[0]),
    }
    print(f"\nseconds per update (median of {len(measured)} after {args.warmup} warm-up): {total:.2f}")
    for p in phases + ["other"]:
        print(f"  {p:<11} {medians[p]:7.3f} s  {100 * medians[p] / total:5.1f}%")
    print(f"memory: rss after imports {after_imports:.2f} GB, after loading {after_load:.2f} GB "
          f"(peak while loading {peak_after_load:.2f}), peak {peak_gb():.2f} GB")
    print("largest resident memory per update and phase, GB (anonymous + file-backed):")
    for (update, name), (anon, file) in timers.memory.items():
        print(f"  {update} {name:<11} {anon + file:6.2f} = {anon:.2f} + {file:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
