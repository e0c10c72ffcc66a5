"""The recipe schema: one pydantic model per YAML section, unknown keys rejected.

Imports pydantic, yaml and the standard library only, so ``ppo validate`` and ``ppo --help`` never
import torch. Derived sizes are computed properties and never written back into the recipe.

Loading (bottom of the file) keeps the YAML line of every key, so a bad recipe becomes one line:
``recipe.yaml:14: ppo.kl_coeff: unknown key 'kl_coeff' in ppo`` plus a hint naming the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import types
from pathlib import Path
from typing import Annotated, Any, Iterable, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError

from ppo_cli.errors import RecipeError

Dtype = Literal["float32", "bfloat16", "float16", "auto"]
Quantization = Literal["none", "4bit", "8bit"]


def _rule_error(message: str, hint: str | None = None, key: str | None = None) -> PydanticCustomError:
    """A cross-field rule failed. ``key`` (dotted, relative to the validated model) names the key the
    error points at, so the message gets that key's path and YAML line instead of the section's."""
    # The message goes through str.format with ctx, so braces would break it.
    assert "{" not in message, message
    return PydanticCustomError("recipe_rule", message, {"hint": hint, "key": key})


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LoraConfig(Section):
    r: int = Field(16, gt=0, description="LoRA rank.")
    alpha: int = Field(32, gt=0, description="LoRA alpha (scaling = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout; 0 keeps rollout and update forwards identical.")
    target_modules: Union[list[str], Literal["all-linear"]] = Field(
        "all-linear", description="Module names to adapt, or 'all-linear'."
    )


class PolicyConfig(Section):
    path: str = Field(..., description="Local model directory or hub id.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    dtype: Dtype = Field("float32", description="Weights and compute dtype.")
    quantization: Quantization = Field("none", description="4bit/8bit base weights (bitsandbytes); 4bit + lora is QLoRA.")
    lora: LoraConfig | None = Field(None, description="Train a LoRA adapter; the reference is then the base with the adapter disabled.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in the backward pass to save memory.")
    trust_remote_code: bool = Field(False, description="Run model code from the hub repository. Off unless you trust it.")

    @model_validator(mode="after")
    def _quantized_needs_lora(self) -> "PolicyConfig":
        if self.quantization != "none" and self.lora is None:
            raise _rule_error(
                f"a {self.quantization} policy cannot be trained without LoRA",
                "add a `lora:` block under `policy:` (QLoRA) or set `policy.quantization: none`",
                key="quantization",
            )
        return self


class ReferenceConfig(Section):
    path: str | None = Field(
        None,
        description="A separate frozen reference model. Default: the policy's base (adapter disabled with LoRA, "
        "a frozen copy without).",
    )
    dtype: Dtype | None = Field(None, description="Default: the policy's dtype.")
    quantization: Quantization = Field(
        "none", description="Quantize a frozen reference copy (not used with LoRA unless reference.path is set)."
    )


class ValueConfig(Section):
    kind: Literal["auto", "adapter", "head", "model"] = Field(
        "auto",
        description="adapter: a second LoRA adapter on the policy base + a scalar head; head: a scalar head on the "
        "policy backbone; model: a separate model + head. auto: adapter with LoRA, model without "
        "(and always model with init_from: reward).",
    )
    init_from: Literal["policy", "reward"] = Field(
        "policy", description="Initialise a separate value model from the policy or the reward model (InstructGPT)."
    )
    path: str | None = Field(None, description="Explicit value model path (kind: model).")
    dtype: Dtype | None = Field(None, description="Default: the policy's dtype.")
    lora: LoraConfig | None = Field(None, description="Adapter settings for kind: adapter. Default: the policy's.")
    train_backbone: bool | None = Field(
        None,
        description="Does the value loss train the network under the value head? kind head (default false): true "
        "also trains the shared policy weights (old TRL's value-head models); false keeps the head a linear critic on "
        "the policy's features, and the policy then learns faster (docs/benchmarks.md). kind model (default true): "
        "false freezes the value model and trains only its head; with init_from: reward the critic then starts as "
        "TRL's does (the reward model's score at every prefix) without a second trained network. Not for adapter.",
    )


class ModelReward(Section):
    type: Literal["model"]
    path: str = Field(..., description="A sequence-classification model with one output (a scalar reward model).")
    weight: float = Field(1.0, description="Multiplies this component's score in the weighted sum.")
    dtype: Dtype = Field("float32", description="Weights and compute dtype of the reward model.")
    quantization: Quantization = Field("none", description="4bit/8bit frozen weights (bitsandbytes).")
    trust_remote_code: bool = Field(False, description="Run model code from the hub repository. Off unless you trust it.")
    max_length: int = Field(512, gt=0, description="Truncate prompt+response to this many reward-model tokens.")
    batch_size: int = Field(32, gt=0, description="Sequences per reward-model forward.")


class ClassifierReward(Section):
    type: Literal["classifier"]
    path: str = Field(..., description="A sequence classifier whose labels are mapped to rewards.")
    labels: dict[str, float] = Field(..., min_length=1, description="Label name -> reward, e.g. {positive: 10}.")
    scale_by_confidence: bool = Field(False, description="Multiply the dominant label's value by its probability.")
    mode: Literal["dominant", "expected"] = Field(
        "dominant", description="dominant: the argmax label's value; expected: sum of p(label) * value."
    )
    text: Literal["response", "prompt_and_response"] = Field("response", description="What the classifier reads.")
    weight: float = Field(1.0, description="Multiplies this component's score in the weighted sum.")
    dtype: Dtype = Field("float32", description="Weights and compute dtype of the classifier.")
    quantization: Quantization = Field("none", description="4bit/8bit frozen weights (bitsandbytes).")
    trust_remote_code: bool = Field(False, description="Run model code from the hub repository. Off unless you trust it.")
    max_length: int = Field(512, gt=0, description="Truncate the classifier input to this many tokens.")
    batch_size: int = Field(32, gt=0, description="Sequences per classifier forward.")


class FunctionReward(Section):
    type: Literal["function"]
    function: str = Field(
        ...,
        pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$",
        description="'package.module:name' or 'path/to/file.py:name', called as name(prompts, responses) -> list[float].",
    )
    weight: float = Field(1.0, description="Multiplies this component's score in the weighted sum.")


RewardComponent = Annotated[Union[ModelReward, ClassifierReward, FunctionReward], Field(discriminator="type")]


class RewardConfig(Section):
    components: list[RewardComponent] = Field(
        ..., min_length=1, description="Reward components (type: model | classifier | function); the score is their weighted sum."
    )
    missing_eos_penalty: float | None = Field(
        None, ge=0.0, description="Subtracted from the score of a response with no stop token (TRL's missing_eos_penalty)."
    )
    max_response_tokens: int | None = Field(None, gt=0, description="Responses longer than this get overlength_penalty.")
    overlength_penalty: float = Field(0.0, ge=0.0, description="Subtracted when a response passes max_response_tokens.")

    @model_validator(mode="after")
    def _overlength_needs_limit(self) -> "RewardConfig":
        if self.overlength_penalty > 0 and self.max_response_tokens is None:
            raise _rule_error(
                "has no effect without max_response_tokens",
                "set `reward.max_response_tokens` or remove `reward.overlength_penalty`",
                key="overlength_penalty",
            )
        return self


class DataConfig(Section):
    prompts: str = Field(..., description="Prompts: a .txt file (one per line), a .jsonl file, or a dataset directory.")
    field: str = Field("prompt", description="The prompt field in .jsonl / dataset rows.")
    eval_prompts: str | None = Field(None, description="Held-out prompts for before/after evaluation.")
    max_prompt_tokens: int = Field(64, gt=0, description="Longer prompts are truncated from the left.")
    chat_template: bool = Field(False, description="Wrap each prompt as a user turn with the tokenizer's chat template.")
    shuffle: bool = Field(True, description="Shuffle the prompts each pass (seeded).")


class GenerationConfig(Section):
    max_new_tokens: int = Field(32, gt=0, description="TRL: response_length.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature; log-probs use logits / temperature too.")
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling; 1.0 disables it.")
    stop_token: str | None = Field(None, description="Stop token text. Default: the tokenizer's EOS (TRL: stop_token='eos').")
    backend: Literal["hf", "vllm"] = Field(
        "hf",
        description="Who samples the rollouts. hf: transformers generate on the policy itself. vllm: an in-process "
        "vLLM engine (pip install 'ppo_cli[vllm]'; one process only) fed the same prompt token ids and sampling "
        "settings, kept current with the policy's LoRA adapter (or, without LoRA, its weights) before every rollout. "
        "The old log-probs are still the policy's own forward; the sampler's differ by numerics, logged as "
        "rollout/logprob_diff_mean and _max (see ppo.rollout_is_clip).",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0.0, le=1.0,
        description="vllm on a GPU: the fraction of GPU memory vLLM may take (weights + KV cache); the policy's "
        "training shares the rest. CPU: the KV cache is sized from the batch (VLLM_CPU_KVCACHE_SPACE overrides it).",
    )
    vllm_sleep_mode: bool = Field(
        False,
        description="vllm on a GPU: put vLLM to sleep between rollouts (its weights offloaded to CPU memory, its KV "
        "cache freed), so the update gets the GPU's memory back. Not available on CPU.",
    )


class AdaptiveKLConfig(Section):
    target: float = Field(..., gt=0.0, description="Target KL (summed over response tokens, nats) per sequence.")
    horizon: int = Field(10000, gt=0, description="Episodes over which the coefficient adapts.")


class PPOConfig(Section):
    rollout_batch_size: int = Field(16, gt=0, description="Prompts (episodes) per update (TRL: batch_size).")
    mini_batch_size: int = Field(8, gt=0, description="Episodes per optimizer step (TRL: mini_batch_size).")
    micro_batch_size: int = Field(8, gt=0, description="Episodes per forward/backward (TRL: per_device_train_batch_size).")
    micro_batch_tokens: int | None = Field(
        None, gt=0,
        description="In the update, instead of micro_batch_size episodes: micro-batches of at most this many tokens "
        "(episodes x (prompt + longest response)), filled longest response first, so short responses share a "
        "forward and memory is bounded by tokens (verl: use_dynamic_bsz). An episode longer than this gets a "
        "micro-batch of its own. The rollout's forwards still use micro_batch_size.",
    )
    ppo_epochs: int = Field(4, gt=0, description="Passes over each rollout batch (TRL: num_ppo_epochs).")
    cliprange: float = Field(0.2, gt=0.0, description="Clip range of the policy ratio (TRL: cliprange).")
    cliprange_value: float = Field(0.2, gt=0.0, description="Clip range of the value update (TRL: cliprange_value).")
    vf_coef: float = Field(0.1, ge=0.0, description="Weight of the value loss (TRL: vf_coef).")
    entropy_coef: float = Field(0.0, ge=0.0, description="Weight of the entropy bonus; 0 disables it.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount factor (TRL: gamma).")
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda (TRL: lam).")
    kl_coef: float = Field(0.05, ge=0.0, description="Initial per-token KL penalty coefficient (beta; TRL: kl_coef).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k1", description="Per-token KL estimator in the reward: k1 log-ratio (TRL's default), k2 half its square, "
        "k3 exp(-log-ratio) - 1 + log-ratio (TRL: kl_estimator k1/k3; k2 and k3 are never negative)."
    )
    adaptive_kl: AdaptiveKLConfig | None = Field(None, description="Adapt kl_coef towards a target KL.")
    whiten_advantages: bool = Field(True, description="Normalise advantages to zero mean, unit variance over response tokens.")
    whiten_rewards: bool = Field(False, description="Normalise the shaped per-token rewards before GAE (TRL: whiten_rewards).")
    max_kl: float | None = Field(None, gt=0.0, description="Stop the epoch loop early when mean approx-KL passes this.")
    rollout_is_clip: float | None = Field(
        None, gt=0.0,
        description="generation.backend vllm: truncated importance sampling (Yao et al. 2025). Each token's policy "
        "loss is weighted by min(exp(old log-prob - sampler log-prob), rollout_is_clip), correcting for the sampler's "
        "distribution differing from the trained policy's by numerics (bf16 kernels, another attention). Typical: 2.0. "
        "null: no correction.",
    )
    rollout_logprobs: Literal["forward", "generation"] = Field(
        "forward",
        description="Where the rollout's old log-probs (and value-head values) come from. forward: a separate "
        "forward pass over the finished sequences, bit-identical to the update's. generation: the sampling passes' "
        "own hidden states, one policy forward fewer per update (as TRL); equal up to float32 rounding (~1e-6). "
        "Only float32 unquantized policies use generation; others fall back to forward.",
    )

    @model_validator(mode="after")
    def _batch_sizes_divide(self) -> "PPOConfig":
        if self.rollout_batch_size % self.mini_batch_size:
            raise _rule_error(
                f"rollout_batch_size ({self.rollout_batch_size}) must be a multiple of mini_batch_size "
                f"({self.mini_batch_size})",
                "pick sizes where micro_batch_size divides mini_batch_size and mini_batch_size divides rollout_batch_size",
                key="mini_batch_size",
            )
        if self.mini_batch_size % self.micro_batch_size:
            raise _rule_error(
                f"mini_batch_size ({self.mini_batch_size}) must be a multiple of micro_batch_size "
                f"({self.micro_batch_size})",
                "pick sizes where micro_batch_size divides mini_batch_size and mini_batch_size divides rollout_batch_size",
                key="micro_batch_size",
            )
        return self

    @property
    def num_mini_batches(self) -> int:
        """Optimizer steps per PPO epoch."""
        return self.rollout_batch_size // self.mini_batch_size

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches accumulated into one optimizer step."""
        return self.mini_batch_size // self.micro_batch_size


