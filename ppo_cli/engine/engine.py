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
from ppo_cli.engine.generate import resolve_stop_token_id
from ppo_cli.engine.actor_critic import (
    ActorCritic,
    build_actor_critic,
    check_value_model_tokenizer,
    policy_forward,
    reference_logprobs,
    value_forward,
    values_from_hidden,
)
from ppo_cli.engine.malloc import tune_for_training
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
from ppo_cli.engine.sampler import Sampled, Sampler, TransformersSampler
from ppo_cli.perf import ModelSizes
from ppo_cli.recipe import Recipe
from ppo_cli.types import DeferredOldLogprobs, Generation, Rollout

@dataclass(frozen=True)
class EngineOptions:
    """Speed levers a benchmark or a test turns off (docs/benchmarks.md measures each); the defaults
    are what every command runs with. Given to load_engine, kept on the Engine."""

    # Reference and critic forwards under torch.inference_mode (outputs cloned back to normal tensors);
    # the policy's own tensors stay out of it, they meet autograd in the update.
    inference_mode: bool = True
    # CPU: tune glibc's heap for training (engine/malloc.py tune_for_training): large blocks mapped on
    # transparent huge pages where torch gets them, else freed activation memory kept in the process
    # instead of handed back to the kernel after every backward (measured at the 0.5B shape on 2 cores:
    # backward 9.8 -> 5.8 s per update, peak resident memory +5%; docs/benchmarks.md).
    cpu_malloc_tuning: bool = True
    # One forward of a reward model that is also the frozen critic, for its scores and the critic's
    # features, instead of one each (engine/shared_reward.py).
    shared_reward_forward: bool = True


