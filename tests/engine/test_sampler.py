"""The Sampler seam (engine/sampler.py): what a Sampled holds, and a sampler that wraps another fits on
an Engine without touching it (the multi-turn sampler will be one)."""

from __future__ import annotations

import pytest
import torch

from ppo_cli.engine.sampler import Sampled, TransformersSampler, trimmed, with_budget
from ppo_cli.recipe import GenerationConfig
from ppo_cli.types import Generation
from tests.conftest import ROOT, tiny_overrides

PAD = 1


def _generation(lengths: list[int], width: int) -> Generation:
    B = len(lengths)
    mask = torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # (B, width)
    ids = torch.where(mask, 7, PAD)
    prompt = torch.full((B, 2), 5)
    return Generation(prompt, torch.ones_like(prompt, dtype=torch.bool), ids, mask, torch.ones(B, dtype=torch.bool), mask)


def test_trimmed_cuts_everything_to_the_longest_response_and_zeroes_logprobs_outside_the_action_mask():
    generation = _generation([1, 3], width=5)
    logprobs = torch.tensor([[-0.5, -9.0, -9.0, -9.0, 0.0],  # row 0 stopped after 1 token: padding's log-probs after it
                             [-0.25, -0.5, -1.5, 0.0, 0.0]])
    hidden = torch.arange(2 * 5 * 4, dtype=torch.float32).reshape(2, 5, 4)
    sampled = trimmed(generation, logprobs, hidden, policy_logprobs=True)
    assert sampled.generation.response_ids.shape == (2, 3)
    assert sampled.logprobs.tolist() == [[-0.5, 0.0, 0.0], [-0.25, -0.5, -1.5]]
    assert torch.equal(sampled.hidden, hidden[:, :3])
    assert sampled.policy_logprobs


def test_trimmed_keeps_none_for_what_was_not_asked():
    sampled = trimmed(_generation([2], width=4), None, None, policy_logprobs=False)
    assert sampled.logprobs is None and sampled.hidden is None
    assert sampled.generation.response_ids.shape == (1, 2)


def test_with_budget_changes_only_the_token_budget():
    gen = GenerationConfig(max_new_tokens=64, temperature=0.7)
    assert with_budget(gen, None) is gen
    short = with_budget(gen, 5)
    assert short.max_new_tokens == 5 and short.temperature == 0.7 and gen.max_new_tokens == 64