class OptimConfig(Section):
    name: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = Field(
        "adamw", description="adamw (torch, fused); adamw_8bit keeps both moments in 8 bits (bitsandbytes: a quarter "
        "of fp32 AdamW's state, for full fine-tuning); paged_adamw_8bit also pages them out under GPU memory pressure.",
    )
    lr: float = Field(1e-5, gt=0.0, description="Learning rate of the policy (AdamW).")
    value_lr: float | None = Field(
        None, gt=0.0,
        description="Learning rate of the value parameters. Default: lr; for value.kind head, "
        "4 / hidden_size (a read-out layer: Adam then moves the value by about the same amount at every width).",
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="Clip the global gradient norm; null disables.")
    adam_eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    scheduler: Literal["constant", "linear", "cosine"] = Field("constant", description="Learning-rate schedule after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup, in updates (the schedule steps once per PPO update, as TRL).")


class TrainConfig(Section):
    total_updates: int = Field(..., gt=0, description="PPO updates (rollout + optimisation rounds).")
    save_every: int = Field(0, ge=0, description="Checkpoint every N updates; 0 saves only final/.")
    keep_checkpoints: int = Field(2, gt=0, description="Older checkpoints beyond this many are deleted.")
    log_every: int = Field(1, gt=0, description="Write metrics.jsonl every N updates.")
    sample_every: int = Field(10, ge=0, description="Write samples.jsonl every N updates; 0 disables.")
    num_samples: int = Field(4, ge=0, description="Samples written each time.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available, else cpu.")
    num_threads: int | None = Field(None, gt=0, description="torch CPU threads. Default: torch's.")
    max_consecutive_skips: int = Field(
        3, gt=0, description="Stop after this many updates in a row skipped for non-finite numbers."
    )


