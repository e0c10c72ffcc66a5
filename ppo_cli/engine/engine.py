"""One loaded engine: tokenizer, policy/value/reference, reward, and the rollout built from them
(engine/inference.py loads the same Engine for inference: no critic).

Every command (train, rollout, score, eval, compare) goes through here, so loading, generation,
log-probs and scoring have one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass

import time

import torch

from ppo_cli.engine.chat import tokenize_prompts
from ppo_cli.engine.data import recipe_prompt_columns
from ppo_cli.engine.generate import generate, generate_with_logprobs, resolve_stop_token_id, trim_padding
from ppo_cli.engine.actor_critic import (
    ActorCritic,
    build_actor_critic,
    check_value_model_tokenizer,
    policy_forward,
    reference_logprobs,
    value_forward,
    values_from_hidden,
)
from ppo_cli.engine.logprobs import selective_log_softmax
from ppo_cli.engine.models import (
    POLICY_ADAPTER,
    is_quantized,
    load_tokenizer,
    resolve_device,
    unwrap_causal_lm,
)
from ppo_cli.engine.precision import autocast_context, check_mixed_precision, recipe_mixed_precision
from ppo_cli.engine.rewards.stack import RewardStack, ScoreResult
from ppo_cli.engine.rewards.shared import SharedForward, SharedRewardModel
from ppo_cli.perf import ModelSizes
from ppo_cli.recipe import Recipe
from ppo_cli.types import DeferredOldLogprobs, Generation, Rollout

# Speed lever of the rollout (docs/benchmarks.md measures it); a module flag so a benchmark can turn it
# off: reference and critic forwards under torch.inference_mode (outputs cloned back to normal
# tensors); the policy's own tensors stay out of it, they meet autograd in the update.
INFERENCE_MODE = True
# CPU: keep freed activation memory in the process instead of handing it back to the kernel after
# every backward (keep_freed_memory): a faster backward for a little more peak memory (docs/benchmarks.md,
# "Where the time goes"). A switch so the benchmark can turn it off.
CPU_MALLOC_TUNING = True
# One forward of a reward model that is also the frozen critic, for its scores and the critic's
# features, instead of one each (engine/rewards/shared.py; docs/benchmarks.md measures it). A switch so
# the benchmark and the tests can run the two forwards on the same engine.
SHARED_REWARD_FORWARD = True


@dataclass(frozen=True)
class SampledForward:
    """What generate()'s own forward passes computed for the sampled tokens (generate_with_logprobs)."""

    logprobs: torch.Tensor  # (B, T) log-probs of the response tokens at the sampling temperature
    hidden: torch.Tensor | None  # (B, T, H) policy decoder states that sampled them, for a value head


@dataclass(frozen=True)
class SamplerLogprobs:
    """A separate sampler's (generation.backend vllm) log-probs of the sampled tokens (B, T): never the
    old log-probs (those stay the policy's own forward), only compared with them."""

    logprobs: torch.Tensor