class RecordingSampler:
    """A sampler that wraps another, as a multi-turn one would: it passes every call on and records it."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.streams, self.copies_weights = inner.streams, inner.copies_weights

    def sample(self, policy, prompt_ids, prompt_mask, **options) -> Sampled:
        self.calls.append({"rows": prompt_ids.shape[0], **options})
        return self.inner.sample(policy, prompt_ids, prompt_mask, **options)

    def close(self) -> None:
        self.inner.close()


PROMPTS = ["The movie was", "I think the book was", "This phone is", "Overall, the product is"]


def _engine(tiny_models, tmp_path, **sets):
    from ppo_cli.engine.engine import load_engine
    from ppo_cli.recipe_loading import load_recipe

    sets = {"ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 4, "ppo.micro_batch_size": 2,
            "generation.max_new_tokens": 8, **sets}
    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", tiny_overrides(tiny_models, tmp_path, float32=True, **sets))
    return load_engine(recipe)


@pytest.mark.slow
@pytest.mark.parametrize("rollout_logprobs", ["forward", "generation"])
def test_a_wrapping_sampler_on_the_engine_gives_the_rollout_the_engine_gave_alone(tiny_models, tmp_path, rollout_logprobs):
    engine = _engine(tiny_models, tmp_path, **{"value.kind": "head", "ppo.rollout_logprobs": rollout_logprobs})
    assert isinstance(engine.sampler, TransformersSampler)
    torch.manual_seed(0)
    alone = engine.collect_rollout(PROMPTS)
    engine.sampler = RecordingSampler(engine.sampler)
    torch.manual_seed(0)
    wrapped = engine.collect_rollout(PROMPTS)

    (call,) = engine.sampler.calls
    from_generation = rollout_logprobs == "generation"  # the old log-probs and head values from generate's forwards
    assert call["rows"] == 4 and call["with_logprobs"] is from_generation and call["keep_hidden"] is from_generation
    assert call["on_finished"] is None  # a classifier reward does not stream (tests/engine/test_reward_stream.py does)
    assert torch.equal(wrapped.generation.sequences, alone.generation.sequences)
    for field in ("logprobs", "ref_logprobs", "values", "scores"):
        assert torch.equal(getattr(wrapped, field), getattr(alone, field)), field
    assert wrapped.sampler_logprobs is None  # the policy's own log-probs are never compared with themselves


@pytest.mark.slow
def test_the_transformers_sampler_keeps_to_one_calls_token_budget_and_gives_the_policys_logprobs(tiny_models, tmp_path):
    from ppo_cli.engine.chat import tokenize_prompts

    engine = _engine(tiny_models, tmp_path, **{"value.kind": "none", "ppo.advantage": "grpo", "generation.num_generations": 2})
    prompt_ids, prompt_mask = tokenize_prompts(PROMPTS, engine.tokenizer, engine.recipe.data, engine.device)
    torch.manual_seed(0)
    sampled = engine.sampler.sample(engine.actor_critic.policy, prompt_ids, prompt_mask, with_logprobs=True,
                                    max_new_tokens=3)
    generation = sampled.generation
    assert generation.response_ids.shape[1] <= 3 and sampled.policy_logprobs and sampled.hidden is None
    assert sampled.logprobs.shape == generation.response_ids.shape
    assert (sampled.logprobs[~generation.action_mask] == 0).all() and (sampled.logprobs[generation.action_mask] < 0).all()
    # the same tokens' log-probs from the policy's own forward (float32: equal to rounding)
    old, _, values, _ = engine.evaluate_logprobs_and_values(generation, 2)
    torch.testing.assert_close(sampled.logprobs, old, atol=1e-5, rtol=0)
    assert (values == 0).all()  # NoCritic: no baseline


def test_the_engine_options_default_to_every_speed_lever_on():
    from ppo_cli.engine.engine import EngineOptions

    assert EngineOptions() == EngineOptions(inference_mode=True, cpu_malloc_tuning=True, shared_reward_forward=True)


def test_generation_backend_hf_gets_the_transformers_sampler_which_streams():
    from ppo_cli.engine.engine import make_sampler
    from ppo_cli.recipe_loading import load_recipe

    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml")
    sampler = make_sampler(recipe, torch.device("cpu"), policy=None, stop_token_id=0, pad_token_id=1, mixed_precision="no")
    assert isinstance(sampler, TransformersSampler) and sampler.streams and not sampler.copies_weights
    assert (sampler.gen, sampler.stop_token_id, sampler.pad_token_id) == (recipe.generation, 0, 1)


def test_weights_fingerprint_changes_with_any_value_and_only_then():
    from ppo_cli.engine.sampler import weights_fingerprint

    weights = [("a", torch.zeros(4, 3)), ("b", torch.ones(5, dtype=torch.bfloat16))]
    same = [("a", torch.zeros(4, 3)), ("b", torch.ones(5, dtype=torch.bfloat16))]
    assert weights_fingerprint(weights) == weights_fingerprint(same)
    same[0][1][3, 2] = 1e-30  # the smallest change an update could make still shows
    assert weights_fingerprint(weights) != weights_fingerprint(same)
    assert weights_fingerprint(weights) != weights_fingerprint([("a", torch.zeros(4, 3)), ("c", torch.ones(5, dtype=torch.bfloat16))])
    assert weights_fingerprint([("a", torch.zeros(4, 3).t())]) == weights_fingerprint([("a", torch.zeros(3, 4))])