class MonitorConfig(Section):
    """Health warnings during training (ppo_cli/monitor.py): each rule looks at the last `window` updates."""

    enabled: bool = Field(True, description="Watch the metrics and warn about runs going wrong (the usual PPO failure modes).")
    window: int = Field(
        10, ge=2, description="Updates each rule looks at (the moving window); KL and value-loss trends also skip the first window."
    )
    repeat_every: int = Field(20, ge=1, description="Print a warning again after this many updates while it is still active.")
    trend: float = Field(
        0.5, gt=0.0, le=1.0, description="Kendall tau over the window that counts as a steady rise (its negative: a steady fall)."
    )
    clipfrac_high: float = Field(0.5, gt=0.0, le=1.0, description="Warn above this mean clip fraction (steps too large).")
    clipfrac_low: float = Field(
        0.05, ge=0.0, lt=1.0, description="Warn below this mean clip fraction while the reward is flat (steps too small)."
    )
    approx_kl_high: float = Field(
        0.1, gt=0.0, description="Warn above this mean approx-KL between the rollout policy and the updated one."
    )
    kl_per_token_high: float = Field(
        1.0, gt=0.0, description="Warn above this KL to the reference per response token, in nats (typical runs stay below 0.5)."
    )
    kl_growth: float = Field(
        2.0, gt=1.0, description="Warn when KL to the reference still rises after the first window, this many times its level then."
    )
    kl_zero: float = Field(
        1e-3, ge=0.0, description="Warn when KL to the reference (nats per response) stays below this: the reference is the policy."
    )
    value_loss_growth: float = Field(
        2.0, gt=1.0, description="Warn when the value loss rises steadily to this many times its lowest window mean."
    )
    entropy_drop: float = Field(
        0.2, gt=0.0, lt=1.0, description="Warn when the per-token policy entropy falls below this fraction of its starting value."
    )
    distinct_drop: float = Field(
        0.25, gt=0.0, lt=1.0,
        description="Warn when the reward rises while distinct-1 of the responses falls this fraction below its first window "
        "(reward hacking).",
    )
    eos_rate_floor: float = Field(0.0, ge=0.0, lt=1.0, description="Warn when the EOS rate stays at or below this for a whole window.")
    ratio_tolerance: float = Field(
        0.1, gt=0.0, description="Warn when the policy ratio before the first optimizer step is further than this from 1."
    )

    @model_validator(mode="after")
    def _clipfrac_band(self) -> "MonitorConfig":
        if self.clipfrac_low >= self.clipfrac_high:
            raise _rule_error(
                f"must be below monitor.clipfrac_high ({self.clipfrac_high}), got {self.clipfrac_low}",
                "the healthy clip fraction lies between the two; defaults 0.05 and 0.5",
                key="clipfrac_low",
            )
        return self


