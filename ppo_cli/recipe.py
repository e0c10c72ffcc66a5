"""The recipe schema: one pydantic model per YAML section, unknown keys rejected.

Imports pydantic, yaml and the standard library only, so ``ppo validate`` and ``ppo --help`` never
import torch. Derived sizes are computed properties and never written back into the recipe.

Loading it from YAML with line numbers and ``--set`` overrides is recipe_loading.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

Dtype = Literal["float32", "bfloat16", "float16", "auto"]
Quantization = Literal["none", "4bit", "8bit"]

# value.kind's names, each a Critic class in engine/critics.py's CRITICS (a test checks they agree).
CRITIC_KINDS = {
    "adapter": "a second LoRA adapter on the policy's base + a scalar head (needs policy.lora)",
    "head": "a scalar head on the policy's own hidden states: one forward gives logits and values",
    "model": "a separate model + a scalar head, from the policy, the reward model (init_from) or value.path",
    "none": "no critic: nothing built, trained or saved (the critic-free ppo.advantage estimators)",
}
# ppo.advantage's estimators that need no critic (every one but gae), and the ppo keys only gae reads.
CRITIC_FREE = ("grpo", "rloo", "reinforce_pp")
GAE_ONLY = ("vf_coef", "cliprange_value", "gae_lambda", "whiten_rewards", "whiten_advantages")


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
    adapter: str | None = Field(
        None,
        description="A peft LoRA adapter (local directory or hub id), e.g. from SFT, merged into the base at load: "
        "the PPO run starts from it and, unless reference.path is set, uses it as the reference too.",
    )
    lora: LoraConfig | None = Field(None, description="Train a LoRA adapter; the reference is then the base with the adapter disabled.")
    attn_implementation: Literal["auto", "sdpa", "flash_attention_2", "eager"] = Field(
        "auto", description="Attention kernel of the policy, reference and value model: auto is transformers' choice for "
        "the architecture (sdpa where it is supported); flash_attention_2 needs a CUDA GPU and the flash-attn package.",
    )
    trust_remote_code: bool = Field(False, description="Run model code from the hub repository. Off unless you trust it.")

    @model_validator(mode="before")
    @classmethod
    def _checkpointing_moved(cls, data):
        if isinstance(data, dict) and "gradient_checkpointing" in data:
            raise _rule_error(
                "policy.gradient_checkpointing is now train.gradient_checkpointing (auto, true or false)",
                "move it under `train:`; auto turns it on where `ppo plan` says the activations need it",
            )
        return data

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
    kind: Literal[("auto", *CRITIC_KINDS)] = Field(  # type: ignore[valid-type]
        "auto",
        description="; ".join(f"{name}: {description}" for name, description in CRITIC_KINDS.items())
        + ". auto: none for a critic-free ppo.advantage (grpo, rloo, reinforce_pp); with gae (chosen by wall-clock "
        "to a target reward, docs/benchmarks.md) the frozen reward-model critic "
        "(model, init_from: reward, train_backbone: false) when the reward has a scalar `type: model` component of the "
        "policy's architecture and tokenizer, else head, with LoRA and without; model with value.path or "
        "init_from: reward; adapter with value.lora.",
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
    loads_model: ClassVar[bool] = True  # a sequence-classification model to load (memory, value init_from)
    type: Literal["model"]
    path: str = Field(..., description="A sequence-classification model with one output (a scalar reward model).")
    weight: float = Field(1.0, description="Multiplies this component's score in the weighted sum.")
    dtype: Dtype = Field("float32", description="Weights and compute dtype of the reward model.")
    quantization: Quantization = Field("none", description="4bit/8bit frozen weights (bitsandbytes).")
    trust_remote_code: bool = Field(False, description="Run model code from the hub repository. Off unless you trust it.")
    text: Literal["prompt_and_response", "conversation"] = Field(
        "prompt_and_response",
        description="What the reward model reads: the prompt text followed by the response, or the conversation "
        "(prompt messages + the response as the assistant turn) in the reward model's own chat template.",
    )
    max_length: int = Field(512, gt=0, description="Truncate prompt+response to this many reward-model tokens.")
    batch_size: int = Field(32, gt=0, description="Sequences per reward-model forward.")


class ClassifierReward(Section):
    loads_model: ClassVar[bool] = True
    type: Literal["classifier"]
    path: str = Field(..., description="A sequence classifier whose labels are mapped to rewards.")
    labels: dict[str, float] = Field(..., min_length=1, description="Label name -> reward, e.g. {positive: 10}.")
    scale_by_confidence: bool = Field(False, description="Multiply the dominant label's value by its probability.")
    mode: Literal["dominant", "expected"] = Field(
        "dominant", description="dominant: the argmax label's value; expected: sum of p(label) * value."
    )
    text: Literal["response", "prompt_and_response", "conversation"] = Field(
        "response",
        description="What the classifier reads; conversation: prompt messages + the response as the assistant "
        "turn in the classifier's own chat template.",
    )
    weight: float = Field(1.0, description="Multiplies this component's score in the weighted sum.")
    dtype: Dtype = Field("float32", description="Weights and compute dtype of the classifier.")
    quantization: Quantization = Field("none", description="4bit/8bit frozen weights (bitsandbytes).")
    trust_remote_code: bool = Field(False, description="Run model code from the hub repository. Off unless you trust it.")
    max_length: int = Field(512, gt=0, description="Truncate the classifier input to this many tokens.")
    batch_size: int = Field(32, gt=0, description="Sequences per classifier forward.")


class FunctionReward(Section):
    loads_model: ClassVar[bool] = False
    type: Literal["function"]
    function: str = Field(
        ...,
        pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$",
        description="'package.module:name' or 'path/to/file.py:name', called as name(prompts, responses, **columns) -> "
        "list[float | None]: the prompt rows' other dataset columns (e.g. answer) as keyword lists, if it takes them; "
        "may be async def.",
    )
    weight: float = Field(1.0, description="Multiplies this component's score in the weighted sum.")


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")
# Header names whose value is a credential: it must come from the environment (${VAR}), never the recipe.
SECRET_HEADER = re.compile(r"authorization|api[-_]?key|token|secret|password|cookie", re.IGNORECASE)


def is_loopback_host(host: str | None) -> bool:
    return bool(host) and (host.lower() in LOOPBACK_HOSTS or host.startswith("127."))


class RemoteReward(Section):
    """What the http and judge components share: how requests are sent, retried and given up on."""

    loads_model: ClassVar[bool] = False
    weight: float = Field(1.0, description="Multiplies this component's score in the weighted sum.")
    timeout_s: float = Field(30.0, gt=0.0, description="Seconds one request may take (connect + answer); then it is retried.")
    retries: int = Field(3, ge=0, le=20, description="Retries after a timeout, a connection error, HTTP 429 or 5xx.")
    retry_backoff_s: float = Field(
        0.5, ge=0.0, description="First retry's wait; doubled each retry, with +-50% jitter, at most 30 s."
    )
    max_concurrency: int = Field(4, ge=1, description="Requests in flight at once.")
    on_failure: Literal["skip", "error"] = Field(
        "skip", description="skip: a completion without a reward leaves the update (masked, not scored 0) and is counted "
        "(reward/failed_rate); error: stop the run at the first failure.",
    )
    allow_insecure_http: bool = Field(
        False, description="Send credentials (an Authorization header, an API key) over plain http to a host that is not "
        "this machine. Off: such a recipe is refused.",
    )

    def _check_transport(self, url: str, credentials: bool, key: str) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise _rule_error(f"'{url}' is not an http(s) URL", "write it as http://HOST:PORT/PATH or https://...", key=key)
        if credentials and parts.scheme == "http" and not is_loopback_host(parts.hostname) and not self.allow_insecure_http:
            raise _rule_error(
                f"would send credentials over plain http to {parts.hostname}",
                "use https, or set allow_insecure_http: true if the network between the two is trusted", key=key,
            )


class HttpReward(RemoteReward):
    type: Literal["http"]
    url: str = Field(..., description='POST {"prompts", "responses", "columns"} -> {"rewards": [number or null, ...]}.')
    batch_size: int = Field(32, gt=0, description="Completions per request.")
    headers: dict[str, str] = Field(
        {}, description="Request headers; ${VAR} is read from the environment when a request is sent and never written "
        "out. Credentials (Authorization, *key*, *token*) must be ${VAR}.",
    )

    @model_validator(mode="after")
    def _safe(self) -> "HttpReward":
        for name, value in self.headers.items():
            if SECRET_HEADER.search(name) and "${" not in value:
                raise _rule_error(f"header '{name}' holds a literal credential",
                                  "put it in an environment variable and write e.g. 'Bearer ${RM_TOKEN}'", key="headers")
        self._check_transport(self.url, any(SECRET_HEADER.search(n) for n in self.headers), "url")
        return self


class JudgeReward(RemoteReward):
    type: Literal["judge"]
    base_url: str = Field(..., description="An OpenAI-compatible server's base URL, e.g. http://127.0.0.1:8000/v1 "
                          "(vLLM, TGI, llama.cpp, a hosted API); POST base_url/chat/completions.")
    model: str = Field(..., min_length=1, description="The model name the server expects.")
    api_key_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                                    description="Environment variable holding the API key (sent as a Bearer token).")
    prompt: str = Field(..., description="A template file with {prompt} and {response}, sent as the user message.")
    scale: tuple[float, float] = Field((1.0, 10.0), description="The judge's answer is a number in [low, high]; mapped to [0, 1].")
    max_tokens: int = Field(16, gt=0, description="Tokens the judge may answer with.")

    @model_validator(mode="after")
    def _safe(self) -> "JudgeReward":
        if self.scale[1] <= self.scale[0]:
            raise _rule_error(f"must be [low, high] with low < high, got {list(self.scale)}", "e.g. scale: [1, 10]", key="scale")
        self._check_transport(self.base_url, self.api_key_env is not None, "base_url")
        return self


# Adding a reward type: its schema class here (``type`` its name, ``loads_model``), listed below; its
# scorer, checks and display name in a module of its own, one line in engine/rewards/registry.py's REWARD_TYPES.
RewardComponent = Annotated[Union[ModelReward, ClassifierReward, FunctionReward, HttpReward, JudgeReward],
                            Field(discriminator="type")]
REWARD_TYPE_NAMES = tuple(get_args(cls.model_fields["type"].annotation)[0] for cls in get_args(get_args(RewardComponent)[0]))


class RewardConfig(Section):
    components: list[RewardComponent] = Field(
        ..., min_length=1,
        description=f"Reward components (type: {' | '.join(REWARD_TYPE_NAMES)}); the score is their weighted sum."
    )
    missing_eos_penalty: float | None = Field(
        None, ge=0.0, description="Subtracted from the score of a response with no stop token (TRL's missing_eos_penalty)."
    )
    max_response_tokens: int | None = Field(None, gt=0, description="Responses longer than this get overlength_penalty.")
    overlength_penalty: float = Field(0.0, ge=0.0, description="Subtracted when a response passes max_response_tokens.")
    overlong_buffer: int = Field(
        0, ge=0,
        description="DAPO's soft overlong punishment (verl: reward_model.overlong_buffer; TRL: "
        "get_soft_overlong_punishment): over the last this many tokens before generation.max_new_tokens a penalty "
        "grows linearly from 0 to overlong_penalty, counting the policy's sampled tokens (reward/overlong). 0: off.",
    )
    overlong_penalty: float = Field(1.0, ge=0.0, description="The overlong penalty at generation.max_new_tokens (overlong_buffer > 0).")

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
    prompts: str = Field(
        ...,
        description="Prompts: a .txt file (one per line), a .jsonl, .parquet, .csv or .json file, a dataset directory "
        "(save_to_disk) or a hub dataset id 'org/name'. Rows are strings or conversations (lists of {role, content}).",
    )
    field: str | None = Field(
        None, description="The prompt column of .jsonl / dataset rows. Default: 'prompt', else 'messages' (TRL's names)."
    )
    split: str = Field("train", description="Split of a hub dataset or saved DatasetDict read for data.prompts.")
    eval_split: str = Field("test", description="Split of a hub dataset or saved DatasetDict read for data.eval_prompts.")
    subset: str | None = Field(None, description="Subset (configuration) of a hub dataset, e.g. 'default'.")
    eval_prompts: str | None = Field(None, description="Held-out prompts for before/after evaluation (same formats).")
    max_prompt_tokens: int = Field(
        64, gt=0,
        description="Plain-text prompts are truncated from the left; a conversation loses the start of its last user "
        "message, never the template, system prompt or earlier turns.",
    )
    chat_template: bool = Field(
        False, description="Wrap each string prompt as a user turn with the tokenizer's chat template "
        "(conversation rows always use it).",
    )
    system_prompt: str | None = Field(
        None, description="A system turn before each prompt (a row's own system turn wins); implies the chat template."
    )
    shuffle: bool = Field(True, description="Shuffle the prompts each pass (seeded).")


class GenerationConfig(Section):
    max_new_tokens: int = Field(32, gt=0, description="TRL: response_length.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature; log-probs use logits / temperature too.")
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling; 1.0 disables it.")
    min_p: float = Field(0.0, ge=0.0, lt=1.0, description="Min-p sampling: drop tokens less likely than min_p x the "
                         "likeliest one (after the temperature); 0 disables it.")
    num_generations: int = Field(
        1, gt=0,
        description="Completions sampled per prompt (TRL's name), each prompt repeated this many times in a row before "
        "generation, so its completions form one group. ppo.advantage grpo and rloo compare a group's completions and "
        "need >= 2; reinforce_pp with >= 2 subtracts the group's mean score first (REINFORCE++-baseline). Episodes per "
        "update = ppo.rollout_batch_size x num_generations.",
    )
    stop_token: str | None = Field(None, description="Stop token text. Default: the tokenizer's EOS (TRL: stop_token='eos').")
    pack_weights: bool = Field(
        True,
        description="backend hf on a CPU with bf16 autocast (avx512_bf16 or AMX): lay out the frozen weights and the LM "
        "head for oneDNN once per generate() call instead of at every decoding step (engine/packed_linear.py), a second "
        "copy of them while sampling (ppo plan: 'bf16 weights packed for sampling'). false keeps that memory and "
        "samples slower.",
    )
    backend: Literal["hf", "vllm", "vllm_server"] = Field(
        "hf",
        description="Who samples the rollouts. hf: transformers generate on the policy itself. vllm: an in-process "
        "vLLM engine (pip install 'ppo_cli[vllm]'; one process only) fed the same prompt token ids and sampling "
        "settings, kept current with the policy's LoRA adapter (or, without LoRA, its weights) before every rollout. "
        "vllm_server: a running `vllm serve` at generation.server_url (LoRA only), handed the policy's adapter "
        "before every rollout (docs/vllm.md). "
        "The old log-probs are still the policy's own forward; the sampler's differ by numerics, logged as "
        "rollout/logprob_diff_mean and _max (see ppo.rollout_is_clip).",
    )
    server_url: str | None = Field(
        None,
        description="backend vllm_server: the OpenAI-compatible vLLM server, e.g. http://127.0.0.1:8000 (started "
        "with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; docs/vllm.md).",
    )
    server_adapter_dir: str | None = Field(
        None,
        description="backend vllm_server: where each update's adapter is saved for the server to load; a path the "
        "server can read (shared storage when it runs elsewhere). Default: server_adapters/ in the run directory.",
    )
    server_timeout_s: float = Field(
        600.0, gt=0.0, description="backend vllm_server: seconds one request (one group's completions) may take.",
    )
    server_retries: int = Field(
        2, ge=0, le=20, description="backend vllm_server: retries after a timeout, a connection error, HTTP 429 or 5xx.",
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
    rollout_batch_size: int = Field(
        16, gt=0, description="Prompts per update (TRL: batch_size); each gives generation.num_generations episodes."
    )
    mini_batch_size: int = Field(8, gt=0, description="Episodes per optimizer step (TRL: mini_batch_size).")
    micro_batch_size: int = Field(8, gt=0, description="Episodes per forward/backward (TRL: per_device_train_batch_size).")
    micro_batch_tokens: int | None = Field(
        None, gt=0,
        description="In the update, instead of micro_batch_size episodes: micro-batches of at most this many tokens "
        "(episodes x (prompt + longest response)), filled longest response first, so short responses share a "
        "forward and memory is bounded by tokens (verl: use_dynamic_bsz). An episode longer than this gets a "
        "micro-batch of its own. The rollout's forwards still use micro_batch_size.",
    )
    advantage: Literal["gae", "grpo", "rloo", "reinforce_pp"] = Field(
        "gae",
        description="The advantage estimator. gae: PPO with a critic (value.*), GAE over the per-token rewards. "
        "grpo: the score minus its group's mean, divided per scale_rewards (DeepSeekMath; Dr. GRPO with scale_rewards "
        "none), the same for every token of a completion. rloo: the score minus the mean of the other completions of "
        "its prompt (Ahmadian et al. 2024). reinforce_pp: REINFORCE++ (Hu 2025), per-token returns of the KL-shaped "
        "reward whitened over the batch; with num_generations >= 2 the group mean is subtracted first. The three "
        "critic-free ones need no value model (value.kind auto is none) and refuse gae's keys (gae_lambda, vf_coef, "
        "cliprange_value, whiten_rewards, whiten_advantages) set off their defaults; reinforce_pp whitens by definition.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="grpo: divide the centred scores by the std of the group's scores (group, the GRPO paper), of "
        "the whole batch's (batch) or by nothing (none: Dr. GRPO, Liu et al. 2025). TRL's scale_rewards.",
    )
    kl_penalty: Literal["auto", "reward", "loss"] = Field(
        "auto",
        description="Where the KL to the reference enters, with coefficient kl_coef. reward: -kl_coef x the per-token "
        "KL (kl_estimator) in the reward (PPO, RLOO, REINFORCE++; rloo sums it into the sequence reward). loss: "
        "kl_coef x the k3 KL of the policy being updated, aggregated as the policy loss and added to it (GRPO's term; "
        "TRL's beta). auto: loss for grpo, reward for the others. kl_coef 0 is TRL's GRPO default (beta 0.0); ours "
        "stays 0.05 for every estimator.",
    )
    loss_aggregation: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="How the per-token policy loss becomes one number: token_mean (every token of the optimizer "
        "step weighs the same: PPO, DAPO; TRL's dapo), seq_mean_token_mean (every completion weighs the same: the "
        "GRPO paper), seq_mean_token_sum_norm (each token weighs 1 / generation.max_new_tokens: Dr. GRPO).",
    )
    cliprange_high: float | None = Field(
        None, gt=0.0, description="Clip radius of the ratio above 1 (DAPO's clip-higher, e.g. 0.28); null: cliprange."
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token",
        description="token: one ratio per token (PPO, GRPO). sequence: the length-normalised sequence ratio on every "
        "token of a completion (GSPO, Zheng et al. 2025; pair it with loss_aggregation seq_mean_token_mean).",
    )
    mask_truncated: bool = Field(
        False,
        description="Completions that hit generation.max_new_tokens without their stop token leave the policy loss "
        "(DAPO's overlong filtering; TRL's mask_truncated_completions). They still count in the rewards and advantages.",
    )
    top_entropy_quantile: float = Field(
        1.0, gt=0.0, le=1.0,
        description="Train the policy loss only on the tokens whose entropy is in this top fraction of the "
        "micro-batch's trained tokens (Wang et al. 2025's forking tokens, e.g. 0.2; TRL's top_entropy_quantile): "
        "the others' loss is zeroed, the loss's normaliser unchanged. The threshold is logged as "
        "policy/entropy_threshold. 1.0: every token.",
    )
    filter_groups: bool = Field(
        False,
        description="DAPO's dynamic sampling (verl: algorithm.filter_groups): drop the groups whose completions all "
        "scored the same (or lost a reward), which grpo and rloo learn nothing from, and sample more prompts until "
        "rollout_batch_size groups are kept, at most max_filter_rounds extra rounds; then train on what was kept "
        "(filter/kept_groups, filter/rounds, filter/generated_episodes). The reward metrics count every generated "
        "episode. Needs a critic-free ppo.advantage and generation.num_generations >= 2.",
    )
    max_filter_rounds: int = Field(
        3, ge=0, description="filter_groups: extra sampling rounds per update at most (verl: max_num_gen_batches - 1)."
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

    @property
    def critic_free(self) -> bool:
        return self.advantage in CRITIC_FREE

    @property
    def kl_in_loss(self) -> bool:
        """kl_penalty with auto resolved: in the loss for grpo, in the reward otherwise."""
        return self.kl_penalty == "loss" or (self.kl_penalty == "auto" and self.advantage == "grpo")

    @property
    def uses_reference(self) -> bool:
        """Does training read the reference's log-probs? Not with kl_coef 0 and no adaptive_kl: the KL
        weighs nothing and never will (TRL's beta 0), so the reference forward is skipped."""
        return self.kl_coef > 0 or self.adaptive_kl is not None

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
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field(
        "auto",
        description="Autocast the forward passes (generation, rollout and update) to bf16 or fp16 through accelerate, "
        "with float32 weights, optimizer, log-softmax, losses and GAE (TRL: bf16 / fp16). auto: bf16 or fp16 when the "
        "launcher asks for it (`ppo train --accelerate-config FILE`, `accelerate launch --mixed_precision`; its 'no' "
        "is accelerate's default and leaves the choice here), else bf16 on a CUDA GPU that supports it and on a CPU "
        "with hardware bf16 (AVX512-BF16 or AMX: 1.67x faster per update measured, docs/benchmarks.md), no elsewhere "
        "and for a policy.dtype other than float32. An explicit value wins over the launcher's. fp16 needs a GPU. "
        "Pure bf16 weights are policy.dtype: bfloat16 with mixed_precision auto or no. The resolved value is in the "
        "run's summary.json.",
    )
    gradient_checkpointing: Literal["auto"] | bool = Field(
        "auto",
        description="Recompute each decoder layer's activations in the backward instead of keeping them (the policy, "
        "and a trained value.kind model's backbone): less memory, one more forward per update, the same numbers "
        "(TRL: gradient_checkpointing). auto: on where `ppo plan` says the update's activations would not fit the "
        "device (the GPU's memory; on CPU the memory available at start) or are the largest term of the update's "
        "peak; off elsewhere (the tiny test models). The choice and its reason are printed at start and kept in "
        "summary.json.",
    )
    max_consecutive_skips: int = Field(
        3, gt=0, description="Stop after this many updates in a row skipped for non-finite numbers."
    )
    fsdp_rollout: Literal["per_block", "gathered"] = Field(
        "per_block",
        description="Under FSDP (an accelerate config with distributed_type FSDP): per_block keeps the rollout "
        "sharded, each decoder block gathering its weights for its own forward and freeing them after (one block "
        "whole at a time, one all-gather per block per decoded token); gathered unshards the whole policy on every "
        "process once per rollout (fewer, larger all-gathers; the whole policy in memory). Same numbers either way; "
        "peak memory per process measured in docs/benchmarks.md. Ignored without FSDP.",
    )
    collective_timeout_s: int = Field(
        600, gt=0,
        description="Several processes: seconds a collective (all-reduce, all-gather, barrier) may wait for the other "
        "processes before every process stops with one line naming the phase (loading, rollout, update, evaluation, "
        "checkpoint) and exit code 1; the last checkpoint stays intact. It is the process group's timeout (gloo and "
        "NCCL); 600 is NCCL's own default. The other processes wait while the main one writes a checkpoint or final/: "
        "raise it when that takes longer for your model.",
    )

    @field_validator("gradient_checkpointing", mode="before")
    @classmethod
    def _auto_or_bool(cls, value):
        # pydantic's bool would also take 1, "yes" or "on": one spelling per value.
        if value == "auto" or isinstance(value, bool):
            return value
        shown = repr(value).replace("{", "(").replace("}", ")")  # the message goes through str.format
        raise _rule_error(f"gradient_checkpointing must be auto, true or false, not {shown}",
                          "write `gradient_checkpointing: auto` (the default), `true` or `false`")

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no_is_false(cls, value):
        # YAML 1.1 reads an unquoted `no` as false; accelerate's name for "off" is "no".
        return "no" if value is False else value


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
    zero_std_groups_high: float = Field(
        0.5, ge=0.0, lt=1.0,
        description="generation.num_generations >= 2: warn when the mean fraction of prompt groups whose completions "
        "all score the same (frac_reward_zero_std) is above this; those groups carry no signal for grpo and rloo.",
    )
    filter_short_high: float = Field(
        0.5, ge=0.0, lt=1.0,
        description="ppo.filter_groups: warn when more than this fraction of the window's updates ran out of "
        "ppo.max_filter_rounds before rollout_batch_size groups scored apart (filter/fill below 1): they trained on a "
        "smaller batch.",
    )
    ratio_tolerance: float = Field(
        0.1, gt=0.0, description="Warn when the policy ratio before the first optimizer step is further than this from 1."
    )
    reward_failed_high: float = Field(
        0.0, ge=0.0, lt=1.0, description="Warn when more than this fraction of an update's completions got no reward "
        "(reward/failed_rate: a server, judge or function failed for them; they left the update).",
    )
    episode_budget_high: float = Field(
        0.5, ge=0.0, lt=1.0, description="Episodes of several turns: warn when more than this fraction of them ends "
        "by environment.max_episode_tokens (env/ended_by/max_episode_tokens) over a whole window.",
    )
    tool_errors_high: float = Field(
        0.5, ge=0.0, lt=1.0, description="Tools: warn when more than this fraction of the policy's tool calls is "
        "answered with an error (env/tool_errors over env/tool_calls) over a whole window.",
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
        False, description="Write TensorBoard event files to RUN_DIR/tensorboard/ with the metrics.jsonl names "
        "(needs the tensorboard package: pip install 'ppo_cli[tensorboard]')."
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


class EnvironmentConfig(Section):
    """Episodes with several turns: what the policy talks to between its turns (ppo_cli/engine/envs/)."""

    # `class` is a Python keyword: the field is class_, written `class` in the recipe and in its dump.
    model_config = ConfigDict(extra="forbid", frozen=True, serialize_by_alias=True)
    type: Literal["tools", "python", "http"] = Field(
        ..., description="tools: the policy calls the functions in `tools`; python: a class of yours (`class`, built with "
        "`kwargs`) with reset/step/close; http: a server's POST /reset, /step, /close at `url`.",
    )
    tools: list[Annotated[str, Field(pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$")]] = Field(
        [], description="type tools: 'path/to/file.py:function' or 'package.module:function' (def or async def), its JSON "
        "schema read from its type hints and Google-style docstring, as TRL's tools=.",
    )
    class_: str | None = Field(
        None, alias="class", pattern=r"^[^:]+:[A-Za-z_][A-Za-z0-9_]*$",
        description="type python: 'path/to/file.py:Class' with reset(row, seed), step(message), close() (sync or async).",
    )
    kwargs: dict[str, Any] = Field({}, description="type python: keyword arguments the class is built with.")
    url: str | None = Field(None, description="type http: the server's base URL; POST url/reset, url/step, url/close.")
    headers: dict[str, str] = Field(
        {}, description="type http: request headers; ${VAR} is read from the environment when a request is sent. "
        "Credentials (Authorization, *key*, *token*) must be ${VAR}.",
    )
    timeout_s: float = Field(10.0, gt=0.0, description="Seconds one tool call, one step or one request may take.")
    retries: int = Field(3, ge=0, le=20, description="type http: retries after a timeout, a connection error, HTTP 429 or 5xx.")
    retry_backoff_s: float = Field(0.5, ge=0.0, description="type http: first retry's wait; doubled each retry, jittered.")
    max_turns: int = Field(4, ge=1, description="Assistant turns per episode.")
    max_episode_tokens: int = Field(
        256, gt=0, description="Every token after the prompt, the policy's and the environment's: the one budget."
    )
    max_observation_tokens: int = Field(
        128, gt=0, description="An environment message longer than this is cut in the middle (head and tail kept).",
    )
    max_concurrency: int = Field(8, ge=1, description="Episodes whose steps run at once.")
    overlap: bool | Literal["auto"] = Field(
        "auto", description="true: the batch's episodes run as two waves (its first and second half), one wave's "
        "environment steps running while the other wave samples; false: every episode samples, then every one steps. "
        "auto: true for a type python class that declares slow_steps = True, else false. Decided by the recipe and the "
        "class, never by a timing: a seed gives the same episodes run after run.",
    )
    tool_call_format: Literal["auto", "hermes"] = Field(
        "auto", description="auto: the chat template's own when it writes hermes calls (or has no tool format); hermes: "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.',
    )
    on_failure: Literal["skip", "error"] = Field(
        "skip", description="An environment step that raises or times out: skip: the episode leaves the update and is "
        "counted (env/failed_rate); error: stop the run.",
    )

    @model_validator(mode="after")
    def _keys_fit_type(self) -> "EnvironmentConfig":
        needed = {"tools": ("tools", "e.g. tools: [recipes/tools/calculator.py:calculate]"),
                  "python": ("class", "e.g. class: recipes/envs/guess.py:GuessNumber"),
                  "http": ("url", "e.g. url: http://127.0.0.1:8080")}
        key, example = needed[self.type]
        if not getattr(self, "class_" if key == "class" else key):
            raise _rule_error(f"needed by type '{self.type}'", example, key=key)
        owners = {"tools": "tools", "class": "python", "kwargs": "python", "url": "http", "headers": "http"}
        empty = {"tools": "[]", "class": "null", "kwargs": "{}", "url": "null", "headers": "{}"}  # what --set clears it with
        for name, owner in owners.items():
            if owner != self.type and getattr(self, "class_" if name == "class" else name):
                raise _rule_error(f"only used with type '{owner}', but the type is '{self.type}'",
                                  f"remove environment.{name} (from the command line: --set environment.{name}={empty[name]}), "
                                  f"or set environment.type: {owner}", key=name)
        for name, value in self.headers.items():
            if SECRET_HEADER.search(name) and "${" not in value:
                raise _rule_error(f"header '{name}' holds a literal credential",
                                  "put it in an environment variable and write e.g. 'Bearer ${ENV_TOKEN}'", key="headers")
        if self.url is not None:
            from urllib.parse import urlsplit

            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise _rule_error(f"'{self.url}' is not an http(s) URL", "write it as http://HOST:PORT or https://...", key="url")
            if (self.headers and parts.scheme == "http" and not is_loopback_host(parts.hostname)
                    and any(SECRET_HEADER.search(n) for n in self.headers)):
                raise _rule_error(f"would send credentials over plain http to {parts.hostname}", "use https", key="url")
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
    environment: EnvironmentConfig | None = Field(
        None, description="Episodes with several turns (tools, a python or http environment); absent: one prompt, one answer."
    )

    @property
    def episodes_per_update(self) -> int:
        """Completions per process and update: prompts x completions per prompt."""
        return self.ppo.rollout_batch_size * self.generation.num_generations

    @property
    def num_mini_batches(self) -> int:
        """Optimizer steps per PPO epoch."""
        return self.episodes_per_update // self.ppo.mini_batch_size

    @property
    def run_dir(self) -> Path:
        """Where the run writes: output_dir/name."""
        return Path(self.output_dir) / self.name

    def _value_kind_as_written(self) -> str:
        """value.kind, or what 'auto' stands for where the recipe alone decides it ('model' with value.path
        or init_from reward, 'adapter' with value.lora on a LoRA policy); else 'auto' (head or the frozen
        reward model: that choice reads the models' files, ppo_cli/auto.py, after validation)."""
        value = self.value
        if value.kind != "auto":
            return value.kind
        if self.ppo.critic_free:
            return "none"
        if value.path is not None or value.init_from == "reward":
            return "model"
        return "adapter" if value.lora is not None and self.policy.lora is not None else "auto"

    @model_validator(mode="after")
    def _episodes_divide(self) -> "Recipe":
        ppo, G = self.ppo, self.generation.num_generations
        if self.episodes_per_update % ppo.mini_batch_size == 0:
            if ppo.mini_batch_size % ppo.micro_batch_size:
                raise _rule_error(
                    f"mini_batch_size ({ppo.mini_batch_size}) must be a multiple of micro_batch_size "
                    f"({ppo.micro_batch_size})",
                    "pick sizes where micro_batch_size divides mini_batch_size and mini_batch_size divides "
                    "rollout_batch_size" + ("" if G == 1 else " x num_generations"),
                    key="ppo.micro_batch_size",
                )
            return self
        if G == 1 and ppo.advantage in ("grpo", "rloo"):
            self._estimator_fits()  # a group of one is what to fix first: it is also why the batch falls short
        if G == 1:
            message = (f"rollout_batch_size ({ppo.rollout_batch_size}) must be a multiple of mini_batch_size "
                       f"({ppo.mini_batch_size})")
        else:
            message = (f"rollout_batch_size x generation.num_generations ({ppo.rollout_batch_size} x {G} = "
                       f"{self.episodes_per_update} episodes) must be a multiple of mini_batch_size "
                       f"({ppo.mini_batch_size}): mini- and micro-batches count episodes (completions), not prompts")
        raise _rule_error(
            message,
            "pick sizes where micro_batch_size divides mini_batch_size and mini_batch_size divides rollout_batch_size"
            + ("" if G == 1 else " x num_generations"),
            key="ppo.mini_batch_size",
        )

    def _estimator_fits(self) -> None:
        """ppo.advantage against the critic and the group size."""
        ppo, kind = self.ppo, self._value_kind_as_written()
        G = self.generation.num_generations
        if ppo.advantage in ("grpo", "rloo") and G < 2:
            raise _rule_error(
                f"'{ppo.advantage}' compares the completions of a prompt and needs generation.num_generations >= 2, "
                f"got {G}",
                "set `generation.num_generations: 4` (or more), or `ppo.advantage: reinforce_pp` or `gae`",
                key="ppo.advantage",
            )
        if kind == "none" and not ppo.critic_free:
            raise _rule_error(
                "'none' leaves ppo.advantage 'gae' without the values it needs",
                "set `value.kind: auto` (a critic), or a critic-free `ppo.advantage`: grpo, rloo or reinforce_pp",
                key="value.kind",
            )
        if ppo.critic_free and kind != "none":
            raise _rule_error(
                f"a '{kind}' critic would be trained for nothing: ppo.advantage '{ppo.advantage}' uses no values",
                "set `value.kind: none` (or auto) and remove the other value.* keys, or `ppo.advantage: gae`",
                key="value.kind",
            )
        # By value, not by what was written: a run's resolved recipe.yaml spells out every default.
        critic_keys = [k for k, f in ValueConfig.model_fields.items() if k != "kind" and getattr(self.value, k) != f.default]
        if ppo.critic_free and critic_keys:
            raise _rule_error(
                f"configures a critic, but ppo.advantage '{ppo.advantage}' has none",
                f"remove `value.{critic_keys[0]}`, or set `ppo.advantage: gae`",
                key=f"value.{critic_keys[0]}",
            )
        gae_keys = [k for k in GAE_ONLY if getattr(ppo, k) != PPOConfig.model_fields[k].default]
        if ppo.critic_free and gae_keys:
            raise _rule_error(
                f"only used with ppo.advantage 'gae' (a critic), but it is '{ppo.advantage}'",
                f"remove `ppo.{gae_keys[0]}`, or set `ppo.advantage: gae`",
                key=f"ppo.{gae_keys[0]}",
            )
        if ppo.scale_rewards != "group" and ppo.advantage != "grpo":
            raise _rule_error(
                f"only used with ppo.advantage 'grpo', but it is '{ppo.advantage}'",
                "remove `ppo.scale_rewards` or set `ppo.advantage: grpo`",
                key="ppo.scale_rewards",
            )

    @model_validator(mode="after")
    def _roles_fit_together(self) -> "Recipe":
        self._estimator_fits()
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
            if value.path is None and not any(c.loads_model for c in self.reward.components):
                raise _rule_error(
                    "'reward' needs a reward component of type 'model' or 'classifier' to start from",
                    "add a model or classifier reward component, set `value.path`, or set `value.init_from: policy`",
                    key="value.init_from",
                )
        kind = self._value_kind_as_written()
        if value.path is not None and kind != "model":
            raise _rule_error(
                f"only used with a separate value model, but the value kind is '{kind}'",
                "set `value.kind: model` or remove `value.path`",
                key="value.path",
            )
        if value.train_backbone is not None and kind == "adapter":
            raise _rule_error(
                "not used with value kind 'adapter' (the value adapter is what trains)",
                "remove `value.train_backbone`, or set `value.kind: head` or `value.kind: model`",
                key="value.train_backbone",
            )
        if value.lora is not None and kind != "adapter":
            raise _rule_error(
                f"only used with value kind 'adapter', but the value kind is '{kind}'",
                "remove `value.lora` or set `value.kind: adapter` (needs `policy.lora`)",
                key="value.lora",
            )
        if self.ppo.rollout_is_clip is not None and self.generation.backend not in ("vllm", "vllm_server"):
            raise _rule_error(
                "corrects for a separate sampler and has no effect with generation.backend 'hf' (the policy samples itself)",
                "set `generation.backend: vllm` or remove `ppo.rollout_is_clip`",
                key="ppo.rollout_is_clip",
            )
        server_keys = ("server_url", "server_adapter_dir")
        if self.generation.backend == "vllm_server" and self.generation.server_url is None:
            raise _rule_error(
                "generation.backend 'vllm_server' needs the server's address",
                "set `generation.server_url: http://HOST:PORT` (a `vllm serve` started with --enable-lora; docs/vllm.md)",
                key="generation.server_url",
            )
        if self.generation.backend == "vllm_server" and self.policy.lora is None:
            raise _rule_error(
                "generation.backend 'vllm_server' samples with the policy's LoRA adapter, loaded into the server each "
                "update; a full fine-tune's weights cannot be pushed to a vLLM server",
                "set `policy.lora` (e.g. r: 16), or use generation.backend: vllm (in-process, reloads full weights)",
                key="generation.backend",
            )
        for key in server_keys:
            if getattr(self.generation, key) is not None and self.generation.backend != "vllm_server":
                raise _rule_error(
                    "only used with generation.backend 'vllm_server'",
                    f"set `generation.backend: vllm_server` or remove `generation.{key}`",
                    key=f"generation.{key}",
                )
        if self.generation.vllm_sleep_mode and self.generation.backend != "vllm":
            raise _rule_error(
                "only used with generation.backend 'vllm'",
                "set `generation.backend: vllm` or remove `generation.vllm_sleep_mode`",
                key="generation.vllm_sleep_mode",
            )
        if self.train.mixed_precision in ("bf16", "fp16") and self.policy.dtype in ("bfloat16", "float16"):
            raise _rule_error(
                f"'{self.train.mixed_precision}' autocasts float32 weights, but policy.dtype is "
                f"'{self.policy.dtype}' (pure half precision already)",
                "set `train.mixed_precision: no` to train in pure half precision, or `policy.dtype: float32` "
                "for mixed precision",
                key="train.mixed_precision",
            )
        if self.reference.quantization != "none" and self.policy.lora is not None and self.reference.path is None:
            raise _rule_error(
                "has no effect with a LoRA policy: the reference is the policy's base with the adapter disabled",
                "remove `reference.quantization`, quantize the base with `policy.quantization`, or set `reference.path`",
                key="reference.quantization",
            )
        return self

    @model_validator(mode="after")
    def _episode_budget_fits_a_turn(self) -> "Recipe":
        """environment.max_episode_tokens holds at least one whole turn (generation.max_new_tokens)."""
        environment, turn = self.environment, self.generation.max_new_tokens
        if environment is not None and environment.max_episode_tokens < turn:
            raise _rule_error(
                f"{environment.max_episode_tokens} is below generation.max_new_tokens ({turn}): the episode's "
                "budget would cut its first turn short, and max_new_tokens would never apply",
                f"raise `environment.max_episode_tokens` to at least {turn} (it counts every turn and every "
                "environment message), or lower `generation.max_new_tokens`",
                key="environment.max_episode_tokens",
            )
        return self

    @model_validator(mode="after")
    def _dapo_options_fit(self) -> "Recipe":
        """ppo.filter_groups with groups to filter; reward.overlong_buffer within the response length."""
        ppo = self.ppo
        if ppo.filter_groups and not ppo.critic_free:
            raise _rule_error(
                "drops the groups whose completions all scored the same, and ppo.advantage 'gae' has no groups "
                "(its critic gives such completions an advantage)",
                "set `ppo.advantage: grpo` or `rloo` with `generation.num_generations: 4`, or remove `ppo.filter_groups`",
                key="ppo.filter_groups",
            )
        if ppo.filter_groups and self.generation.num_generations < 2:
            raise _rule_error(
                "compares the completions of a prompt and needs generation.num_generations >= 2, got 1",
                "set `generation.num_generations: 4` (or more), or remove `ppo.filter_groups`",
                key="ppo.filter_groups",
            )
        if not ppo.filter_groups and ppo.max_filter_rounds != PPOConfig.model_fields["max_filter_rounds"].default:
            raise _rule_error(
                "has no effect without ppo.filter_groups",
                "set `ppo.filter_groups: true` or remove `ppo.max_filter_rounds`",
                key="ppo.max_filter_rounds",
            )
        buffer, max_new = self.reward.overlong_buffer, self.generation.max_new_tokens
        if buffer > max_new:
            raise _rule_error(
                f"({buffer}) is longer than generation.max_new_tokens ({max_new}): the penalty would start before "
                "the first token",
                f"set `reward.overlong_buffer` to at most {max_new} (DAPO: a quarter of max_new_tokens)",
                key="reward.overlong_buffer",
            )
        return self
