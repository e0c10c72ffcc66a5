"""One forward of the reward model that is also the frozen critic (engine/rewards/shared.py): the same
rewards and values as its two forwards, the fallback where the reward's tokens differ, and the count."""

import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ppo_cli.engine.engine import EngineOptions, load_engine
from ppo_cli.engine.rewards.stack import RewardStack
from ppo_cli.engine.rewards.shared import SharedRewardModel
from ppo_cli.recipe import RewardConfig
from ppo_cli.recipe_loading import load_recipe
from ppo_cli.types import Generation
from tests.conftest import ROOT, tiny_overrides

PROMPTS = ["I think the book was", "The movie was", "Overall, the product is", "This phone is",
           "The service", "My new laptop", "The hotel room was", "This restaurant"]
PAD, STOP = 1, 0


def _scorer(token_ids: list[list[int]]):
    """What score_positions reads of a ModelScorer: the ids its tokenizer gives and the model's pad id."""
    config = SimpleNamespace(get_text_config=lambda: SimpleNamespace(pad_token_id=PAD))
    return SimpleNamespace(token_ids=lambda prompts, responses: token_ids, model=SimpleNamespace(config=config))


def test_score_positions_are_the_reward_models_last_token_in_the_policys_sequence():
    # Row 0: left-padded prompt [7 8], response [9 STOP] (finished); the reward text lost the stop token.
    # Row 1: prompt [5 6 7], response [8 9] (unfinished); the reward reads all of it.
    # Row 2: the reward's tokenisation split a sampled token differently: scored by the reward model itself.
    generation = Generation(
        prompt_ids=torch.tensor([[PAD, 7, 8], [5, 6, 7], [PAD, 4, 4]]),
        prompt_mask=torch.tensor([[False, True, True], [True, True, True], [False, True, True]]),
        response_ids=torch.tensor([[9, STOP], [8, 9], [30, PAD]]),
        response_mask=torch.tensor([[True, True], [True, True], [True, False]]),
        finished=torch.tensor([True, False, False]),
        action_mask=torch.tensor([[True, True], [True, True], [True, False]]),
    )
    shared = SharedRewardModel(0, _scorer([[7, 8, 9], [5, 6, 7, 8, 9], [4, 4, 3, 0]]))
    # row 0's last real reward token (9) sits at sequence position 3; row 1's at 4
    assert shared.score_positions(["p"] * 3, ["r"] * 3, generation).tolist() == [3, 4, -1]


def test_score_positions_pool_as_transformers_does_the_rightmost_non_pad_token():
    # The reward's ids end in the pad id (a pad token that is also an ordinary token): transformers'
    # ForSequenceClassification pools the rightmost token that is not the pad id, here position 1.
    generation = Generation(torch.tensor([[5, 6]]), torch.tensor([[True, True]]), torch.tensor([[PAD]]),
                            torch.tensor([[True]]), torch.tensor([False]), torch.tensor([[True]]))
    shared = SharedRewardModel(0, _scorer([[5, 6, PAD]]))
    assert shared.score_positions(["p"], ["r"], generation).tolist() == [1]


def test_known_values_skip_the_component_for_their_rows_and_penalties_still_apply(tmp_path):
    path = tmp_path / "count.py"
    path.write_text(textwrap.dedent("""
        CALLS = []
        def length(prompts, responses):
            CALLS.append(list(responses))
            return [float(len(r)) for r in responses]
    """))
    config = RewardConfig(components=[{"type": "function", "function": f"{path}:length", "weight": 2.0}],
                          missing_eos_penalty=10.0)
    stack = RewardStack(config, torch.device("cpu"))
    result = stack.score(["p"] * 3, ["a", "bbb", "cc"], [True, False, True], [1, 3, 2], known={0: [0.5, None, 4.0]})
    import sys

    module = next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(path))
    assert module.CALLS == [["bbb"]]  # only the row without a known value
    # 2 * 0.5 ; 2 * 3 - 10 (no stop token) ; 2 * 4
    assert result.scores == [1.0, -4.0, 8.0]
    assert result.components["length"] == [0.5, 3.0, 4.0]


# --- on the tiny models ----------------------------------------------------------------------------

def _scalar_reward(tiny_models: Path, tmp_path: Path) -> Path:
    from tests.engine.test_models import _scalar_reward_model

    return _scalar_reward_model(tiny_models, tmp_path / "rm")


def _engine(tiny_models, tmp_path, float32: bool, **extra):
    rm = _scalar_reward(tiny_models, tmp_path)
    sets = {"ppo.rollout_batch_size": 8, "ppo.mini_batch_size": 4, "ppo.micro_batch_size": 4,
            "generation.max_new_tokens": 12, "value.kind": "auto",
            "reward.components": f"[{{type: model, path: '{rm}', batch_size: 3, {extra.pop('reward_extra', '')}}}]",
            **extra}
    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", tiny_overrides(tiny_models, tmp_path, float32, **sets))
    torch.manual_seed(0)
    return load_engine(recipe)


def _rollout_both_ways(engine, monkeypatch):
    """The same rollout (same seed) with one forward and with the two forwards."""
    torch.manual_seed(1)
    one = engine.collect_rollout(PROMPTS)
    monkeypatch.setattr(engine, "options", EngineOptions(shared_reward_forward=False))
    torch.manual_seed(1)
    two = engine.collect_rollout(PROMPTS)
    monkeypatch.setattr(engine, "options", EngineOptions())
    assert torch.equal(one.generation.sequences, two.generation.sequences)
    return one, two