TrackerName = Literal["wandb", "mlflow", "aim", "comet_ml", "clearml", "dvclive", "swanlab", "trackio"]


class LoggingConfig(Section):
    tensorboard: bool = Field(
        False, description="Write TensorBoard event files to RUN_DIR/tensorboard/ with the metrics.jsonl names (no extra package)."
    )
    trackers: list[TrackerName] = Field(
        [], description="Experiment trackers run through accelerate (each needs its own package, e.g. pip install wandb)."
    )
    project: str = Field(
        "ppo_cli", min_length=1,
        description="The trackers' project (W&B project, MLflow experiment, ...); each run is a run in it, named after `name`.",
    )
    init_kwargs: dict[TrackerName, dict[str, Any]] = Field(
        {}, description="Extra arguments per tracker, as accelerate's init_trackers takes them, e.g. "
        "{wandb: {entity: my-team, tags: [ppo]}}.",
    )

    @model_validator(mode="after")
    def _init_kwargs_for_trackers_in_use(self) -> "LoggingConfig":
        unused = sorted(set(self.init_kwargs) - set(self.trackers))
        if unused:
            raise _rule_error(f"init_kwargs for {', '.join(unused)}, which is not in logging.trackers",
                              "add it to logging.trackers or remove its init_kwargs", key="init_kwargs")
        return self