@dataclass
class Engine:
    recipe: Recipe
    device: torch.device
    tokenizer: object
    actor_critic: ActorCritic
    reward: RewardStack
    stop_token_id: int
    sampler: Sampler  # chosen once at load (make_sampler); a wrapping sampler may replace it
    # 'no', 'bf16' or 'fp16' (train.mixed_precision resolved): generation and the rollout's forwards
    # run under the autocast the update's forward gets from accelerate, so the first ratio is 1.
    mixed_precision: str = "no"
    generation_seconds: float = 0.0
    # the reward model whose backbone is the frozen critic's: one forward gives scores and features
    shared_reward: SharedRewardModel | None = None
    options: EngineOptions = EngineOptions()
    gradient_checkpointing: bool = False  # train.gradient_checkpointing resolved (load_engine)

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    def autocast(self):
        return autocast_context(self.mixed_precision, self.device)

    # --- sampling -----------------------------------------------------------------------------------

    def sample(self, prompts: list, **options) -> Sampled:
        """The prompts tokenized (chat template, left padding) and handed to the sampler with the
        policy adapter active; ``options``: Sampler.sample's keywords (global torch RNG: seed it first)."""
        self.actor_critic.use_adapter(POLICY_ADAPTER)
        if getattr(self.sampler, "reads_prompts", False):  # episodes of several turns: their own prompts and rows
            return self.sampler.sample(self.actor_critic.policy, None, None, prompts=prompts, device=self.device, **options)
        prompt_ids, prompt_mask = tokenize_prompts(prompts, self.tokenizer, self.recipe.data, self.device)
        return self.sampler.sample(self.actor_critic.policy, prompt_ids, prompt_mask, **options)

    def generate(self, prompts: list[str]) -> Generation:
        """Sample one response per prompt with the policy (global torch RNG: seed it first)."""
        return self.sample(prompts).generation

    def decode_responses(self, generation: Generation) -> list[str]:
        return self.tokenizer.batch_decode(generation.response_ids, skip_special_tokens=True)

    def decode_response(self, response_ids: list[int]) -> str:
        """One response as decode_responses gives it (without the padding after its stop token)."""
        return self.tokenizer.decode(response_ids, skip_special_tokens=True)

    # --- scoring ------------------------------------------------------------------------------------

    def score(self, prompts: list[str], responses: list[str], generation: Generation,
              shared: SharedForward | None = None, pending=None) -> ScoreResult:
        """``shared``: the reward model's scores already taken from the critic's forward; ``pending``:
        the remote components' requests already sent (RewardStack.start)."""
        known = {shared.component: shared.scores} if shared is not None else None
        return self.reward.score(
            prompts, responses, generation.finished.tolist(), generation.response_lengths.tolist(), known,
            pending=pending, action_lengths=generation.action_mask.sum(dim=1).tolist(),
        )

    def shared_reward_forward(self, prompts: list, responses: list[str], generation: Generation) -> SharedForward | None:
        """The frozen critic's features and, for the rows whose tokens the reward model reads as the
        policy's, its scores, from one forward of the reward model (engine/rewards/shared.py); None
        where no reward model is the critic or no row's tokens match (then the two forwards run)."""
        if self.shared_reward is None or not self.options.shared_reward_forward or self.recipe.environment is not None:
            return None
        positions = self.shared_reward.score_positions(prompts, responses, generation)
        if (positions < 0).all():
            return None
        return self.shared_reward.forward(generation, positions, self.recipe.ppo.micro_batch_size)

    # --- log-probs and values -----------------------------------------------------------------------

    @torch.no_grad()
    def evaluate_logprobs_and_values(self, generation: Generation, chunk: int, sampled: Sampled | None = None,
                                     fixed_features: torch.Tensor | None = None, old_logprobs: bool = True,
                                     reference: bool = True):
        """Old log-probs, reference log-probs and old values (B, T) each, 0 outside the action mask
        (the trained tokens; without a critic the values are NoCritic's zeros), and, for a frozen value
        model, the features its head read (B, T, H) (else None). ``chunk`` rows at a time.

        ``sampled``: the sampler's result; where its log-probs are the policy's own (policy_logprobs),
        they (and its hidden states, for a value head) stand for the policy's forward, which is then
        skipped. ``fixed_features``: the frozen value model's features already computed (B, T, H)
        (shared_reward_forward); its forward is then skipped. ``old_logprobs`` False (no critic, a
        separate reference): no policy forward, and None for the old log-probs (the update's first
        epoch computes them: defer_old_logprobs). ``reference`` False (ppo.uses_reference False): no
        reference forward, and zeros for its log-probs, which nothing reads.
        """
        ac = self.actor_critic
        if not old_logprobs and (ac.critic.trains or ac.reference_is_policy):
            raise ValueError("the old log-probs can be left out only without a critic and with a separate reference")
        if sampled is not None and not (sampled.policy_logprobs and sampled.logprobs is not None):
            sampled = None  # a separate engine's log-probs are compared with the old ones, never used as them
        T = generation.response_ids.shape[1]
        logprobs, ref_logprobs, values, features = [], [], [], []
        for rows in torch.arange(generation.response_ids.shape[0], device=generation.response_ids.device).split(chunk):
            seq, attn = generation.sequences[rows], generation.attention_mask[rows]
            resp = generation.response_ids[rows]
            head_values = None  # (b, T) a value head's, when they come with the policy's forward
            if old_logprobs:
                lp, head_values = self._old_logprobs(seq, attn, resp, rows, sampled)
                logprobs.append(lp)
            with torch.inference_mode(self.options.inference_mode), self.autocast():
                if not reference:
                    ref = torch.zeros(resp.shape, device=resp.device)
                elif ac.reference_is_policy:
                    ref = logprobs[-1]
                else:
                    ref = reference_logprobs(ac, seq, attn, resp, self.temperature)
                if ac.value_features_fixed:
                    features.append(fixed_features[rows] if fixed_features is not None
                                    else ac.critic.features(ac, seq, attn, T).clone())
                vals = self._old_values(seq, attn, T, head_values, features[-1] if features else None)
            ref_logprobs.append(ref.clone())  # clone: a normal tensor again, usable by the update's autograd
            values.append(vals.clone())
        zero = lambda parts: torch.cat(parts).masked_fill(~generation.action_mask, 0.0)  # noqa: E731
        return (zero(logprobs) if old_logprobs else None, zero(ref_logprobs), zero(values),
                torch.cat(features) if features else None)

    @property
    def temperature(self) -> float:
        return self.recipe.generation.temperature

    def _old_logprobs(self, sequences, attention_mask, response_ids, rows, sampled: Sampled | None):
        """One chunk's old log-probs (b, T) and, where the critic reads the policy's states, its values
        (b, T) (else None): from the sampler's own forward when ``sampled`` has them, else from a
        policy forward under the run's autocast."""
        ac = self.actor_critic
        if sampled is None:
            with self.autocast():
                logprobs, _, head_values = policy_forward(ac, sequences, attention_mask, response_ids, self.temperature)
            return logprobs, head_values
        if not ac.value_reads_policy_hidden:
            return sampled.logprobs[rows], None
        if sampled.hidden is None:  # a sampler that kept no hidden states: the head's own forward
            return sampled.logprobs[rows], value_forward(ac, sequences, attention_mask, response_ids.shape[1])
        return sampled.logprobs[rows], values_from_hidden(ac, sampled.hidden[rows])

    def _old_values(self, sequences, attention_mask, T: int, head_values, features):
        """One chunk's old values (b, T): a frozen value model's head over its ``features`` (b, T, H), a
        value head's ``head_values`` (they came with the old log-probs), else the critic's own forward
        (NoCritic: zeros)."""
        ac = self.actor_critic
        if features is not None:
            return values_from_hidden(ac, features)
        if ac.value_reads_policy_hidden:
            return head_values
        return value_forward(ac, sequences, attention_mask, T)

    def reuses_generation_forward(self) -> bool:
        """Take the old log-probs (and head values) from the generation's own forward passes?

        When ppo.rollout_logprobs is 'generation', and only where that is exact to float32 rounding (the
        KV-cached and the full forward agree to ~1e-6): a float32, unquantized policy without mixed
        precision. In bfloat16 (weights or autocast), or through bitsandbytes' single-row kernels, the
        two differ enough to move the first PPO ratio off 1, so those keep the separate forward.
        """
        if self.recipe.ppo.rollout_logprobs != "generation" or self.mixed_precision != "no":
            return False
        if self.recipe.environment is not None:  # each turn's own KV cache: the whole episode's forward is the one trained
            return False
        if is_quantized(self.actor_critic.policy):
            return False
        head = unwrap_causal_lm(self.actor_critic.policy).get_output_embeddings()
        return head is not None and head.weight.dtype == torch.float32

    # --- memory and sizes ---------------------------------------------------------------------------

    def store_frozen_weights_in_compute_dtype(self) -> int:
        """Under bf16/fp16 autocast, a LoRA policy's frozen Linear weights stored in that dtype
        (engine/frozen_weights.py: the same numbers, half their memory, no cast per call). One process
        only (FSDP and DeepSpeed shard and flatten the weights themselves); not for a quantized policy
        (its own kernels) or a sampler with its own copy of the weights (vLLM: it reads them). Returns
        the layers stored."""
        from ppo_cli.engine.frozen_weights import store_frozen_linears_in
        from ppo_cli.engine.precision import AUTOCAST_DTYPES

        policy = self.actor_critic.policy
        if (self.mixed_precision not in AUTOCAST_DTYPES or self.recipe.policy.lora is None or self.sampler.copies_weights
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
        critic = ac.critic.forward_parameters(ac, policy)  # the critic's own forward (NoCritic: 0)
        shared = self.shared_reward is not None and self.options.shared_reward_forward  # the reward model's forward serves it
        forwards += (0 if shared else critic) + sum(count(getattr(scorer, "model", None)) for _, _, scorer in self.reward.scorers)
        trained = policy + (0 if ac.value_features_fixed else critic)
        weight_bytes = sum(p.numel() * p.element_size() for p in ac.policy.parameters())
        return ModelSizes(policy, forwards, trained, weight_bytes)

    # --- the rollout --------------------------------------------------------------------------------

    def collect_rollout(self, prompts: list[str], old_logprobs: bool = True) -> Rollout:
        """``old_logprobs`` False: rollout.logprobs a DeferredOldLogprobs, left to the update (defer_old_logprobs)."""
        # Requests to reward servers and judges go out as rows finish sampling (a sampler that streams),
        # and the rest right after it, so their latency overlaps the decoding and the forwards below.
        stream = self.reward.stream(prompts, self.decode_response) if self.sampler.streams else None
        pending = None
        try:
            started = time.perf_counter()
            from_generation = old_logprobs and self.reuses_generation_forward()
            sampled = self.sample(prompts, with_logprobs=from_generation,
                                  keep_hidden=from_generation and self.actor_critic.value_reads_policy_hidden,
                                  on_finished=stream.finished if stream is not None else None)
            self.generation_seconds = time.perf_counter() - started  # the last rollout's (perf/decode_gbps)
            generation, episodes = sampled.generation, getattr(sampled, "episodes", None)
            responses = self.decode_responses(generation) if episodes is None else [e.last_response for e in episodes]
            pending = self.reward.start(prompts, responses, self.episode_columns(prompts, episodes), stream=stream)
            shared = self.shared_reward_forward(prompts, responses, generation)
            logprobs, ref_logprobs, values, fixed_features = self.evaluate_logprobs_and_values(
                generation, self.recipe.ppo.micro_batch_size, sampled, shared.features if shared is not None else None,
                old_logprobs=old_logprobs, reference=self.recipe.ppo.uses_reference,
            )
        except BaseException:
            if pending is not None:
                pending.close()
            elif stream is not None:
                stream.close()
            raise
        result = self.score(prompts, responses, generation, shared, pending)
        scores, scored, failures = self._score_tensors(result)
        if episodes is not None:
            scores, scored, failures = with_episode_outcomes(scores, scored, failures, episodes)
        if not old_logprobs:
            logprobs = DeferredOldLogprobs(ref_logprobs)
        # compared with the old log-probs, never used as them
        sampler_logprobs = sampled.logprobs if not sampled.policy_logprobs else None
        return Rollout(generation, prompts, responses, logprobs, ref_logprobs, values, scores, result.components,
                       fixed_features, sampler_logprobs, scored, failures, episodes)

    def episode_columns(self, prompts: list, episodes) -> dict[str, list] | None:
        """The columns the reward functions get: with episodes of several turns, ``messages`` (each episode's
        transcript after its prompt) beside the rows' own; else None (looked up as a component needs them)."""
        if episodes is None:
            return None
        reads = any(getattr(scorer, "reads_columns", False) for _, _, scorer in self.reward.scorers)
        return {**(self.reward.columns_for(prompts) if reads else {}), "messages": [e.messages for e in episodes]}

    def _score_tensors(self, result: ScoreResult):
        """The rollout's scores (B,) (0 where not scored) and, where a component may leave an episode
        without a reward, the scored mask (B,) and each such component's latest failure (else None, None)."""
        scores = torch.tensor([0.0 if s is None else s for s in result.scores], dtype=torch.float32, device=self.device)
        if not self.reward.failable:
            return scores, None, None
        scored = torch.tensor(result.scored, dtype=torch.bool, device=self.device)
        return scores, scored, {name: result.failures.get(name, "") for name in self.reward.failable}


def with_episode_outcomes(scores: torch.Tensor, scored: torch.Tensor | None, failures: dict | None, episodes):
    """Episodes of several turns: each score (B,) plus the sum of its steps' rewards; an episode whose
    environment failed has no reward (it leaves the update, counted as reward/failed_rate and
    env/failed_rate), its failure kept under ``environment``."""
    device = scores.device
    step = torch.tensor([e.step_reward or 0.0 for e in episodes], dtype=scores.dtype, device=device)
    ok = torch.tensor([not e.failed for e in episodes], dtype=torch.bool, device=device)
    failures = dict(failures or {})
    failures["environment"] = next((e.failure for e in reversed(episodes) if e.failed and e.failure), "")
    return scores + step, ok if scored is None else scored & ok, failures


def make_sampler(recipe: Recipe, device: torch.device, policy: torch.nn.Module, stop_token_id: int, pad_token_id: int,
                 mixed_precision: str, model=None, tokenizer=None, columns_for=None) -> Sampler:
    """The sampler generation.backend names, built once at load, and with an environment section the
    multi-turn sampler around it (``tokenizer`` then needed; ``columns_for``: the prompts' rows, which an
    environment's reset reads). ``model``: the ResolvedModel the inference commands sample (vLLM loads
    its weights / adapter), None when training."""
    if recipe.generation.backend == "vllm":
        from ppo_cli.engine.vllm_sampler import VllmSampler

        sampler = VllmSampler(recipe, device, policy, model=model, mixed_precision=mixed_precision,
                              stop_token_id=stop_token_id, pad_token_id=pad_token_id)
    elif recipe.generation.backend == "vllm_server":
        from ppo_cli.engine.vllm_server_sampler import VllmServerSampler

        sampler = VllmServerSampler(recipe, stop_token_id, pad_token_id, model=model)
    else:
        sampler = TransformersSampler(recipe.generation, stop_token_id, pad_token_id, mixed_precision, device)
    if recipe.environment is None:
        return sampler
    from ppo_cli.engine.envs.environments import EnvironmentFactory
    from ppo_cli.engine.envs.multi_turn import MultiTurnSampler

    env = recipe.environment
    return MultiTurnSampler(sampler, EnvironmentFactory(env), tokenizer, env, stop_token_id, pad_token_id,
                            columns_for=columns_for if env.type != "tools" else None,  # tools read no row
                            system_prompt=recipe.data.system_prompt, max_prompt_tokens=recipe.data.max_prompt_tokens,
                            max_turn_tokens=recipe.generation.max_new_tokens)


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


def load_engine(recipe: Recipe, device: torch.device | None = None, mixed_precision: str | None = None,
                options: EngineOptions = EngineOptions(), gradient_checkpointing: bool | None = None) -> Engine:
    """Tokenizer, policy/reference/value and reward for ``recipe``; ``device`` is this process's
    (accelerate's) device when several processes train, else resolved from train.device;
    ``mixed_precision`` the run's (Distributed.mixed_precision), else train.mixed_precision resolved;
    ``gradient_checkpointing`` the run's (commands/plan.py's planned_checkpointing resolves auto from the
    memory plan), else train.gradient_checkpointing's true/false, and off for auto (inference needs none)."""
    quiet_libraries()
    device = device or resolve_device(recipe.train.device)
    mixed_precision = mixed_precision or recipe_mixed_precision(recipe, device)
    check_mixed_precision(mixed_precision, device)
    if recipe.train.num_threads:
        torch.set_num_threads(recipe.train.num_threads)
    if gradient_checkpointing is None:
        gradient_checkpointing = recipe.train.gradient_checkpointing is True
    if device.type == "cpu" and options.cpu_malloc_tuning:
        tune_for_training(gradient_checkpointing)
    pol = recipe.policy
    tokenizer = load_tokenizer(pol.path, trust_remote_code=pol.trust_remote_code, revision=pol.revision)
    stop_token_id = resolve_stop_token_id(tokenizer, recipe.generation.stop_token)
    check_value_model_tokenizer(recipe)
    reward = RewardStack(recipe.reward, device, recipe.data.system_prompt, lambda: recipe_prompt_columns(recipe.data),
                         max_new_tokens=recipe.generation.max_new_tokens, mixed_precision=mixed_precision)
    reward_models = {c.path: s.model for (_, _, s), c in zip(reward.scorers, recipe.reward.components) if c.loads_model}
    actor_critic = build_actor_critic(recipe, device, reward_models, gradient_checkpointing)
    if device.type == "cpu":
        for model in [actor_critic.policy, actor_critic.ref_model, *reward_models.values()]:
            if model is not None and is_quantized(model):
                own_unquantized_tensors(model)
    sampler = make_sampler(recipe, device, actor_critic.policy, stop_token_id, tokenizer.pad_token_id, mixed_precision,
                           tokenizer=tokenizer, columns_for=reward.columns_for)
    return Engine(recipe, device, tokenizer, actor_critic, reward, stop_token_id, sampler, mixed_precision,
                  shared_reward=SharedRewardModel.find(reward, actor_critic), options=options,
                  gradient_checkpointing=gradient_checkpointing)


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
