#!/usr/bin/env python
"""One forward per distinct prompt (engine/shared_prompts.py), same process, alternating: the GRPO bench
recipe's sampling (each prompt prefilled once), its reference forward and its update (forward + backward of one optimizer step, the step itself
skipped so every call trains the same weights) on one rollout of 4 prompts x 4 completions x 48 tokens
(SmolLM2-135M-Instruct, LoRA r16 all-linear, frozen weights in bf16 under autocast, gradient
checkpointing as `auto` chooses at this shape), with the prompts shared and with the plain batch.

    python benchmarks/bench_shared_prompts.py [RECIPE] [--calls 4] [--threads 2]

Prints wall and process CPU seconds per call (min / median). Never imported by ppo_cli or its tests.
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
DEFAULT_RECIPE = ROOT / ".cache/bench/recipes/bench-vs-trl116-grpo-s46-r0.yaml"  # bench_vs_trl_grpo.py compare writes it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=str(DEFAULT_RECIPE))
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from ppo_cli.engine import engine as engine_module
    from ppo_cli.engine import shared_prompts
    from ppo_cli.engine.actor_critic import reference_logprobs
    from ppo_cli.recipe_loading import load_recipe
    from ppo_cli.train_setup import init_state
    from ppo_cli.trainer import compute_advantages, optimise

    torch.set_num_threads(args.threads)
    recipe = load_recipe(Path(args.recipe), [])
    engine = engine_module.load_engine(recipe, gradient_checkpointing=True)
    lines = [line for line in Path(recipe.data.prompts).read_text().splitlines() if line.strip()]
    rows = [json.loads(line)["prompt"] for line in lines] if recipe.data.prompts.endswith(".jsonl") else lines
    state = init_state(engine, rows)  # stores the frozen weights in the compute dtype, as a run does
    state.optimizer.step = lambda *args, **kwargs: None  # the same weights every call
    engine.stop_token_id = -1  # every row runs to max_new_tokens
    torch.manual_seed(0)
    group = recipe.generation.num_generations
    rollout = engine.collect_rollout([p for p in rows[:4] for _ in range(group)])
    gen = rollout.generation
    layout = shared_prompts.shared_layout(engine.actor_critic.policy, gen.sequences, gen.attention_mask,
                                          gen.response_ids.shape[1])
    print(f"batch {tuple(gen.sequences.shape)} (prompt {gen.prompt_ids.shape[1]}, response {gen.response_ids.shape[1]}), "
          f"packed {tuple(layout.input_ids.shape) if layout is not None else 'not shared'}")
    adv = compute_advantages(rollout, state.kl_controller.value, recipe.ppo, group_size=group)

    def reference():
        with torch.no_grad(), engine.autocast():
            reference_logprobs(engine.actor_critic, gen.sequences, gen.attention_mask, gen.response_ids, engine.temperature)

    def update():
        optimise(state, rollout, adv)

    def sampling():
        torch.manual_seed(0)
        with engine.autocast():
            engine.generate([p for p in rows[:4] for _ in range(group)])

    seconds = {(phase, mode): [] for phase in ("sampling", "reference", "update") for mode in ("shared", "plain")}
    for call in range(args.calls + 1):  # call 0 warms up
        for mode in (("shared", "plain") if call % 2 == 0 else ("plain", "shared")):
            shared_prompts.ENABLED = mode == "shared"
            for phase, run in (("sampling", sampling), ("reference", reference), ("update", update)):
                wall, cpu = time.perf_counter(), time.process_time()
                run()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                print(f"call {call} {phase} {mode}: {wall:.2f} s wall, {cpu:.2f} CPU s", flush=True)
                if call > 0:
                    seconds[phase, mode].append((wall, cpu))
    print(f"{args.threads} threads; min / median of {args.calls} calls")
    for (phase, mode), pairs in seconds.items():
        walls, cpus = [w for w, _ in pairs], [c for _, c in pairs]
        print(f"{phase:9s} {mode:6s} wall {min(walls):.2f} / {statistics.median(walls):.2f}   "
              f"CPU {min(cpus):.2f} / {statistics.median(cpus):.2f}")


if __name__ == "__main__":
    main()
