"""Where a TRL option lives in a recipe: the hint for an unknown key or value written as a TRL user writes it.

TRL's GRPOConfig (1.16) and PPOConfig names, and values of its ``loss_type`` and of the estimator names
people write for ``ppo.advantage``, each mapped to the recipe key (and value) that does the same, or to a
line saying there is none. docs/estimators.md has the same table for reading.
"""

from __future__ import annotations

# TRL option -> what to write in a recipe.
TRL_KEYS: dict[str, str] = {
    "beta": "ppo.kl_coef",
    "epsilon": "ppo.cliprange",
    "epsilon_high": "ppo.cliprange_high",
    "loss_type": "ppo.loss_aggregation (TRL's dapo and bnpo: token_mean; grpo: seq_mean_token_mean; "
                 "dr_grpo: seq_mean_token_sum_norm)",
    "num_iterations": "ppo.ppo_epochs",
    "num_ppo_epochs": "ppo.ppo_epochs",
    "importance_sampling_level": "ppo.ratio_level (token | sequence)",
    "mask_truncated_completions": "ppo.mask_truncated",
    "lam": "ppo.gae_lambda",
    "per_device_train_batch_size": "ppo.micro_batch_size (completions per forward); ppo.mini_batch_size is the "
                                   "completions per optimizer step, per_device_train_batch_size x gradient_accumulation_steps",
    "gradient_accumulation_steps": "ppo.mini_batch_size / ppo.micro_batch_size (set mini_batch_size to "
                                   "micro_batch_size x gradient_accumulation_steps)",
    "local_rollout_forward_batch_size": "ppo.micro_batch_size",
    "generation_batch_size": "ppo.rollout_batch_size (prompts per update) x generation.num_generations",
    "steps_per_generation": "ppo.rollout_batch_size x generation.num_generations / ppo.mini_batch_size (optimizer steps "
                            "per update and epoch)",
    "learning_rate": "optim.lr",
    "lr_scheduler_type": "optim.scheduler",
    "warmup_ratio": "optim.warmup_steps (a number of updates)",
    "adam_epsilon": "optim.adam_eps",
    "max_completion_length": "generation.max_new_tokens",
    "response_length": "generation.max_new_tokens",
    "max_prompt_length": "data.max_prompt_tokens",
    "use_vllm": "generation.backend: vllm",
    "vllm_mode": "generation.backend (vllm: in-process, vllm_server: a `vllm serve`)",
    "vllm_server_base_url": "generation.server_url",
    "bf16": "train.mixed_precision: bf16",
    "fp16": "train.mixed_precision: fp16",
    "max_steps": "train.total_updates",
    "num_train_epochs": "train.total_updates",
    "save_steps": "train.save_every",
    "save_total_limit": "train.keep_checkpoints",
    "logging_steps": "train.log_every",
    "log_completions": "train.sample_every",
    "num_completions_to_print": "train.num_samples",
    "reward_funcs": "reward.components (type: function, function: path/file.py:name)",
    "reward_weights": "reward.components[i].weight",
    "model_name_or_path": "policy.path",
    "dataset_name": "data.prompts",
    "eval_strategy": "data.eval_prompts (held-out prompts, evaluated before and after training)",
    "eval_steps": "data.eval_prompts (held-out prompts, evaluated before and after training)",
    "min_p": "generation.min_p",
    "repetition_penalty": "nothing: generation has temperature, top_k, top_p and min_p",
    "sync_ref_model": "nothing: the reference is the frozen base",
}

# Estimator names written as ppo.advantage -> the settings that give them.
ADVANTAGE_VALUES: dict[str, str] = {
    "dr_grpo": "advantage: grpo with scale_rewards: none and loss_aggregation: seq_mean_token_sum_norm (Dr. GRPO)",
    "gspo": "advantage: grpo with ratio_level: sequence and loss_aggregation: seq_mean_token_mean (GSPO)",
    "dapo": "advantage: grpo with cliprange_high (e.g. 0.28), filter_groups: true and reward.overlong_buffer (DAPO)",
    "ppo": "advantage: gae (PPO with a critic)",
    "reinforce++": "advantage: reinforce_pp",
    "reinforce_plus_plus": "advantage: reinforce_pp",
}

# ppo.loss_aggregation written with TRL's loss_type names -> ours.
LOSS_TYPE_VALUES: dict[str, str] = {
    "dapo": "token_mean", "bnpo": "token_mean", "grpo": "seq_mean_token_mean", "dr_grpo": "seq_mean_token_sum_norm",
}


def trl_key_hint(key: str) -> str | None:
    """'TRL's beta is ppo.kl_coef here' for a TRL option name written as a recipe key; else None."""
    where = TRL_KEYS.get(key)
    return None if where is None else f"TRL's {key} is {where} here"


def trl_value_hint(key_path: str, value) -> str | None:
    """The recipe settings for a TRL name given as the value of ppo.advantage or ppo.loss_aggregation."""
    if (as_bool := trl_bool_hint(key_path, value)) is not None:
        return as_bool
    if not isinstance(value, str):
        return None
    name = value.lower()
    if key_path.endswith("advantage") and name in ADVANTAGE_VALUES:
        return f"for {value} write {ADVANTAGE_VALUES[name]}"
    if key_path.endswith("loss_aggregation") and name in LOSS_TYPE_VALUES:
        return f"TRL's loss_type {value} is loss_aggregation: {LOSS_TYPE_VALUES[name]}"
    return None


def trl_bool_hint(key_path: str, value) -> str | None:
    """TRL's scale_rewards also takes true (group) and false (none); a --set gives them as text."""
    said = str(value).lower()
    if key_path.endswith("scale_rewards") and said in ("true", "false"):
        return f"TRL's scale_rewards {said} is scale_rewards: {'group' if said == 'true' else 'none'}"
    return None