def _assert_same_rewards_and_values(one, two):
    torch.testing.assert_close(one.scores, two.scores, atol=1e-6, rtol=1e-6)
    for name in two.score_components:  # the penalty (missing_eos_penalty: 10) included
        torch.testing.assert_close(torch.tensor(one.score_components[name]), torch.tensor(two.score_components[name]),
                                   atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(one.values, two.values, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(one.fixed_value_features, two.fixed_value_features, atol=1e-6, rtol=1e-6)


def _count_forwards(engine):
    """Calls of the reward model's own forward and of its backbone (which the critic reads too)."""
    model = engine.reward.scorers[0][2].model
    calls = {"reward model": 0, "backbone": 0}
    model.register_forward_hook(lambda *args: calls.__setitem__("reward model", calls["reward model"] + 1))
    model.base_model.register_forward_hook(lambda *args: calls.__setitem__("backbone", calls["backbone"] + 1))
    return calls


@pytest.mark.slow
def test_one_forward_gives_the_rewards_and_values_of_the_two(tiny_models, tmp_path, monkeypatch):
    # float32: the two ways of computing the same numbers are compared to 1e-6 (bf16 would round them apart)
    engine = _engine(tiny_models, tmp_path, float32=True)
    assert engine.shared_reward is not None and engine.actor_critic.value_backbone is engine.shared_reward.scorer.model.base_model
    one, two = _rollout_both_ways(engine, monkeypatch)
    positions = engine.shared_reward.score_positions(PROMPTS, one.responses, one.generation)
    assert (positions >= 0).all()  # every row read from the shared forward
    _assert_same_rewards_and_values(one, two)


@pytest.mark.slow
def test_the_reward_model_runs_once_per_rollout_batch(tiny_models, tmp_path, monkeypatch):
    engine = _engine(tiny_models, tmp_path, float32=False)  # the default mixed precision (auto)
    calls = _count_forwards(engine)
    torch.manual_seed(1)
    engine.collect_rollout(PROMPTS)
    # 8 rows in micro-batches of 4: two backbone forwards, the reward model's own never
    assert calls == {"reward model": 0, "backbone": 2}
    monkeypatch.setattr(engine, "options", EngineOptions(shared_reward_forward=False))
    calls.update({"reward model": 0, "backbone": 0})
    torch.manual_seed(1)
    engine.collect_rollout(PROMPTS)
    # the two forwards: the critic's 2 and the reward's 3 (8 rows in batches of 3), each a backbone forward
    assert calls == {"reward model": 3, "backbone": 5}


@pytest.mark.slow
def test_rows_whose_reward_tokens_differ_are_scored_by_the_reward_model(tiny_models, tmp_path, monkeypatch):
    engine = _engine(tiny_models, tmp_path, float32=True)  # float32: compared to 1e-6, as above
    scorer = engine.shared_reward.scorer
    token_ids = scorer.token_ids
    # rows 2 and 5 as if the reward's tokenizer had split their text differently
    monkeypatch.setattr(scorer, "token_ids", lambda p, r: [ids + [5] if i in (2, 5) else ids
                                                           for i, ids in enumerate(token_ids(p, r))])
    calls = _count_forwards(engine)
    one, two = _rollout_both_ways(engine, monkeypatch)
    _assert_same_rewards_and_values(one, two)
    assert calls["reward model"] == 1 + 3  # one batch for rows 2 and 5; then the two-forward rollout's 3


@pytest.mark.slow
def test_a_reward_that_truncates_every_row_runs_the_two_forwards(tiny_models, tmp_path, monkeypatch):
    """reward max_length 4: the reward model reads 4 tokens of each row, the policy's sequences are
    longer, so no row's tokens match: the critic's forward and the reward model's run as before."""
    engine = _engine(tiny_models, tmp_path, float32=True, reward_extra="max_length: 4")
    calls = _count_forwards(engine)
    one, two = _rollout_both_ways(engine, monkeypatch)
    _assert_same_rewards_and_values(one, two)
    assert calls == {"reward model": 2 * 3, "backbone": 2 * (2 + 3)}


@pytest.mark.slow
def test_a_classifier_reward_keeps_its_own_forward(tiny_models, tmp_path):
    """A frozen critic on a classifier reward (its label map is not the critic's scalar): two forwards."""
    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", tiny_overrides(
        tiny_models, tmp_path, **{"value.kind": "model", "value.init_from": "reward", "value.train_backbone": "false"}))
    engine = load_engine(recipe)
    assert engine.actor_critic.value_features_fixed and engine.shared_reward is None


@pytest.mark.slow
def test_a_training_step_reads_the_shared_forwards_features(tiny_models, tmp_path):
    """The update reuses the features the shared forward computed (no critic forward) and trains."""
    from ppo_cli.train_setup import init_state
    from ppo_cli.trainer import train_step

    engine = _engine(tiny_models, tmp_path, float32=False, **{"ppo.ppo_epochs": 1})
    calls = _count_forwards(engine)
    state = init_state(engine, PROMPTS)
    head_before = engine.actor_critic.value_head.weight.detach().clone()
    train_step(state)
    assert calls == {"reward model": 0, "backbone": 2}  # the rollout's two micro-batches, nothing in the update
    assert not torch.equal(head_before, engine.actor_critic.value_head.weight)