@dataclass
class Engine:
    recipe: Recipe
    device: torch.device
    tokenizer: object
    actor_critic: ActorCritic
    reward: RewardStack
    stop_token_id: int
    sampler: object | None = None  # vllm_sampler.VllmSampler when generation.backend is vllm
    # 'no', 'bf16' or 'fp16' (train.mixed_precision resolved): generation and the rollout's forwards
    # run under the autocast the update's forward gets from accelerate, so the first ratio is 1.
    mixed_precision: str = "no"
    generation_seconds: float = 0.0
    # the reward model whose backbone is the frozen critic's: one forward gives scores and features
    shared_reward: SharedRewardModel | None = None

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    def autocast(self):
        return autocast_context(self.mixed_precision, self.device)

    def generate(self, prompts: list[str]) -> Generation:
        """Sample one response per prompt with the policy (global torch RNG: seed it first)."""
        return self._generate(prompts, from_generation=False)[0]

    def _generate(self, prompts: list[str], from_generation: bool,
                  on_finished=None) -> tuple[Generation, "SampledForward | SamplerLogprobs | None"]:
        """generate(); with ``from_generation`` also what its own forward passes computed: the sampled
        tokens' log-probs (B, T) and, for a value head, the hidden states (B, T, H) that sampled them.
        With a separate sampler (vLLM), its log-probs instead (and ``on_finished`` is not called: the
        reward requests then go out after sampling)."""
        recipe = self.recipe
        prompt_ids, prompt_mask = tokenize_prompts(prompts, self.tokenizer, recipe.data, self.device)
        self.actor_critic.use_adapter(POLICY_ADAPTER)
        if self.sampler is not None:
            generation, logprobs = self.sampler.generate(self.actor_critic.policy, prompt_ids, prompt_mask,
                                                         self.stop_token_id, self.pad_token_id)
            generation = trim_padding(generation)
            return generation, SamplerLogprobs(logprobs[:, : generation.response_ids.shape[1]])
        args = (self.actor_critic.policy, prompt_ids, prompt_mask, recipe.generation, self.stop_token_id, self.pad_token_id)
        if not from_generation:
            with self.autocast():
                return trim_padding(generate(*args, on_finished)), None
        generation, logprobs, hidden = generate_with_logprobs(*args, keep_hidden=self.actor_critic.value_reads_policy_hidden,
                                                              on_finished=on_finished)
        generation = trim_padding(generation)
        T = generation.response_ids.shape[1]
        return generation, SampledForward(logprobs[:, :T], hidden[:, :T] if hidden is not None else None)

    def decode_responses(self, generation: Generation) -> list[str]:
        return self.tokenizer.batch_decode(generation.response_ids, skip_special_tokens=True)

    def decode_response(self, response_ids: list[int]) -> str:
        """One response as decode_responses gives it (without the padding after its stop token)."""
        return self.tokenizer.decode(response_ids, skip_special_tokens=True)

    def score(self, prompts: list[str], responses: list[str], generation: Generation,
              shared: SharedForward | None = None, pending=None) -> ScoreResult:
        """``shared``: the reward model's scores already taken from the critic's forward; ``pending``:
        the remote components' requests already sent (RewardStack.start)."""
        known = {shared.component: shared.scores} if shared is not None else None
        return self.reward.score(
            prompts, responses, generation.finished.tolist(), generation.response_lengths.tolist(), known,
            pending=pending,
        )

    def shared_reward_forward(self, prompts: list, responses: list[str], generation: Generation) -> SharedForward | None:
        """The frozen critic's features and, for the rows whose tokens the reward model reads as the
        policy's, its scores, from one forward of the reward model (engine/rewards/shared.py); None
        where no reward model is the critic or no row's tokens match (then the two forwards run)."""
        if self.shared_reward is None or not SHARED_REWARD_FORWARD:
            return None
        positions = self.shared_reward.score_positions(prompts, responses, generation)
        if (positions < 0).all():
            return None
        return self.shared_reward.forward(generation, positions, self.recipe.ppo.micro_batch_size)

    @torch.no_grad()
    def evaluate_logprobs_and_values(self, generation: Generation, chunk: int, sampled: "SampledForward | None" = None,
                                     fixed_features: torch.Tensor | None = None, old_logprobs: bool = True):
        """Old log-probs, reference log-probs and old values (B, T) each, 0 outside the response mask
        (values None without a critic: inference), and, for a frozen value model, the features its head
        read (B, T, H) (else None).

        ``sampled``: the log-probs (and hidden states) taken from generation's own forward passes
        (generate_with_logprobs); the policy's forward pass is then skipped. ``fixed_features``: the
        frozen value model's features already computed (B, T, H) (shared_reward_forward); its forward
        is then skipped. ``old_logprobs`` False (no critic, a separate reference): no policy forward,
        and None for the old log-probs (the update's first epoch computes them: defer_old_logprobs).
        """
        if not old_logprobs and (self.actor_critic.critic is not None or self.actor_critic.reference_is_policy):
            raise ValueError("the old log-probs can be left out only without a critic and with a separate reference")
        ac, temperature = self.actor_critic, self.recipe.generation.temperature
        sequences, attention_mask = generation.sequences, generation.attention_mask
        T = generation.response_ids.shape[1]
        logprobs, ref_logprobs, values, features = [], [], [], []
        has_critic, keep_features = ac.critic is not None, ac.value_features_fixed
        for rows in torch.arange(sequences.shape[0], device=sequences.device).split(chunk):
            seq, attn, resp = sequences[rows], attention_mask[rows], generation.response_ids[rows]
            if not old_logprobs:
                vals = None
            elif sampled is None:
                with self.autocast():
                    logits, vals = policy_forward(ac, seq, attn, T, temperature)
                logprobs.append(selective_log_softmax(logits, resp))
                del logits
            else:
                logprobs.append(sampled.logprobs[rows])
                vals = values_from_hidden(ac, sampled.hidden[rows]) if sampled.hidden is not None else None
            with torch.inference_mode(INFERENCE_MODE), self.autocast():
                if ac.reference_is_policy:
                    ref = logprobs[-1]
                else:
                    ref = reference_logprobs(ac, seq, attn, resp, temperature)
                if keep_features:
                    features.append(fixed_features[rows] if fixed_features is not None
                                    else ac.critic.features(ac, seq, attn, T).clone())
                    vals = values_from_hidden(ac, features[-1])
                if has_critic and vals is None:
                    vals = value_forward(ac, seq, attn, T)
            ref_logprobs.append(ref.clone())  # clone: a normal tensor again, usable by the update's autograd
            if has_critic:
                values.append(vals.clone())
        mask = generation.response_mask
        zero = lambda parts: torch.cat(parts).masked_fill(~mask, 0.0)  # noqa: E731
        return (zero(logprobs) if old_logprobs else None, zero(ref_logprobs), zero(values) if has_critic else None,
                torch.cat(features) if features else None)

    def reuses_generation_forward(self) -> bool:
        """Take the old log-probs (and head values) from the generation's own forward passes?

        When ppo.rollout_logprobs is 'generation', and only where that is exact to float32 rounding (the
        KV-cached and the full forward agree to ~1e-6): a float32, unquantized policy without mixed
        precision. In bfloat16 (weights or autocast), or through bitsandbytes' single-row kernels, the
        two differ enough to move the first PPO ratio off 1, so those keep the separate forward.
        """
        if self.recipe.ppo.rollout_logprobs != "generation" or self.mixed_precision != "no":
            return False
        if is_quantized(self.actor_critic.policy):
            return False
        head = unwrap_causal_lm(self.actor_critic.policy).get_output_embeddings()
        return head is not None and head.weight.dtype == torch.float32

    def store_frozen_weights_in_compute_dtype(self) -> int:
        """Under bf16/fp16 autocast, a LoRA policy's frozen Linear weights stored in that dtype
        (engine/frozen_weights.py: the same numbers, half their memory, no cast per call). One process
        only (FSDP and DeepSpeed shard and flatten the weights themselves); not for a quantized policy
        (its own kernels) or a vLLM sampler (which reads the weights). Returns the layers stored."""
        from ppo_cli.engine.frozen_weights import store_frozen_linears_in
        from ppo_cli.engine.precision import AUTOCAST_DTYPES

        policy = self.actor_critic.policy
        if (self.mixed_precision not in AUTOCAST_DTYPES or self.recipe.policy.lora is None or self.sampler is not None
                or is_quantized(policy)):
            return 0
        return store_frozen_linears_in(policy, AUTOCAST_DTYPES[self.mixed_precision])

    def model_sizes(self) -> ModelSizes:
        """Parameter counts of the forwards one update runs (perf.py's MFU); call before FSDP shards them."""
        ac = self.actor_critic
        count = lambda model: sum(p.numel() for p in model.parameters()) if model is not None else 0  # noqa: E731
        policy = count(ac.policy)
        forwards = 0 if self.reuses_generation_forward() else policy  # old log-probs
        if not ac.reference_is_policy:
            forwards += count(ac.ref_model) if ac.ref_model is not None else policy
        critic = ac.critic.forward_parameters(ac, policy) if ac.critic is not None else 0  # the critic's own forward
        shared = self.shared_reward is not None and SHARED_REWARD_FORWARD  # the reward model's forward serves it
        forwards += (0 if shared else critic) + sum(count(getattr(scorer, "model", None)) for _, _, scorer in self.reward.scorers)
        trained = policy + (0 if ac.value_features_fixed else critic)
        weight_bytes = sum(p.numel() * p.element_size() for p in ac.policy.parameters())
        return ModelSizes(policy, forwards, trained, weight_bytes)

    def collect_rollout(self, prompts: list[str], old_logprobs: bool = True) -> Rollout:
        """``old_logprobs`` False: rollout.logprobs a DeferredOldLogprobs, left to the update (defer_old_logprobs)."""
        # Requests to reward servers and judges go out as rows finish sampling, and the rest right
        # after it, so their latency overlaps the decoding and the forwards below.
        stream = self.reward.stream(prompts, self.decode_response) if self.sampler is None else None
        pending = None
        try:
            started = time.perf_counter()
            generation, sampled = self._generate(prompts, from_generation=old_logprobs and self.reuses_generation_forward(),
                                                 on_finished=stream.finished if stream is not None else None)
            self.generation_seconds = time.perf_counter() - started  # the last rollout's (perf/decode_gbps)
            sampler_logprobs = None
            if isinstance(sampled, SamplerLogprobs):  # compared with the old log-probs, never used as them
                sampler_logprobs, sampled = sampled.logprobs, None
            responses = self.decode_responses(generation)
            pending = self.reward.start(prompts, responses, stream=stream)
            shared = self.shared_reward_forward(prompts, responses, generation)
            logprobs, ref_logprobs, values, fixed_features = self.evaluate_logprobs_and_values(
                generation, self.recipe.ppo.micro_batch_size, sampled, shared.features if shared is not None else None,
                old_logprobs=old_logprobs,
            )
        except BaseException:
            if pending is not None:
                pending.close()
            elif stream is not None:
                stream.close()
            raise
        result = self.score(prompts, responses, generation, shared, pending)
        scores = torch.tensor([0.0 if s is None else s for s in result.scores], dtype=torch.float32, device=self.device)
        scored, failures = None, None
        if self.reward.failable:  # components that may leave an episode without a reward
            scored = torch.tensor(result.scored, dtype=torch.bool, device=self.device)
            failures = {name: result.failures.get(name, "") for name in self.reward.failable}
        if not old_logprobs:
            logprobs = DeferredOldLogprobs(ref_logprobs)
        return Rollout(generation, prompts, responses, logprobs, ref_logprobs, values, scores, result.components,
                       fixed_features, sampler_logprobs, scored, failures)


