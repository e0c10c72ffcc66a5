"""The recipe schema: one pydantic model per YAML section, unknown keys rejected.

Imports pydantic and yaml only, so ``ppo validate`` and ``ppo --help`` never import torch.
Derived sizes are computed properties and never written back into the recipe.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

Dtype = Literal["float32", "bfloat16", "float16", "auto"]
Quantization = Literal["none", "4bit", "8bit"]


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
    gradient_checkpointing: bool = False
    trust_remote_code: bool = Field(False, description="Run model code from the hub repository. Off unless you trust it.")

    @model_validator(mode="after")
    def _quantized_needs_lora(self) -> "PolicyConfig":
        if self.quantization != "none" and self.lora is None:
            raise ValueError(
                f"a {self.quantization} policy cannot be trained without LoRA: add a `policy.lora` block "
                "(QLoRA) or set policy.quantization: none"
            )
        return self


class ReferenceConfig(Section):
    path: str | None = Field(
        None,
        description="A separate frozen reference model. Default: the policy's base (adapter disabled with LoRA, "
        "a frozen copy without).",
    )
    dtype: Dtype | None = Field(None, description="Default: the policy's dtype.")
    quantization: Quantization = Field("none", description="Quantize a frozen reference copy (not used with LoRA).")


class ValueConfig(Section):
    kind: Literal["auto", "adapter", "head", "model"] = Field(
        "auto",
        description="adapter: a second LoRA adapter on the policy base + a scalar head; head: a scalar head on the "
        "policy backbone; model: a separate model + head. auto: adapter with LoRA, model without.",
    )
    init_from: Literal["policy", "reward"] = Field(
        "policy", description="Initialise a separate value model from the policy or the reward model (InstructGPT)."
    )
    path: str | None = Field(None, description="Explicit value model path (kind: model).")
    dtype: Dtype | None = Field(None, description="Default: the policy's dtype.")
    lora: LoraConfig | None = Field(None, description="Adapter settings for kind: adapter. Default: the policy's.")


class ModelReward(Section):
    type: Literal["model"]
    path: str = Field(..., description="A sequence-classification model with one output (a scalar reward model).")
    weight: float = 1.0
    dtype: Dtype = "float32"
    quantization: Quantization = "none"
    trust_remote_code: bool = False
    max_length: int = Field(512, gt=0, description="Truncate prompt+response to this many reward-model tokens.")
    batch_size: int = Field(32, gt=0)


class ClassifierReward(Section):
    type: Literal["classifier"]
    path: str = Field(..., description="A sequence classifier whose labels are mapped to rewards.")
    labels: dict[str, float] = Field(..., min_length=1, description="Label name -> reward, e.g. {positive: 10}.")
    scale_by_confidence: bool = Field(False, description="Multiply the dominant label's value by its probability.")
    mode: Literal["dominant", "expected"] = Field(
        "dominant", description="dominant: the argmax label's value; expected: sum of p(label) * value."
    )
    text: Literal["response", "prompt_and_response"] = Field("response", description="What the classifier reads.")
    weight: float = 1.0
    dtype: Dtype = "float32"
    quantization: Quantization = "none"
    trust_remote_code: bool = False
    max_length: int = Field(512, gt=0)
    batch_size: int = Field(32, gt=0)


class FunctionReward(Section):
    type: Literal["function"]
    function: str = Field(
        ...,
        pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$",
        description="'package.module:name' or 'path/to/file.py:name', called as name(prompts, responses) -> list[float].",
    )
    weight: float = 1.0


RewardComponent = Annotated[Union[ModelReward, ClassifierReward, FunctionReward], Field(discriminator="type")]


class RewardConfig(Section):
    components: list[RewardComponent] = Field(..., min_length=1)
    missing_eos_penalty: float | None = Field(
        None, ge=0.0, description="Subtracted from the score of a response with no stop token (TRL's missing_eos_penalty)."
    )
    max_response_tokens: int | None = Field(None, gt=0, description="Responses longer than this get overlength_penalty.")
    overlength_penalty: float = Field(0.0, ge=0.0, description="Subtracted when a response passes max_response_tokens.")


class DataConfig(Section):
    prompts: str = Field(..., description="Prompts: a .txt file (one per line), a .jsonl file, or a dataset directory.")
    field: str = Field("prompt", description="The prompt field in .jsonl / dataset rows.")
    eval_prompts: str | None = Field(None, description="Held-out prompts for before/after evaluation.")
    max_prompt_tokens: int = Field(64, gt=0, description="Longer prompts are truncated from the left.")
    chat_template: bool = Field(False, description="Wrap each prompt as a user turn with the tokenizer's chat template.")
    shuffle: bool = True


class GenerationConfig(Section):
    max_new_tokens: int = Field(32, gt=0, description="TRL: response_length.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature; log-probs use logits / temperature too.")
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop_token: str | None = Field(None, description="Stop token text. Default: the tokenizer's EOS (TRL: stop_token='eos').")


class AdaptiveKLConfig(Section):
    target: float = Field(..., gt=0.0, description="Target KL (summed over response tokens, nats) per sequence.")
    horizon: int = Field(10000, gt=0, description="Episodes over which the coefficient adapts.")


class PPOConfig(Section):
    rollout_batch_size: int = Field(16, gt=0, description="Prompts (episodes) per update (TRL: batch_size).")
    mini_batch_size: int = Field(8, gt=0, description="Episodes per optimizer step (TRL: mini_batch_size).")
    micro_batch_size: int = Field(8, gt=0, description="Episodes per forward/backward (TRL: per_device_train_batch_size).")
    ppo_epochs: int = Field(4, gt=0, description="Passes over each rollout batch (TRL: num_ppo_epochs).")
    cliprange: float = Field(0.2, gt=0.0)
    cliprange_value: float = Field(0.2, gt=0.0)
    vf_coef: float = Field(0.1, ge=0.0)
    entropy_coef: float = Field(0.0, ge=0.0)
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    gae_lambda: float = Field(0.95, ge=0.0, le=1.0, description="TRL: lam.")
    kl_coef: float = Field(0.05, ge=0.0, description="Initial per-token KL penalty coefficient (beta).")
    kl_estimator: Literal["k1", "k3"] = "k1"
    adaptive_kl: AdaptiveKLConfig | None = Field(None, description="Adapt kl_coef towards a target KL.")
    whiten_advantages: bool = True
    whiten_rewards: bool = False
    max_kl: float | None = Field(None, gt=0.0, description="Stop the epoch loop early when mean approx-KL passes this.")

    @model_validator(mode="after")
    def _batch_sizes_divide(self) -> "PPOConfig":
        if self.rollout_batch_size % self.mini_batch_size:
            raise ValueError(
                f"rollout_batch_size ({self.rollout_batch_size}) must be a multiple of mini_batch_size "
                f"({self.mini_batch_size})"
            )
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(
                f"mini_batch_size ({self.mini_batch_size}) must be a multiple of micro_batch_size "
                f"({self.micro_batch_size})"
            )
        return self

    @property
    def num_mini_batches(self) -> int:
        return self.rollout_batch_size // self.mini_batch_size

    @property
    def grad_accum_steps(self) -> int:
        return self.mini_batch_size // self.micro_batch_size


class OptimConfig(Section):
    lr: float = Field(1e-5, gt=0.0)
    value_lr: float | None = Field(None, gt=0.0, description="Learning rate of the value parameters. Default: lr.")
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="Clip the global gradient norm; null disables.")
    adam_eps: float = Field(1e-8, gt=0.0)
    scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0, description="Linear warmup, in optimizer steps.")


class TrainConfig(Section):
    total_updates: int = Field(..., gt=0, description="PPO updates (rollout + optimisation rounds).")
    save_every: int = Field(0, ge=0, description="Checkpoint every N updates; 0 saves only final/.")
    keep_checkpoints: int = Field(2, gt=0)
    log_every: int = Field(1, gt=0)
    sample_every: int = Field(10, ge=0, description="Write samples.jsonl every N updates; 0 disables.")
    num_samples: int = Field(4, ge=0, description="Samples written each time.")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    num_threads: int | None = Field(None, gt=0, description="torch CPU threads. Default: torch's.")


class Recipe(Section):
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Run name; the run directory is output_dir/name.")
    seed: int = 0
    output_dir: str = "runs"
    policy: PolicyConfig
    reference: ReferenceConfig = ReferenceConfig()
    value: ValueConfig = ValueConfig()
    reward: RewardConfig
    data: DataConfig
    generation: GenerationConfig = GenerationConfig()
    ppo: PPOConfig = PPOConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig

    @property
    def value_kind(self) -> str:
        """The value model's resolved kind: 'auto' becomes 'adapter' with LoRA, 'model' without."""
        if self.value.kind != "auto":
            return self.value.kind
        return "adapter" if self.policy.lora is not None else "model"

    @model_validator(mode="after")
    def _value_adapter_needs_lora(self) -> "Recipe":
        if self.value.kind == "adapter" and self.policy.lora is None:
            raise ValueError("value.kind 'adapter' needs a LoRA policy: add policy.lora or use value.kind: model")
        if self.value.init_from == "reward" and self.value.kind in ("adapter", "head"):
            raise ValueError("value.init_from 'reward' needs value.kind: model (a separate value model)")
        return self


# --- loading -------------------------------------------------------------------------------------


def load_recipe(path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read a YAML recipe, apply ``key.path=value`` overrides and validate it."""
    import yaml

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f) or {}
    for item in overrides:
        key, _, raw = item.partition("=")
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(raw)
    return Recipe.model_validate(data)


def dump_resolved(recipe: Recipe) -> str:
    """The recipe as YAML with every default filled in: a run can be re-run from it."""
    import yaml

    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
