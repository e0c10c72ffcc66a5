"""What the sampling benchmarks (bench_lean_lora.py, bench_reserved_cache.py) share: the GRPO bench
recipe's engine as a run holds it, and 4 of its prompts x its group size. Never imported by ppo_cli or
its tests."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_RECIPE = ROOT / ".cache/bench/recipes/bench-vs-trl116-grpo-s49c-r0.yaml"  # bench_vs_trl_grpo.py compare writes it


def sampling_engine(recipe_path: str, overrides: list[str], threads: int, trained_adapter: bool = False):
    """(engine, prompts): the frozen weights stored as a run stores them (init_state), every row run to
    max_new_tokens (the same work each call); ``trained_adapter``: LoRA B drawn (std 1e-3), not a fresh
    adapter's zeros."""
    import torch

    from ppo_cli.engine import engine as engine_module
    from ppo_cli.recipe_loading import load_recipe
    from ppo_cli.train_setup import init_state

    torch.set_num_threads(threads)
    recipe = load_recipe(Path(recipe_path), overrides)
    engine = engine_module.load_engine(recipe)
    lines = [line for line in Path(recipe.data.prompts).read_text().splitlines() if line.strip()]
    rows = [json.loads(line)["prompt"] for line in lines] if recipe.data.prompts.endswith(".jsonl") else lines
    init_state(engine, rows)
    engine.stop_token_id = -1
    if trained_adapter:
        for name, param in engine.actor_critic.policy.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=1e-3)
    print(f"mixed_precision {engine.mixed_precision}")
    return engine, [p for p in rows[:4] for _ in range(recipe.generation.num_generations)]
