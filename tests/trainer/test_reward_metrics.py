"""reward/NAME and reward/failed_rate/NAME when a function's None means "does not apply" (TRL's nansum)."""

import pytest
import torch

from ppo_cli.train_metrics import ScoredEpisodes, reward_component_metrics
from tests.trainer.test_filter_groups import OneProcess


def test_a_none_another_component_covered_is_not_counted_as_failed():
    # 4 episodes: `partial` skips 0 and 2; `always` scores 0-2 and fails on 3, which nothing else scored
    episodes = ScoredEpisodes(
        scores=torch.tensor([1.0, 6.0, 1.0, 0.0]),
        score_components={"partial": [None, 5.0, None, None], "always": [1.0, 1.0, 1.0, None]},
        scored=torch.tensor([True, True, True, False]),
        reward_failures={"partial": "fn returned None for 3 of 4", "always": "fn returned None for 1 of 4"})
    metrics = reward_component_metrics(episodes, OneProcess())
    assert metrics["reward/partial"] == 5.0 and metrics["reward/always"] == 1.0  # means over what each scored
    assert metrics["reward/failed_rate/partial"] == pytest.approx(0.25)  # only episode 3 went without any reward
    assert metrics["reward/failed_rate/always"] == pytest.approx(0.25)
    assert metrics["reward/failed_rate"] == pytest.approx(0.25)
    every_episode_scored = episodes._replace(scored=None, score_components={"partial": [None, 5.0, None, 2.0],
                                                                           "always": [1.0] * 4})
    assert reward_component_metrics(every_episode_scored, OneProcess())["reward/failed_rate/partial"] == 0.0
