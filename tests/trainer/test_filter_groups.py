"""trainer.collect_filtered_rollout (ppo.filter_groups, DAPO's dynamic sampling) on a scripted engine: which
groups are kept, how many rounds run, what is logged, where the prompt sampler ends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ppo_cli import metric_names as names
from ppo_cli.engine.data import PromptSampler
from ppo_cli.recipe_loading import load_recipe
from ppo_cli.train_metrics import generated_reward_metrics
from ppo_cli.trainer import collect_filtered_rollout
from ppo_cli.types import Generation, Rollout
from tests.conftest import ROOT, tiny_overrides

G = 4
# "m": the completions score apart (1, 0, 1, 0); "h": all fail (0 x 4)
SCORES = {"m": [1.0, 0.0, 1.0, 0.0], "h": [0.0] * G}


class ScriptedEngine:
    """collect_rollout's shape, with each group's scores set by its prompt's first letter; each round's
    responses one token wider than the last, so kept groups of different rounds must be padded together."""

    pad_token_id = 0

    def __init__(self):
        self.rounds = 0

    def collect_rollout(self, prompts, old_logprobs=True):
        self.rounds += 1
        B, T = len(prompts), self.rounds
        mask = torch.ones(B, T, dtype=torch.bool)
        generation = Generation(torch.ones(B, 2, dtype=torch.long), torch.ones(B, 2, dtype=torch.bool),
                                torch.full((B, T), 5), mask, torch.ones(B, dtype=torch.bool), mask.clone())
        scores = [s for p in prompts[::G] for s in SCORES[p[0]]]
        zeros = torch.zeros(B, T)
        return Rollout(generation, list(prompts), [f"{p}-{self.rounds}" for p in prompts], zeros, zeros, zeros,
                       torch.tensor(scores), {"answer": list(scores)})


class OneProcess:
    rank, world_size, device = 0, 1, torch.device("cpu")

    def gather(self, tensor):
        return tensor

    def any(self, flag):
        return flag

    def gather_objects(self, obj):
        return [obj]


def _state(tmp_path, prompts, **sets):
    sets = {"ppo.filter_groups": "true", "ppo.rollout_batch_size": 2, "ppo.mini_batch_size": 8,
            "ppo.micro_batch_size": 8, **sets}
    recipe = load_recipe(ROOT / "recipes" / "tiny_grpo.yaml", tiny_overrides(tmp_path / "models", tmp_path, **sets))
    return SimpleNamespace(recipe=recipe, engine=ScriptedEngine(), dist=OneProcess(), step=0,
                           sampler=PromptSampler(prompts, seed=0, shuffle=False))


def test_rounds_run_until_the_batch_is_full(tmp_path):
    state = _state(tmp_path, ["h0", "m0", "h1", "h2", "m1", "h3", "h4", "h5"], **{"ppo.max_filter_rounds": 2})
    rollout, filtered = collect_filtered_rollout(state, deferred=False)
    # round 1: h0 m0 -> m0; round 2: h1 h2 -> none; round 3: m1 h3 -> m1: full after 3 rounds
    assert rollout.prompts == ["m0"] * G + ["m1"] * G
    assert rollout.responses == ["m0-1"] * G + ["m1-3"] * G
    assert rollout.generation.response_mask.sum(dim=1).tolist() == [1] * G + [3] * G  # round 1's padded to 3
    assert rollout.scores.tolist() == SCORES["m"] * 2
    assert filtered.metrics == {names.FILTER_KEPT_GROUPS: 2, names.FILTER_ROUNDS: 3,
                                names.FILTER_GENERATED_EPISODES: 24, names.FILTER_FILL: 1.0}
    assert filtered.generated_tokens == 8 * 1 + 8 * 2 + 8 * 3
    assert state.sampler.position == 6  # three batches of 2 prompts: a checkpoint now resumes after them
    # the reward metrics see every generated episode: 4 of 24 scored 1, four of six groups all the same
    metrics = generated_reward_metrics(filtered.generated, -0.5, state.dist, G)
    assert metrics[names.OBJECTIVE_SCORES] == pytest.approx(4 / 24)
    assert metrics[names.OBJECTIVE_RLHF_REWARD] == pytest.approx(4 / 24 - 0.5)
    assert metrics[names.FRAC_REWARD_ZERO_STD] == pytest.approx(4 / 6)
    assert metrics[names.reward_component("answer")] == pytest.approx(4 / 24)


def test_a_full_first_round_samples_once(tmp_path):
    state = _state(tmp_path, ["m0", "m1", "h0"])
    rollout, filtered = collect_filtered_rollout(state, deferred=False)
    assert rollout.prompts == ["m0"] * G + ["m1"] * G
    assert filtered.metrics[names.FILTER_ROUNDS] == 1 and state.sampler.position == 2


def test_out_of_rounds_trains_on_what_was_kept(tmp_path):
    state = _state(tmp_path, ["h0", "m0", "h1", "h2", "m1", "h3"], **{"ppo.max_filter_rounds": 1})
    rollout, filtered = collect_filtered_rollout(state, deferred=False)
    assert rollout.prompts == ["m0"] * G
    assert filtered.metrics == {names.FILTER_KEPT_GROUPS: 1, names.FILTER_ROUNDS: 2,
                                names.FILTER_GENERATED_EPISODES: 16, names.FILTER_FILL: 0.5}


def test_nothing_kept_trains_on_the_last_round_as_it_came(tmp_path):
    state = _state(tmp_path, ["h0", "h1", "h2", "h3"], **{"ppo.max_filter_rounds": 1})
    rollout, filtered = collect_filtered_rollout(state, deferred=False)
    assert rollout.prompts == ["h2"] * G + ["h3"] * G
    assert filtered.metrics[names.FILTER_KEPT_GROUPS] == 0 and filtered.metrics[names.FILTER_FILL] == 0.0
