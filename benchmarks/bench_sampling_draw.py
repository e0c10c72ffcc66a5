#!/usr/bin/env python
"""Sampling's draw, same process, alternating: the blocked inverse-CDF draw (engine/generate.sampling_processors,
in transformers' greedy loop) against the Gumbel-max draw it replaced (Round 8's, kept here) and
transformers' own softmax + torch.multinomial, on the GRPO bench
recipe (SmolLM2-135M-Instruct, LoRA r16 all-linear, frozen weights in bf16 under autocast), 16 rows x
48 tokens forced (no stop token), after one warm-up call each.

    python benchmarks/bench_sampling_draw.py [RECIPE] [--calls 6] [--threads 2]
    python benchmarks/bench_sampling_draw.py --compile      # also transformers' static cache + torch.compile

``--compile`` times the draw as shipped under generate's compiled decoding step (cache_implementation
static, CompileConfig on every device): the first call of each prompt width compiles. Prints wall and
process CPU seconds per call (min / median). Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_RECIPE = ROOT / ".cache/bench/recipes/bench-vs-trl116-grpo-s49c-r0.yaml"  # bench_vs_trl_grpo.py compare writes it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=str(DEFAULT_RECIPE))
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()

    import torch
    from transformers import GenerationConfig as HFGenerationConfig
    from transformers import LogitsProcessorList
    from transformers.generation.configuration_utils import CompileConfig

    from ppo_cli.engine import engine as engine_module
    from ppo_cli.engine import generate
    from ppo_cli.recipe_loading import load_recipe

    torch.set_num_threads(args.threads)
    recipe = load_recipe(Path(args.recipe), [])
    engine = engine_module.load_engine(recipe, gradient_checkpointing=True)
    engine.store_frozen_weights_in_compute_dtype()  # as init_state does on one process
    engine.stop_token_id = -1  # every row runs to max_new_tokens: the same work each call
    rows = [json.loads(line)["prompt"] for line in Path(recipe.data.prompts).read_text().splitlines() if line.strip()]
    prompts = [p for p in rows[:4] for _ in range(recipe.generation.num_generations)]

    shipped = (generate.sampling_config, generate.sampling_processors)

    class GumbelMaxDraw:
        """argmax(s + g), g = -log(-log U) for each of the V scores: the draw Round 8 took."""

        def __call__(self, input_ids, scores):
            uniform = torch.rand(scores.shape, dtype=torch.float32, device=scores.device)
            return scores.float() - torch.log(-torch.log(uniform.clamp_(min=torch.finfo(torch.float32).tiny)))

    def gumbel_processors(gen):
        processors = shipped[1](gen)
        processors[-1] = GumbelMaxDraw()
        return processors

    def multinomial_config(gen, stop_token_id, pad_token_id):
        return HFGenerationConfig(do_sample=True, max_new_tokens=gen.max_new_tokens, temperature=gen.temperature,
                                  top_k=gen.top_k, top_p=gen.top_p, eos_token_id=stop_token_id,
                                  pad_token_id=pad_token_id, use_cache=True)

    def compiled_config(gen, stop_token_id, pad_token_id):
        config = shipped[0](gen, stop_token_id, pad_token_id)
        config.cache_implementation = "static"
        config.compile_config = CompileConfig(fullgraph=False, dynamic=False)
        config.compile_config._compile_all_devices = True  # transformers compiles on CUDA only otherwise
        return config

    modes = {"inverse cdf": shipped, "gumbel": (shipped[0], gumbel_processors),
             "multinomial": (multinomial_config, lambda gen: LogitsProcessorList())}
    if args.compile:
        modes["inverse cdf, compiled"] = (compiled_config, shipped[1])
    seconds: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    for call in range(args.calls + 1):  # call 0 warms up (and compiles)
        order = list(modes) if call % 2 == 0 else list(reversed(modes))
        for mode in order:
            generate.sampling_config, generate.sampling_processors = modes[mode]
            torch.manual_seed(call)
            wall, cpu = time.perf_counter(), time.process_time()
            with engine.autocast():
                engine.generate(prompts)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(f"call {call} {mode}: {wall:.2f} s wall, {cpu:.2f} CPU s", flush=True)
            if call > 0:
                seconds[mode].append((wall, cpu))
    print(f"{len(prompts)} rows x {recipe.generation.max_new_tokens} tokens, {args.threads} threads; min / median")
    for mode, pairs in seconds.items():
        walls, cpus = [w for w, _ in pairs], [c for _, c in pairs]
        print(f"{mode:18s} wall {min(walls):.2f} / {statistics.median(walls):.2f}   "
              f"CPU {min(cpus):.2f} / {statistics.median(cpus):.2f}")


if __name__ == "__main__":
    main()
