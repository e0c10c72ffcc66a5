"""One loaded engine: tokenizer, policy/value/reference, reward, and the rollout built from them.

Every command (train, rollout, score, eval, compare) goes through here, so loading, generation,
log-probs and scoring have one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ppo_cli.engine.data import format_prompts, tokenize_prompts
from ppo_cli.engine.generate import generate, resolve_stop_token_id, trim_padding
from ppo_cli.engine.logprobs import policy_forward, reference_logprobs, selective_log_softmax, value_forward
from ppo_cli.engine.models import POLICY_ADAPTER, ActorCritic, build_actor_critic, load_tokenizer, resolve_device
from ppo_cli.engine.rewards import RewardStack, ScoreResult
from ppo_cli.recipe import Recipe
from ppo_cli.types import Generation, Rollout


@dataclass
class Engine:
    recipe: Recipe
    device: torch.device
    tokenizer: object
    actor_critic: ActorCritic
    reward: RewardStack
    stop_token_id: int

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    def generate(self, prompts: list[str]) -> Generation:
        """Sample one response per prompt with the policy (global torch RNG: seed it first)."""
        recipe = self.recipe
        texts = format_prompts(prompts, self.tokenizer, recipe.data.chat_template)
        prompt_ids, prompt_mask = tokenize_prompts(texts, self.tokenizer, recipe.data.max_prompt_tokens, self.device)
        self.actor_critic.use_adapter(POLICY_ADAPTER)
        generation = generate(
            self.actor_critic.policy, prompt_ids, prompt_mask, recipe.generation, self.stop_token_id, self.pad_token_id
        )
        return trim_padding(generation)

    def decode_responses(self, generation: Generation) -> list[str]:
        return self.tokenizer.batch_decode(generation.response_ids, skip_special_tokens=True)

    def score(self, prompts: list[str], responses: list[str], generation: Generation) -> ScoreResult:
        return self.reward.score(
            prompts, responses, generation.finished.tolist(), generation.response_lengths.tolist()
        )

    @torch.no_grad()
    def evaluate_logprobs_and_values(self, generation: Generation, chunk: int):
        """Old log-probs, reference log-probs and old values (B, T) each, 0 outside the response mask."""
        ac, temperature = self.actor_critic, self.recipe.generation.temperature
        sequences, attention_mask = generation.sequences, generation.attention_mask
        T = generation.response_ids.shape[1]
        logprobs, ref_logprobs, values = [], [], []
        for rows in torch.arange(sequences.shape[0], device=sequences.device).split(chunk):
            seq, attn, resp = sequences[rows], attention_mask[rows], generation.response_ids[rows]
            logits, vals = policy_forward(ac, seq, attn, T, temperature)
            logprobs.append(selective_log_softmax(logits, resp))
            del logits
            ref_logprobs.append(reference_logprobs(ac, seq, attn, resp, temperature))
            values.append(vals if vals is not None else value_forward(ac, seq, attn, T))
        mask = generation.response_mask
        zero = lambda parts: torch.cat(parts).masked_fill(~mask, 0.0)  # noqa: E731
        return zero(logprobs), zero(ref_logprobs), zero(values)

    def collect_rollout(self, prompts: list[str]) -> Rollout:
        generation = self.generate(prompts)
        responses = self.decode_responses(generation)
        logprobs, ref_logprobs, values = self.evaluate_logprobs_and_values(
            generation, self.recipe.ppo.micro_batch_size
        )
        result = self.score(prompts, responses, generation)
        scores = torch.tensor(result.scores, dtype=torch.float32, device=self.device)
        return Rollout(generation, prompts, responses, logprobs, ref_logprobs, values, scores, result.components)


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


def load_engine(recipe: Recipe) -> Engine:
    quiet_libraries()
    device = resolve_device(recipe.train.device)
    if recipe.train.num_threads:
        torch.set_num_threads(recipe.train.num_threads)
    pol = recipe.policy
    tokenizer = load_tokenizer(pol.path, trust_remote_code=pol.trust_remote_code, revision=pol.revision)
    stop_token_id = resolve_stop_token_id(tokenizer, recipe.generation.stop_token)
    reward = RewardStack(recipe.reward, device)
    actor_critic = build_actor_critic(recipe, device)
    return Engine(recipe, device, tokenizer, actor_critic, reward, stop_token_id)
