#!/usr/bin/env python
"""One TRL 1.12.0 PPO run for benchmarks/bench_vs_trl.py; runs in TRL's own virtual environment.

Never imported by ppo_cli or its tests: bench_vs_trl.py starts it with .cache/trl-venv/bin/python
and reads the JSON it writes (per-update seconds, scores, generated tokens, peak memory).

Settings that TRL defaults differently from ours are set explicitly so the comparison is equal:
fp32 (bf16=False, unless --bf16: TRL's own default), no gradient checkpointing, constant learning rate, no periodic sample generation.
TRL never clips gradients, so the ppo_cli side runs with optim.max_grad_norm: null.

Reward: TRL scores a sequence at its last non-pad token, which is the stop token when the response
has one; ppo_cli scores the decoded text (special tokens skipped), so the last real text token. To
make both compute the same reward, the reward model's input gets the stop token replaced by pad
here (the missing-EOS penalty still sees the original responses). Everything else is TRL's code.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", required=True)
    ap.add_argument("--reward", required=True, help="a 1-label sequence classifier (also the value model's init)")
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--bf16", action="store_true", help="TRL's own default precision (PPOConfig bf16=True)")
    ap.add_argument("--updates", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--mini-batches", type=int, default=1)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--response-length", type=int, default=24)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--kl-coef", type=float, default=0.05)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--missing-eos-penalty", type=float, default=None)
    ap.add_argument("--max-prompt-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def lora_config():
    """ppo_cli's LoRA settings for the benchmark recipes: r 16, alpha 32, every linear layer, no dropout."""
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", bias="none", task_type="CAUSAL_LM")


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    started = time.perf_counter()

    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl.experimental.ppo import PPOConfig, PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    prompts = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    ids = [tokenizer(p)["input_ids"][-args.max_prompt_tokens:] for p in prompts]
    dataset = Dataset.from_dict({"input_ids": ids})

    fp32 = dict(dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(args.policy, **fp32)
    reward_model = AutoModelForSequenceClassification.from_pretrained(args.reward, num_labels=1, **fp32)
    value_model = AutoModelForSequenceClassification.from_pretrained(args.reward, num_labels=1, **fp32)
    for model in (reward_model, value_model):
        model.config.pad_token_id = tokenizer.pad_token_id
    reward_model.requires_grad_(False).eval()

    # Same reward function as ppo_cli (see the module docstring) and a count of generated tokens.
    record = {"tokens": []}
    original_get_reward = trl_ppo.get_reward
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def get_reward(model, query_responses, pad_token_id, context_length):
        if model is reward_model:
            query_responses = query_responses.clone()
            response = query_responses[:, context_length:]
            record["tokens"].append(int((response != pad).sum()))  # up to and including the stop token
            response[response == eos] = pad
        return original_get_reward(model, query_responses, pad_token_id, context_length)

    trl_ppo.get_reward = get_reward

    peft_config = lora_config() if args.lora else None

    out_dir = tempfile.mkdtemp(prefix="trl-bench-")
    config = PPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.batch // args.micro_batch // args.mini_batches,
        num_mini_batches=args.mini_batches,
        num_ppo_epochs=args.epochs,
        local_rollout_forward_batch_size=args.batch,
        total_episodes=args.updates * args.batch,
        response_length=args.response_length,
        temperature=args.temperature,
        kl_coef=args.kl_coef,
        kl_estimator="k1",
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=0.1,
        gamma=1.0,
        lam=0.95,
        whiten_rewards=False,
        missing_eos_penalty=args.missing_eos_penalty,
        stop_token="eos",
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        bf16=args.bf16,
        fp16=False,
        gradient_checkpointing=False,
        num_sample_generations=0,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=args.seed,
        use_cpu=True,
        dataloader_num_workers=0,
    )

    class Recorder(TrainerCallback):
        def __init__(self):
            self.begin = None
            self.ends: list[float] = []
            self.logs: list[dict] = []

        def on_train_begin(self, a, state, control, **kw):
            self.begin, self.begin_cpu = time.perf_counter(), time.process_time()
            self.cpu_ends: list[float] = []

        def on_step_end(self, a, state, control, **kw):
            self.ends.append(time.perf_counter())
            self.cpu_ends.append(time.process_time())

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "objective/scores" in logs:
                self.logs.append(dict(logs))

    recorder = Recorder()
    trainer = PPOTrainer(
        args=config, processing_class=tokenizer, model=policy, ref_model=None, reward_model=reward_model,
        train_dataset=dataset, value_model=value_model, eval_dataset=dataset.select(range(args.batch)),
        peft_config=peft_config, callbacks=[recorder],
    )
    loaded = time.perf_counter()
    trainer.train()
    # Each update's time runs from the end of the previous one (TRL's own per-update cleanup included)
    # until the end of this one, as ppo_cli's time/step_s does for its train_step.
    ends = [recorder.begin] + recorder.ends
    seconds = [b - a for a, b in zip(ends, ends[1:])]
    cpu_ends = [recorder.begin_cpu] + recorder.cpu_ends
    cpu_seconds = [b - a for a, b in zip(cpu_ends, cpu_ends[1:])]  # this process's, all threads
    result = {
        "impl": "trl",
        "trl_version": trl.__version__,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "seconds_per_update": seconds,
        "cpu_seconds_per_update": cpu_seconds,
        "scores": [log["objective/scores"] for log in recorder.logs],
        "kl": [log["objective/kl"] for log in recorder.logs],
        "generated_tokens": record["tokens"],
        "load_s": loaded - started,
        "peak_memory_gb": peak_rss_gb(),
        "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