class Recipe(Section):
    name: str = Field(
        ...,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Run name (letters, digits, '_', '.', '-'; starts with a letter or digit); "
        "the run directory is output_dir/name.",
    )
    seed: int = Field(0, description="Seeds torch, numpy and Python's random for the whole run.")
    output_dir: str = Field("runs", description="Parent directory of run directories.")
    policy: PolicyConfig = Field(..., description="The model being trained (path, dtype, quantization, lora).")
    reference: ReferenceConfig = Field(ReferenceConfig(), description="The frozen model the KL penalty compares to.")
    value: ValueConfig = Field(ValueConfig(), description="The critic (value model).")
    reward: RewardConfig = Field(..., description="Reward components and penalties.")
    data: DataConfig = Field(..., description="Where the prompts come from.")
    generation: GenerationConfig = Field(GenerationConfig(), description="Sampling settings for rollouts.")
    ppo: PPOConfig = Field(PPOConfig(), description="Batch sizes and PPO hyperparameters.")
    optim: OptimConfig = Field(OptimConfig(), description="Optimizer and learning-rate schedule.")
    train: TrainConfig = Field(..., description="Run length, checkpointing, logging and device.")
    monitor: MonitorConfig = Field(MonitorConfig(), description="Health warnings: thresholds of the rules watching the metrics.")
    logging: LoggingConfig = Field(LoggingConfig(), description="TensorBoard and experiment trackers, besides metrics.jsonl.")

    @property
    def run_dir(self) -> Path:
        """Where the run writes: output_dir/name."""
        return Path(self.output_dir) / self.name

    @property
    def value_kind(self) -> str:
        """The value model's resolved kind: 'auto' becomes 'adapter' with LoRA (unless the value model is
        initialised from the reward model), 'model' otherwise."""
        if self.value.kind != "auto":
            return self.value.kind
        if self.policy.lora is not None and self.value.init_from == "policy":
            return "adapter"
        return "model"

    @model_validator(mode="after")
    def _roles_fit_together(self) -> "Recipe":
        value = self.value
        if value.kind == "adapter" and self.policy.lora is None:
            raise _rule_error(
                "'adapter' needs a LoRA policy",
                "add a `lora:` block under `policy:` or set `value.kind: model`",
                key="value.kind",
            )
        if value.init_from == "reward":
            if value.kind in ("adapter", "head"):
                raise _rule_error(
                    f"'reward' needs a separate value model, not value.kind '{value.kind}'",
                    "set `value.kind: model` (or auto), or `value.init_from: policy`",
                    key="value.init_from",
                )
            if value.path is None and not any(c.type in ("model", "classifier") for c in self.reward.components):
                raise _rule_error(
                    "'reward' needs a reward component of type 'model' or 'classifier' to start from",
                    "add a model or classifier reward component, set `value.path`, or set `value.init_from: policy`",
                    key="value.init_from",
                )
        if value.path is not None and self.value_kind != "model":
            raise _rule_error(
                f"only used with a separate value model, but the value kind is '{self.value_kind}'",
                "set `value.kind: model` or remove `value.path`",
                key="value.path",
            )
        if value.train_backbone is not None and self.value_kind == "adapter":
            raise _rule_error(
                "not used with value kind 'adapter' (the value adapter is what trains)",
                "remove `value.train_backbone`, or set `value.kind: head` or `value.kind: model`",
                key="value.train_backbone",
            )
        if value.lora is not None and self.value_kind != "adapter":
            raise _rule_error(
                f"only used with value kind 'adapter', but the value kind is '{self.value_kind}'",
                "remove `value.lora` or set `value.kind: adapter` (needs `policy.lora`)",
                key="value.lora",
            )
        if self.ppo.rollout_is_clip is not None and self.generation.backend != "vllm":
            raise _rule_error(
                "corrects for a separate sampler and has no effect with generation.backend 'hf' (the policy samples itself)",
                "set `generation.backend: vllm` or remove `ppo.rollout_is_clip`",
                key="ppo.rollout_is_clip",
            )
        if self.generation.vllm_sleep_mode and self.generation.backend != "vllm":
            raise _rule_error(
                "only used with generation.backend 'vllm'",
                "set `generation.backend: vllm` or remove `generation.vllm_sleep_mode`",
                key="generation.vllm_sleep_mode",
            )
        if self.reference.quantization != "none" and self.policy.lora is not None and self.reference.path is None:
            raise _rule_error(
                "has no effect with a LoRA policy: the reference is the policy's base with the adapter disabled",
                "remove `reference.quantization`, quantize the base with `policy.quantization`, or set `reference.path`",
                key="reference.quantization",
            )
        return self


# --- loading -------------------------------------------------------------------------------------
#
# load_recipe = read the file -> YAML with the line of every key -> --set overrides -> validate.
# Every failure becomes a RecipeError whose message is one line, `<file>:<line>: <key.path>: <what>`,
# and whose hint says what is allowed.

KeyPath = tuple[str, ...]  # ('reward', 'components', '0', 'weight'): list indexes as strings too

_MORE_ERRORS = " (and {n} more error{s}; run `ppo validate {source} --all-errors` for all)"


@dataclasses.dataclass(frozen=True)
class RecipeProblem:
    """One validation error of a recipe, located in its file (or on the command line)."""

    source: str  # the recipe file as given
    line: int | None  # the YAML line of the key (or of its parent mapping when the key is missing)
    key_path: str  # 'ppo.kl_coef'; '' when the error concerns the whole recipe
    message: str
    hint: str | None = None
    from_override: bool = False  # the value came from --set

    def __str__(self) -> str:
        if self.from_override:  # the value came from the command line, not from the file
            return f"--set {self.key_path}: {self.message}" if self.key_path else f"--set: {self.message}"
        where = self.source if self.line is None else f"{self.source}:{self.line}"
        return f"{where}: {self.key_path}: {self.message}" if self.key_path else f"{where}: {self.message}"


class RecipeValidationError(RecipeError):
    """The recipe does not validate; ``problems`` holds every error, the message the first one."""

    def __init__(self, message: str, hint: str | None, problems: Iterable[RecipeProblem]):
        super().__init__(message, hint)
        self.problems = tuple(problems)


def load_recipe(path: str | Path, overrides: Iterable[str] = ()) -> Recipe:
    """Read a YAML recipe, apply ``key.path=value`` overrides (``--set``) and validate it.

    Raises RecipeError (a RecipeValidationError for schema errors) with a one-line message.
    """
    path = Path(path)
    source = str(path)
    data, lines = load_yaml_with_lines(_read_text(path), source)
    if data is None:
        raise RecipeError(f"{source}: the recipe is empty", "a recipe needs at least name, policy, reward, data and train")
    if not isinstance(data, dict):
        raise RecipeError(
            f"{source}:{lines[()]}: the recipe must be a mapping of keys (name:, policy:, ...), not a {_yaml_kind(data)}",
            "see the recipes/ directory for examples",
        )
    data, set_paths = apply_overrides(data, overrides)
    return validate_recipe(data, source=source, lines=lines, set_paths=set_paths)


