#!/usr/bin/env python
"""One TRL GRPOTrainer run for benchmarks/bench_estimators.py (``trl``); runs in TRL's own virtual environment.

Never imported by ppo_cli or its tests: bench_estimators.py starts it with .cache/trl-venv/bin/python and
reads the JSON it writes (seconds per update, scores, peak memory).

One update is ppo_cli's: ``--prompts-per-update`` prompts x ``--num-generations`` completions, one
optimizer step over them, ``--epochs`` times (TRL: per_device_train_batch_size = the episodes,
steps_per_generation 1, num_iterations = epochs, so TRL generates once every ``epochs`` optimizer steps).
Settings TRL defaults differently are set to ppo_cli's bench values: fp32 (GRPOConfig's bf16 default
off), no gradient checkpointing, no gradient clipping (the bench's max_grad_norm null), beta = kl_coef
(k3 in the loss, as ppo_cli's grpo), lr constant. ``--defaults`` keeps GRPOConfig's bf16 and gradient
checkpointing instead. The reward is a Python function: the bench's scalar
reward model on prompt + completion text (ppo_cli's ``type: model`` default text) minus the missing-EOS
penalty for a completion without the EOS token, the same numbers ppo_cli's reward gives.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from bench_trl_driver import lora_config, peak_rss_gb  # the PPO driver beside this file: same LoRA, same memory figure


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", required=True)
    ap.add_argument("--reward", required=True, help="a 1-label sequence classifier")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--prompts-per-update", type=int, default=2)
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--response-length", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--kl-coef", type=float, default=0.05)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--missing-eos-penalty", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--defaults", action="store_true",
                    help="TRL's own precision defaults (GRPOConfig: bf16 on, gradient checkpointing on) instead of fp32")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the policy (TRL's accelerator) and the reward model on the GPU; peak memory is then "
                         "torch.cuda.max_memory_allocated, as ppo_cli's")
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def _stub_vllm_client() -> None:
    """TRL 1.12's GRPOTrainer imports its vLLM server client, which imports requests and urllib3 at
    module level; TRL does not depend on them and the bench venv has neither. Nothing here talks to a
    vLLM server, so an empty module stands in for the client (the venv is shared: nothing is installed)."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("requests") is None or importlib.util.find_spec("urllib3") is None:
        client = types.ModuleType("trl.generation.vllm_client")
        client.VLLMClient = None
        sys.modules["trl.generation.vllm_client"] = client


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()

    _stub_vllm_client()
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompts = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_dict({"prompt": prompts})

    reward_model = AutoModelForSequenceClassification.from_pretrained(args.reward, num_labels=1, dtype=torch.float32)
    reward_model.config.pad_token_id = tokenizer.pad_token_id
    reward_model.requires_grad_(False).eval().to(args.device)
    reward_tokenizer = AutoTokenizer.from_pretrained(args.reward)
    eos = tokenizer.eos_token_id

    @torch.no_grad()
    def reward(prompts, completions, completion_ids, **kwargs):
        batch = reward_tokenizer([p + c for p, c in zip(prompts, completions)], return_tensors="pt", padding=True).to(args.device)
        scores = reward_model(**batch).logits[:, 0].tolist()
        penalty = args.missing_eos_penalty or 0.0
        return [s - (penalty if eos not in ids else 0.0) for s, ids in zip(scores, completion_ids)]

    peft_config = lora_config() if args.lora else None

    episodes = args.prompts_per_update * args.num_generations
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-bench-"),
        per_device_train_batch_size=episodes,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.num_generations,
        num_iterations=args.epochs,
        max_steps=args.updates * args.epochs,
        max_completion_length=args.response_length,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        beta=args.kl_coef,
        epsilon=0.2,
        scale_rewards="group",
        loss_type="dapo",
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=0.0,
        **({} if args.defaults else {"bf16": False, "gradient_checkpointing": False}),
        fp16=False,
        model_init_kwargs={"dtype": torch.float32},
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=args.seed,
        use_cpu=args.device == "cpu",
        dataloader_num_workers=0,
        log_completions=False,
    )
    record = {"step_end": [], "step_cpu": [], "rewards": []}

    class Timer(TrainerCallback):
        def on_train_begin(self, *a, **k):
            record["begin"], record["begin_cpu"] = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            record["step_end"].append(time.perf_counter())
            record["step_cpu"].append(time.process_time())

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "reward" in logs:  # logged at the first step after each generation
                record["rewards"].append(logs["reward"])

    trainer = GRPOTrainer(model=args.policy, reward_funcs=reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[Timer()])
    trainer.train()

    ends = [record["begin"]] + record["step_end"]
    per_update = [ends[(u + 1) * args.epochs] - ends[u * args.epochs] for u in range(args.updates)]
    cpu = [record["begin_cpu"]] + record["step_cpu"]
    cpu_per_update = [cpu[(u + 1) * args.epochs] - cpu[u * args.epochs] for u in range(args.updates)]
    result = {
        "impl": "trl",
        "trl_version": trl.__version__,
        "seconds_per_update": per_update,
        "cpu_seconds_per_update": cpu_per_update,
        "scores": record["rewards"],  # the mean reward of each generation
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if args.device == "cuda" else peak_rss_gb(),
        "total_s": time.perf_counter() - started,
    }
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
