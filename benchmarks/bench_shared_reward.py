#!/usr/bin/env python
"""Rollout time with one forward of the reward model that is also the frozen critic, against two.

    python benchmarks/bench_shared_reward.py [--shape tiny|wide] [--repeats 5] [--batch 64] [--tokens 24]

value.kind auto with a scalar reward model on the policy's architecture and tokenizer is the frozen
reward-model critic; engine/rewards/shared.py then scores the rollout and computes the critic's
features with one forward of that model (EngineOptions.shared_reward_forward on) instead of one each (off).
Both run on the same engine in one process, alternating, from the same seed (same samples), and the
script prints the median seconds of the whole rollout (collect_rollout) and of its part after
generation (the forwards over the sampled tokens and the reward), with the CPU they ran on.

Shapes: ``tiny`` is the tiny sentiment models (hidden 96, 2 layers; the reward model is the tiny
classifier as a one-output reward, as tests/engine/test_models.py builds it); ``wide`` keeps the
tiny policy (its samples are text that tokenises back to the same ids) and gives the reward model
random weights at hidden 512, 4 layers; ``wide-random`` gives the policy those too: its random
samples seldom tokenise back to the same ids, so most rows fall back to the two forwards (the share
of rows read from the shared forward is printed).

Never imported by ppo_cli or its tests.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]


def tiny_models() -> Path:
    """The tiny models tests/fixtures/tiny_models.py built, where the tests' fixture keeps them."""
    sys.path.insert(0, str(ROOT))
    from tests.fixtures.model_cache import built_tiny_models

    return built_tiny_models()


def scalar_reward(tiny: Path, out: Path) -> Path:
    """The tiny sentiment classifier as a 1-output reward model (score = positive - negative logit)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cls = AutoModelForSequenceClassification.from_pretrained(tiny / "reward", dtype=torch.float32)
    config = cls.config
    config.num_labels, config.id2label, config.label2id = 1, {0: "score"}, {"score": 0}
    config.problem_type = "regression"
    scalar = AutoModelForSequenceClassification.from_config(config)
    state = cls.state_dict()
    state["score.weight"] = (cls.score.weight[2] - cls.score.weight[0]).detach().unsqueeze(0)
    scalar.load_state_dict(state)
    scalar.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny / "reward").save_pretrained(out)
    return out


def wide_models(tiny: Path, out: Path, hidden: int, layers: int) -> tuple[Path, Path]:
    """Random-weight policy and 1-output reward model of the tiny models' architecture, wider."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny / "policy")
    config = AutoConfig.from_pretrained(tiny / "policy")
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = hidden, 4 * hidden, layers
    config.num_attention_heads, config.num_key_value_heads = hidden // 64, hidden // 128
    config.layer_types = [config.layer_types[0]] * layers
    AutoModelForCausalLM.from_config(config).save_pretrained(out / "policy")
    config.num_labels, config.id2label, config.label2id = 1, {0: "score"}, {"score": 0}
    config.problem_type = "regression"
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out / "reward")
    for name in ("policy", "reward"):
        tokenizer.save_pretrained(out / name)
    return out / "policy", out / "reward"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("tiny", "wide", "wide-random"), default="tiny")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()

    import torch

    from ppo_cli.engine import engine as engine_module
    from ppo_cli.engine.precision_probe import machine_record
    from ppo_cli.recipe_loading import load_recipe

    tiny = tiny_models()
    work = Path(tempfile.mkdtemp(prefix="bench-shared-reward-"))
    if args.shape == "tiny":
        policy, reward = tiny / "policy", scalar_reward(tiny, work / "rm")
    else:
        policy, reward = wide_models(tiny, work, hidden=512, layers=4)
        policy = tiny / "policy" if args.shape == "wide" else policy
    sets = [f"policy.path={policy}", f"output_dir={work / 'runs'}", "value.kind=auto",
            f"reward.components=[{{type: model, path: '{reward}', batch_size: {args.batch}}}]",
            f"ppo.rollout_batch_size={args.batch}", f"ppo.mini_batch_size={args.batch}",
            f"ppo.micro_batch_size={min(16, args.batch)}", f"generation.max_new_tokens={args.tokens}",
            *args.overrides]
    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", sets)
    engine = engine_module.load_engine(recipe)
    assert engine.shared_reward is not None, "the reward model is not the frozen critic here"
    lines = [line.strip() for line in (ROOT / recipe.data.prompts).read_text().splitlines() if line.strip()]
    prompts = (lines * (args.batch // len(lines) + 1))[: args.batch]

    seconds: dict[str, list[float]] = {"one": [], "two": []}
    after_generation: dict[str, list[float]] = {"one": [], "two": []}
    matched = []
    for repeat in range(args.repeats + 1):  # the first round warms up both
        for mode in ("one", "two") if repeat % 2 else ("two", "one"):
            engine.options = engine_module.EngineOptions(shared_reward_forward=mode == "one")
            torch.manual_seed(repeat)
            started = time.perf_counter()
            rollout = engine.collect_rollout(prompts)
            total = time.perf_counter() - started
            if repeat:
                seconds[mode].append(total)
                after_generation[mode].append(total - engine.generation_seconds)
        positions = engine.shared_reward.score_positions(prompts, rollout.responses, rollout.generation)
        matched.append(float((positions >= 0).float().mean()))
    median = {mode: statistics.median(v) for mode, v in seconds.items()}
    median_after = {mode: statistics.median(v) for mode, v in after_generation.items()}
    result = {
        "shape": args.shape, "batch": args.batch, "max_new_tokens": args.tokens, "repeats": args.repeats,
        "rollout_s": median, "after_generation_s": median_after,
        "after_generation_ratio": median_after["one"] / median_after["two"],
        "rollout_ratio": median["one"] / median["two"],
        "rows_from_shared_forward": statistics.mean(matched),
        "machine": machine_record(),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