def dump_resolved(recipe: Recipe) -> str:
    """The recipe as YAML with every default filled in: load_recipe reads it back to an equal Recipe."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False, allow_unicode=True, width=1_000)


def validate_recipe(
    data: Any, *, source: str = "<recipe>", lines: dict[KeyPath, int] | None = None, set_paths: Iterable[KeyPath] = ()
) -> Recipe:
    """Validate parsed YAML; errors are located with ``lines`` (key path -> line) and ``set_paths``."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        problems = describe_errors(exc, source=source, lines=lines or {}, set_paths=frozenset(set_paths))
    more = len(problems) - 1
    message = str(problems[0])
    if more:
        message += _MORE_ERRORS.format(n=more, s="s" if more > 1 else "", source=source)
    raise RecipeValidationError(message, problems[0].hint, problems)


# --- reading and YAML with line numbers ---


def _read_text(path: Path) -> str:
    source = str(path)
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.y*ml"))
        hint = f"recipes in it: {', '.join(found[:8])}" if found else "pass a .yaml recipe file"
        raise RecipeError(f"{source}: is a directory, not a recipe file", hint)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        siblings = {p.stem: p for p in path.parent.glob("*.y*ml")} if path.parent.is_dir() else {}
        close = difflib.get_close_matches(path.stem, list(siblings), n=1)
        hint = f"did you mean {siblings[close[0]]}?" if close else "check the path; shipped recipes are in recipes/"
        raise RecipeError(f"{source}: no such recipe file", hint) from None
    except PermissionError:
        raise RecipeError(f"{source}: permission denied", "check the file's permissions") from None
    except OSError as err:
        raise RecipeError(f"{source}: cannot read the recipe: {err.strerror or err}") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise RecipeError(
            f"{source}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x})", "save the recipe as UTF-8"
        ) from None