def quiet_libraries() -> None:
    """Our progress bar and one-line errors are the interface; silence the libraries' chatter."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    for module in ("transformers", "peft", "bitsandbytes", "accelerate"):
        warnings.filterwarnings("ignore", category=FutureWarning, module=module)
        warnings.filterwarnings("ignore", category=UserWarning, module=module)


def _tunable_libc():
    """The C library, where malloc may be tuned: Linux with CPU_MALLOC_TUNING on; None otherwise."""
    import ctypes
    import sys

    if not CPU_MALLOC_TUNING or not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _mallopt():
    """glibc's mallopt, where malloc may be tuned (_tunable_libc); None otherwise (musl has none)."""
    return getattr(_tunable_libc(), "mallopt", None)


# glibc's mallopt parameters (malloc.h) and its defaults on 64-bit Linux.
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
GLIBC_TRIM_THRESHOLD, GLIBC_TOP_PAD = 128 * 1024, 128 * 1024
# Under FSDP on CPU, blocks of this size or more are mapped on their own (return_freed_memory).
FSDP_MMAP_THRESHOLD = 2**20


def keep_freed_memory() -> None:
    """CPU training: stop glibc from returning freed activation memory to the kernel on every free.

    By default glibc maps blocks above a (self-raising) threshold with mmap and unmaps them when they
    are freed, and trims the heap top once more than 2x that threshold is free. A training step frees
    and reallocates the same few gigabytes of activations and gradients every micro-batch, so the
    kernel zeroes and faults in those pages again each time: at the 0.5B shape that was a third of the
    step's wall time, spent in the kernel. Serving every block up to glibc's 32 MB mmap limit from the
    heap and (almost) never trimming it keeps those pages resident and reused; the resident set then
    stays at its peak (which it reaches anyway). A no-op off glibc or with CPU_MALLOC_TUNING off.
    """
    mallopt = _mallopt()
    if mallopt is None:
        return
    mallopt(M_MMAP_THRESHOLD, 32 * 2**20)  # glibc's maximum on 64-bit (also fixes it)
    mallopt(M_TRIM_THRESHOLD, 2**31 - 1)  # a C int: trim only above 2 GB free at the top
    mallopt(M_TOP_PAD, 512 * 2**20)  # grow the heap in large steps


