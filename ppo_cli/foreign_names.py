"""Where another trainer's option lives in a recipe: the hint for an unknown key or value written as a TRL,
verl or OpenRLHF user writes it.

TRL's GRPOConfig (1.16) and PPOConfig names, verl's config paths (its ppo_trainer.yaml, as a command line
overrides them: ``actor_rollout_ref.rollout.n=8``), OpenRLHF's command-line options, and values of TRL's
``loss_type`` and of the estimator names people write for ``ppo.advantage``, each mapped to the recipe key
(and value) that does the same, or to a line saying there is none. docs/estimators.md has the same tables
for reading.
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

# verl option, by its path in verl's config -> what to write in a recipe. verl counts batches over all GPUs
# and its mini-batches in prompts; a recipe's batch sizes are per process, its mini-batches in completions.
VERL_KEYS: dict[str, str] = {
    "data.train_batch_size": "ppo.rollout_batch_size (prompts per update and process; verl's counts all GPUs)",
    "data.max_prompt_length": "data.max_prompt_tokens (a longer prompt loses its first tokens, not its row)",
    "data.max_response_length": "generation.max_new_tokens",
    "data.train_files": "data.prompts",
    "data.val_files": "data.eval_prompts",
    "data.prompt_key": "data.field",
    "actor_rollout_ref.model.path": "policy.path",
    "actor_rollout_ref.rollout.n": "generation.num_generations",
    "actor_rollout_ref.rollout.temperature": "generation.temperature",
    "actor_rollout_ref.rollout.top_p": "generation.top_p",
    "actor_rollout_ref.rollout.top_k": "generation.top_k",
    "actor_rollout_ref.rollout.name": "generation.backend (vllm: in process, vllm_server: a `vllm serve`)",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "generation.vllm_gpu_memory_utilization",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "ppo.mini_batch_size (completions per optimizer step and process; "
                                                   "verl's counts prompts: times rollout.n, over the processes)",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "ppo.micro_batch_size (completions per forward)",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "ppo.micro_batch_tokens",
    "actor_rollout_ref.actor.use_dynamic_bsz": "ppo.micro_batch_tokens (set, micro-batches are cut by tokens)",
    "actor_rollout_ref.actor.ppo_epochs": "ppo.ppo_epochs",
    "actor_rollout_ref.actor.clip_ratio": "ppo.cliprange",
    "actor_rollout_ref.actor.clip_ratio_high": "ppo.cliprange_high",
    "actor_rollout_ref.actor.entropy_coeff": "ppo.entropy_coef",
    "actor_rollout_ref.actor.loss_agg_mode": "ppo.loss_aggregation (token-mean: token_mean, seq-mean-token-mean: "
                                             "seq_mean_token_mean, seq-mean-token-sum-norm: seq_mean_token_sum_norm)",
    "actor_rollout_ref.actor.use_kl_loss": "ppo.kl_penalty: loss",
    "actor_rollout_ref.actor.kl_loss_coef": "ppo.kl_coef with ppo.kl_penalty: loss",
    "actor_rollout_ref.actor.kl_loss_type": "nothing: ppo.kl_penalty loss takes k3 (verl's low_var_kl)",
    "algorithm.kl_penalty": "ppo.kl_estimator (verl's kl: k1, mse: k2, low_var_kl: k3)",
    "actor_rollout_ref.actor.optim.lr": "optim.lr",
    "critic.optim.lr": "optim.value_lr",
    "algorithm.adv_estimator": "ppo.advantage (gae, grpo, rloo or reinforce_pp)",
    "algorithm.norm_adv_by_std_in_grpo": "ppo.scale_rewards (true: group, false: none)",
    "algorithm.use_kl_in_reward": "ppo.kl_penalty: reward",
    "algorithm.kl_ctrl": "ppo.kl_coef (type fixed) and ppo.adaptive_kl (type adaptive)",
    "algorithm.kl_ctrl.kl_coef": "ppo.kl_coef",
    "algorithm.kl_ctrl.target_kl": "ppo.adaptive_kl.target",
    "algorithm.kl_ctrl.horizon": "ppo.adaptive_kl.horizon",
    "algorithm.gamma": "ppo.gamma",
    "algorithm.lam": "ppo.gae_lambda",
    "algorithm.filter_groups.enable": "ppo.filter_groups",
    "algorithm.filter_groups.max_num_gen_batches": "ppo.max_filter_rounds (verl's minus 1)",
    "trainer.total_training_steps": "train.total_updates",
    "trainer.total_epochs": "train.total_updates (updates, not passes over the prompts)",
    "trainer.save_freq": "train.save_every",
    "trainer.experiment_name": "name",
    "trainer.default_local_dir": "output_dir",
    "trainer.n_gpus_per_node": "ppo train --num-processes",
    "trainer.nnodes": "ppo train --num-machines",
}

# OpenRLHF command-line option -> what to write in a recipe (its train_ppo options; those named as here,
# e.g. rollout_batch_size, are left to the section hints). OpenRLHF's batch sizes count all GPUs.
OPENRLHF_KEYS: dict[str, str] = {
    "train_batch_size": "ppo.mini_batch_size (completions per optimizer step and process; OpenRLHF's counts all GPUs)",
    "micro_train_batch_size": "ppo.micro_batch_size (completions per forward)",
    "micro_rollout_batch_size": "ppo.micro_batch_size (the rollout's forwards use it too)",
    "n_samples_per_prompt": "generation.num_generations",
    "init_kl_coef": "ppo.kl_coef",
    "kl_target": "ppo.adaptive_kl.target",
    "kl_horizon": "ppo.adaptive_kl.horizon",
    "use_kl_loss": "ppo.kl_penalty: loss",
    "advantage_estimator": "ppo.advantage (gae, grpo, rloo or reinforce_pp)",
    "eps_clip": "ppo.cliprange",
    "value_clip": "ppo.cliprange_value",
    "lambd": "ppo.gae_lambda",
    "entropy_loss_coef": "ppo.entropy_coef",
    "max_epochs": "ppo.ppo_epochs",
    "num_episodes": "train.total_updates (updates, not passes over the prompts)",
    "actor_learning_rate": "optim.lr",
    "critic_learning_rate": "optim.value_lr",
    "prompt_max_len": "data.max_prompt_tokens",
    "generate_max_len": "generation.max_new_tokens",
    "input_key": "data.field",
    "label_key": "nothing: a row's other fields are columns, passed to reward functions by name",
    "apply_chat_template": "data.chat_template",
    "prompt_data": "data.prompts",
    "pretrain": "policy.path",
    "reward_pretrain": "reward.components (type: model, path: ...)",
    "remote_rm_url": "reward.components (type: http, url: ...)",
    "save_path": "output_dir",
    "lora_rank": "policy.lora.r",
    "lora_alpha": "policy.lora.alpha",
}

# Each tool's names, by the name the hints give it.
TOOL_KEYS: dict[str, dict[str, str]] = {"TRL": TRL_KEYS, "verl": VERL_KEYS, "OpenRLHF": OPENRLHF_KEYS}

# Estimator names written as ppo.advantage -> the settings that give them.
ADVANTAGE_VALUES: dict[str, str] = {
    "dr_grpo": "advantage: grpo with scale_rewards: none and loss_aggregation: seq_mean_token_sum_norm (Dr. GRPO)",
    "gspo": "advantage: grpo with ratio_level: sequence and loss_aggregation: seq_mean_token_mean (GSPO)",
    "dapo": "advantage: grpo with cliprange_high (e.g. 0.28), filter_groups: true and reward.overlong_buffer (DAPO)",
    "ppo": "advantage: gae (PPO with a critic)",
    "reinforce++": "advantage: reinforce_pp",
    "reinforce_plus_plus": "advantage: reinforce_pp",
    # verl's reinforce_plus_plus_baseline, OpenRLHF's reinforce_baseline and group_norm (its GRPO)
    "reinforce_plus_plus_baseline": "advantage: reinforce_pp with generation.num_generations >= 2 (the group mean "
                                    "is subtracted first)",
    "reinforce_baseline": "advantage: reinforce_pp with generation.num_generations >= 2 (the group mean is subtracted first)",
    "group_norm": "advantage: grpo",
}

# ppo.loss_aggregation written with TRL's loss_type names -> ours.
LOSS_TYPE_VALUES: dict[str, str] = {
    "dapo": "token_mean", "bnpo": "token_mean", "grpo": "seq_mean_token_mean", "dr_grpo": "seq_mean_token_sum_norm",
}


def foreign_key_hint(written: list[list[str]], recipe_keys: set[str]) -> str | None:
    """'verl's data.train_batch_size is ppo.rollout_batch_size here' for an option of another tool written
    as a recipe key, or None. ``written``: the key paths the user wrote, each as its parts from the top (an
    unknown key, and the keys written under it). A name matches a path by its last parts: the names that
    share most win, one per tool, joined when tools tie (OpenRLHF's train_batch_size is not verl's)."""
    found: dict[str, tuple[int, str]] = {}  # tool -> (parts matched, its name)
    for tool, names in TOOL_KEYS.items():
        for name in names:
            matched = max(_shared_tail(path, name.split(".")) for path in written)
            if matched > found.get(tool, (0, ""))[0] and _counts(tool, name, matched, recipe_keys):
                found[tool] = (matched, name)
    if not found:
        return None
    most = max(matched for matched, _ in found.values())
    return "; ".join(f"{tool}'s {name} is {TOOL_KEYS[tool][name]} here"
                     for tool, (matched, name) in found.items() if matched == most)


def _counts(tool: str, name: str, matched: int, recipe_keys: set[str]) -> bool:
    """A verl path matched by its last part alone is left to the section hints when that part is a recipe
    key: ``ppo.temperature`` is ours, misplaced, not verl's rollout.temperature. TRL's names are flat."""
    return matched > 1 or tool == "TRL" or name.rpartition(".")[2] not in recipe_keys


def _shared_tail(path: list[str], name: list[str]) -> int:
    """How many last parts ``path`` and ``name`` share."""
    count = 0
    while count < min(len(path), len(name)) and path[-1 - count] == name[-1 - count]:
        count += 1
    return count


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