def load_yaml_with_lines(text: str, source: str = "<recipe>") -> tuple[Any, dict[KeyPath, int]]:
    """Parse one YAML document; also return the 1-based line of every key and list item by key path.

    ``()`` maps to the document's first line. Duplicate keys (which YAML silently resolves to the last
    one) are an error.
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        lines: dict[KeyPath, int] = {(): node.start_mark.line + 1}
        _record_lines(node, (), lines, source, frozenset())
        return loader.construct_document(node), lines
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        hint = "check the indentation, and quote values that contain ': ', ' #' or start with a special character"
        problem = err.problem or err.context
        if err.context and problem.startswith("but "):  # "expected a single document ... but found another"
            problem = f"{err.context} {problem}"
        elif err.context and err.context_mark is not None:
            hint = f"{err.context} at line {err.context_mark.line + 1}; {hint}"
        raise RecipeError(f"{source}{line}: YAML syntax error: {problem}", hint) from None
    except yaml.YAMLError as err:
        raise RecipeError(f"{source}: YAML error: {_one_line(str(err))}") from None
    finally:
        loader.dispose()


def _record_lines(node: yaml.Node, path: KeyPath, lines: dict[KeyPath, int], source: str, active: frozenset) -> None:
    if id(node) in active:  # a recursive alias
        return
    active = active | {id(node)}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # merged keys ('<<') fall back to the line of their parent
            key_path = path + (key_node.value,)
            line = key_node.start_mark.line + 1
            if key_path in lines:
                raise RecipeError(
                    f"{source}:{line}: {'.'.join(key_path)}: duplicate key (first at line {lines[key_path]})",
                    "YAML keeps only the last one; remove one of them",
                )
            lines[key_path] = line
            _record_lines(value_node, key_path, lines, source, active)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            lines[path + (str(index),)] = item.start_mark.line + 1
            _record_lines(item, path + (str(index),), lines, source, active)


# --- --set overrides ---


def apply_overrides(data: dict, overrides: Iterable[str]) -> tuple[dict, frozenset[KeyPath]]:
    """Apply ``key.path=value`` overrides to a copy of ``data``; return it and the paths that were set.

    The value is parsed as YAML (``0.1``, ``null``, ``[a, b]``, ``{r: 8}``) and typed later by validation.
    Key paths are checked against the schema first, so a misspelt key fails here with the allowed keys.
    """
    data = copy.deepcopy(data)
    set_paths = set()
    for item in overrides:
        parts, value = _parse_override(item)
        kinds, leaf = _check_override_path(data, parts, item)
        if isinstance(value, (bool, int, float)) or not isinstance(value, (str, list, dict, type(None))):
            if _is_str_type(leaf):  # `--set name=2024`: a string field keeps the text as typed
                value = item.partition("=")[2].strip()
        _write(data, parts, kinds, value)
        set_paths.add(tuple(parts))
    return data, frozenset(set_paths)


def _parse_override(item: str) -> tuple[list[str], Any]:
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(
            f"--set {item or repr(item)}: expected key.path=value",
            "for example --set ppo.kl_coef=0.1 or --set policy.lora=null",
        )
    parts = key.split(".")
    if not all(parts):
        raise RecipeError(f"--set {item}: empty key in '{key}'", "separate keys with single dots: --set ppo.kl_coef=0.1")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or _one_line(str(err))
        raise RecipeError(
            f"--set {item}: the value is not valid YAML: {problem}",
            f"quote the value, e.g. --set '{key}=\"...\"'",
        ) from None
    return parts, value


def _check_override_path(data: dict, parts: list[str], item: str) -> tuple[list[type], Any]:
    """Walk the schema along ``parts``; return the container kind (dict or list) each part indexes
    into, and the type of the leaf. Unknown keys and bad indexes raise RecipeError."""
    tp: Any = Recipe
    node: Any = data
    kinds: list[type] = []
    for depth, part in enumerate(parts):
        where = ".".join(parts[:depth])
        tp = _strip_optional(tp)
        if _is_plain_union(tp):  # e.g. list[str] | 'all-linear': index into the list member
            tp = next((a for a in get_args(tp) if get_origin(a) is list), tp) if part.isdigit() else tp
        fields = _fields_of(tp, node)
        if fields is not None:
            if part not in fields:
                close = difflib.get_close_matches(part, fields, n=1)
                raise RecipeError(
                    f"--set {item}: unknown key '{part}' in {where or 'the recipe'}; allowed: {', '.join(fields)}",
                    f"did you mean '{close[0]}'?" if close else "run `ppo validate RECIPE` to see every key",
                )
            kinds.append(dict)
            tp, node = fields[part].annotation, node.get(part) if isinstance(node, dict) else None
        elif get_origin(tp) is list:
            length = len(node) if isinstance(node, list) else 0
            if not part.isdigit():
                raise RecipeError(f"--set {item}: {where} is a list; index it with a number, e.g. {where}.0")
            if int(part) > length:
                raise RecipeError(
                    f"--set {item}: index {part} is out of range: {where} has {length} item{'s' * (length != 1)}",
                    f"use {where}.{length} to append an item",
                )
            kinds.append(list)
            tp, node = get_args(tp)[0], node[int(part)] if int(part) < length else None
        elif get_origin(tp) is dict:
            kinds.append(dict)
            tp, node = get_args(tp)[1], node.get(part) if isinstance(node, dict) else None
        else:
            raise RecipeError(f"--set {item}: {where} is a single value, not a section", f"use --set {where}=VALUE")
    return kinds, _strip_optional(tp)


def _write(data: dict, parts: list[str], kinds: list[type], value: Any) -> None:
    container: Any = data
    for depth, part in enumerate(parts):
        key: Any = int(part) if kinds[depth] is list else part
        if depth == len(parts) - 1:
            child = value
        else:
            current = container[key] if _has(container, key) else None
            child = current if isinstance(current, kinds[depth + 1]) else kinds[depth + 1]()
        if isinstance(container, list) and key == len(container):
            container.append(child)
        else:
            container[key] = child
        container = child


def _has(container: Any, key: Any) -> bool:
    return key < len(container) if isinstance(container, list) else key in container


# --- ValidationError -> located one-line problems ---

_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping (key: value lines)",
    "model_type": "a mapping (key: value lines)",
    "model_attributes_type": "a mapping (key: value lines)",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


@dataclasses.dataclass
class _Where:
    path: list[str]  # key path in the YAML (union member labels removed)
    owner: type[BaseModel] | None  # the model holding the last key
    field: FieldInfo | None  # the schema field of the last key
    tp: Any  # the schema type at the path
    union_member: bool  # the error is about one member of a plain union (e.g. list[str] | 'all-linear')


def describe_errors(
    exc: ValidationError, *, source: str, lines: dict[KeyPath, int], set_paths: frozenset[KeyPath]
) -> list[RecipeProblem]:
    """Turn pydantic's errors into located one-line problems, first in the file first."""
    described: list[tuple[_Where, str, str | None, str | None]] = []  # where, message, hint, expected
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] == "recipe_rule" and (err.get("ctx") or {}).get("key"):
            loc += tuple(err["ctx"]["key"].split("."))
        where = _walk_loc(loc)
        message, hint = _message_and_hint(err, where)
        expected = _expected(err)
        previous = described[-1] if described else None
        if previous and where.union_member and previous[0].union_member and previous[0].path == where.path:
            if previous[3] and expected:  # one message for all members: "expected a list or 'all-linear'"
                merged = f"{previous[3]} or {expected}"
                message, hint = f"expected {merged}, got {_show(err['input'])}", _takes_hint(where, merged)
                described[-1] = (where, message, hint, merged)
            continue
        described.append((where, message, hint, expected))
    problems = [_locate(where.path, message, hint, source, lines, set_paths) for where, message, hint, _ in described]
    return sorted(problems, key=lambda p: (p.from_override, p.line or 0))


def _walk_loc(loc: tuple) -> _Where:
    """Follow pydantic's error location through the schema, dropping the union labels it inserts."""
    where = _Where([], None, None, Recipe, False)
    for item in loc:
        tp = _strip_optional(where.tp) if where.tp is not None else None
        if tp is not None and _is_discriminated(tp):  # the item is the tag, e.g. 'function'
            where.tp = _member_for_tag(tp, item)
            continue
        if tp is not None and _is_plain_union(tp):  # the item is a member label, e.g. 'list[str]'
            where.tp, where.union_member = None, True
            continue
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            where.owner, where.field = tp, tp.model_fields.get(str(item))
            where.tp = where.field.annotation if where.field else None
        elif get_origin(tp) in (list, dict):
            where.tp = get_args(tp)[-1]
        else:
            where.tp = None
        where.path.append(str(item))
    return where