def return_freed_memory() -> None:
    """CPU under FSDP: give every freed block of 1 MB or more back to the kernel at once.

    FSDP gathers a block's whole weights before its forward (and again in the backward) and frees them
    after, for every block, in the rollout's every decoding step and in the update. With the heap
    tuned by keep_freed_memory those frees stay resident and the heap grows past them instead of
    reusing them (docs/benchmarks.md, "FSDP's freed blocks unmapped"); glibc's own thresholds are not
    enough (it raises its mmap threshold to the largest block freed, so a block's weights come from the
    heap again). Mapping each
    block of FSDP_MMAP_THRESHOLD or more on its own (a fixed threshold, with glibc's own top pad and
    trimming) unmaps it on free; the cost is the kernel faulting the pages in again at each gather.
    A no-op off glibc or with CPU_MALLOC_TUNING off.
    """
    mallopt = _mallopt()
    if mallopt is None:
        return
    mallopt(M_TOP_PAD, GLIBC_TOP_PAD)
    mallopt(M_TRIM_THRESHOLD, GLIBC_TRIM_THRESHOLD)
    mallopt(M_MMAP_THRESHOLD, FSDP_MMAP_THRESHOLD)  # a fixed value: glibc stops raising it


def release_freed_memory() -> None:
    """CPU: hand the heap's free pages back to the kernel now (glibc malloc_trim), after a large free.

    keep_freed_memory makes glibc keep what is freed, which is right for the update's activations
    (freed and reallocated every micro-batch) but not for a one-off free: under FSDP each process
    loads the whole policy before prepare() shards it, and the whole weights, freed there, would
    stay in the resident set for the rest of the run. A no-op off glibc or with CPU_MALLOC_TUNING off.
    """
    libc = _tunable_libc()
    if libc is None:
        return
    import gc

    gc.collect()
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:  # musl has none
        trim(0)