def _message_and_hint(err: dict, where: _Where) -> tuple[str, str | None]:
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    leaf = where.path[-1] if where.path else ""
    parent = ".".join(where.path[:-1])
    description = where.field.description if where.field is not None else None
    if kind == "missing":
        hint = f"add `{leaf}:` under `{parent}:`" if parent else f"add `{leaf}:` at the top level"
        return "missing required key", hint + (f" — {description}" if description else "")
    if kind == "extra_forbidden":
        allowed = list(where.owner.model_fields) if where.owner is not None else []
        close = difflib.get_close_matches(leaf, allowed, n=1)
        hint = (f"did you mean '{close[0]}'? " if close else "") + f"allowed keys: {', '.join(allowed)}"
        return f"unknown key '{leaf}'" + (f" in {parent}" if parent else ""), hint
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        where.path.append(ctx.get("discriminator", "'type'").strip("'"))
        allowed = ", ".join(repr(tag) for tag in _tags(_strip_optional(where.tp)))
        if kind == "union_tag_not_found":
            return "missing required key", f"add `{where.path[-1]}:` to this item; allowed values: {allowed}"
        return f"invalid value {_show(ctx.get('tag'))}", f"allowed values: {allowed}"
    if kind == "literal_error":
        return f"invalid value {_show(value)}", f"allowed values: {ctx.get('expected')}"
    if kind == "recipe_rule":
        return err["msg"], ctx.get("hint")
    if kind == "value_error":
        return _one_line(str(ctx.get("error", err["msg"]))), description
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {_show(value)}", _takes_hint(where, _EXPECTED[kind])
    if kind in _BOUNDS:
        limit = next(iter(ctx.values()))
        return f"must be {_BOUNDS[kind]} {limit}, got {_show(value)}", _range_hint(where, leaf, description)
    if kind == "too_short":
        n = ctx.get("min_length")
        return f"needs at least {n} item{'s' * (n != 1)}", description
    if kind == "string_pattern_mismatch":
        return f"invalid value {_show(value)}", description or f"must match {ctx.get('pattern')}"
    return _one_line(err["msg"][:1].lower() + err["msg"][1:]), description


def _takes_hint(where: _Where, expected: str) -> str:
    description = where.field.description if where.field is not None else None
    return f"`{'.'.join(where.path)}` takes {expected}" + (f": {description}" if description else "")


def _range_hint(where: _Where, leaf: str, description: str | None) -> str | None:
    """'allowed: 0.0 <= gamma <= 1.0' from the field's gt/ge/lt/le constraints."""
    if where.field is None:
        return description
    low = high = ""
    for meta in where.field.metadata:
        for attr, op in (("gt", "<"), ("ge", "<=")):
            if getattr(meta, attr, None) is not None:
                low = f"{getattr(meta, attr)} {op} "
        for attr, op in (("lt", "<"), ("le", "<=")):
            if getattr(meta, attr, None) is not None:
                high = f" {op} {getattr(meta, attr)}"
    allowed = f"allowed: {low}{leaf}{high}" if low or high else None
    return "; ".join(part for part in (allowed, description) if part) or None


def _expected(err: dict) -> str | None:
    if err["type"] == "literal_error":
        return (err.get("ctx") or {}).get("expected")
    return _EXPECTED.get(err["type"])


def _locate(
    path: list[str], message: str, hint: str | None, source: str, lines: dict[KeyPath, int], set_paths: frozenset
) -> RecipeProblem:
    key = tuple(path)
    dotted = ".".join(path)
    if any(key[:n] in set_paths for n in range(1, len(key) + 1)):
        return RecipeProblem(source, None, dotted, message, hint, from_override=True)
    line = next((lines[key[:n]] for n in range(len(key), -1, -1) if key[:n] in lines), None)
    return RecipeProblem(source, line, dotted, message, hint)


# --- schema introspection ---


def _strip_optional(tp: Any) -> Any:
    """``X | None`` -> X; ``Annotated[X, ...]`` -> X unless it carries a discriminator."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated and not _is_discriminated(tp):
            tp = get_args(tp)[0]
        elif origin in (Union, types.UnionType) and type(None) in get_args(tp):
            rest = [a for a in get_args(tp) if a is not type(None)]
            tp = rest[0] if len(rest) == 1 else Union[tuple(rest)]
        else:
            return tp


def _is_discriminated(tp: Any) -> bool:
    return get_origin(tp) is Annotated and any(
        isinstance(meta, FieldInfo) and meta.discriminator for meta in get_args(tp)[1:]
    )


def _is_plain_union(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType)


def _members(tp: Any) -> list[type[BaseModel]]:
    return list(get_args(get_args(tp)[0]))


def _tags(tp: Any) -> list[str]:
    return [tag for member in _members(tp) for tag in get_args(member.model_fields["type"].annotation)]


def _member_for_tag(tp: Any, tag: Any) -> type[BaseModel] | None:
    return next((m for m in _members(tp) if tag in get_args(m.model_fields["type"].annotation)), None)


def _fields_of(tp: Any, node: Any) -> dict[str, FieldInfo] | None:
    """The fields allowed at a mapping of type ``tp``: a model's, or for a discriminated union the
    member named by the node's ``type`` (all members' fields when it has none). None: not a model."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return dict(tp.model_fields)
    if _is_discriminated(tp):
        member = _member_for_tag(tp, node.get("type")) if isinstance(node, dict) else None
        if member is not None:
            return dict(member.model_fields)
        return {name: f for m in _members(tp) for name, f in m.model_fields.items()}
    return None


def _is_str_type(tp: Any) -> bool:
    if tp is str:
        return True
    return get_origin(tp) is Literal and all(isinstance(a, str) for a in get_args(tp))


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML: strings quoted, true/false/null, short."""
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    return _one_line(text if len(text) <= 60 else text[:57] + "...")


def _yaml_kind(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "value")


def _one_line(text: str) -> str:
    return " ".join(text.split())