def load_engine(recipe: Recipe, device: torch.device | None = None, mixed_precision: str | None = None) -> Engine:
    """Tokenizer, policy/reference/value and reward for ``recipe``; ``device`` is this process's
    (accelerate's) device when several processes train, else resolved from train.device;
    ``mixed_precision`` the run's (Distributed.mixed_precision), else train.mixed_precision resolved."""
    quiet_libraries()
    device = device or resolve_device(recipe.train.device)
    mixed_precision = mixed_precision or recipe_mixed_precision(recipe, device)
    check_mixed_precision(mixed_precision, device)
    if recipe.train.num_threads:
        torch.set_num_threads(recipe.train.num_threads)
    if device.type == "cpu":
        keep_freed_memory()
    pol = recipe.policy
    tokenizer = load_tokenizer(pol.path, trust_remote_code=pol.trust_remote_code, revision=pol.revision)
    stop_token_id = resolve_stop_token_id(tokenizer, recipe.generation.stop_token)
    check_value_model_tokenizer(recipe)
    reward = RewardStack(recipe.reward, device, recipe.data.system_prompt, lambda: recipe_prompt_columns(recipe.data))
    reward_models = {c.path: s.model for (_, _, s), c in zip(reward.scorers, recipe.reward.components) if c.loads_model}
    actor_critic = build_actor_critic(recipe, device, reward_models)
    if device.type == "cpu":
        for model in [actor_critic.policy, actor_critic.ref_model, *reward_models.values()]:
            if model is not None and is_quantized(model):
                own_unquantized_tensors(model)
    sampler = None
    if recipe.generation.backend == "vllm":
        from ppo_cli.engine.vllm_sampler import VllmSampler

        sampler = VllmSampler(recipe, device, actor_critic.policy, mixed_precision=mixed_precision)
    return Engine(recipe, device, tokenizer, actor_critic, reward, stop_token_id, sampler, mixed_precision,
                  shared_reward=SharedRewardModel.find(reward, actor_critic))


def own_unquantized_tensors(model: torch.nn.Module) -> None:
    """CPU: copy a quantized model's unquantized tensors (embeddings, norms, biases) off the checkpoint.

    from_pretrained leaves them as views of the memory-mapped safetensors file, which keeps the whole
    file mapped: every full-precision page that quantization read stays in the resident set, and a 4-bit
    model costs as much resident memory as the unquantized one. Once nothing points into the file, it
    is unmapped.
    """
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if param.dtype.is_floating_point:
                param.data = param.data.clone()
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.dtype.is_floating_point:
                module._buffers[name] = buffer.clone()
    import gc

    gc.collect()
