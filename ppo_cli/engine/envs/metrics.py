"""The env/* metrics of one rollout's episodes (plain numbers: no torch)."""

from __future__ import annotations

from ppo_cli import metric_names as names
from ppo_cli.engine.envs.episode import ENDED_BY


def episode_metrics(episodes: list) -> dict[str, float]:
    """Means over the episodes (EpisodeRecord-like: turns, tool_calls, tool_errors, observation_tokens,
    failed, ended_by) and the fraction ended each way; {} for none."""
    n = len(episodes)
    if not n:
        return {}
    mean = lambda values: sum(values) / n  # noqa: E731
    metrics = {
        names.ENV_TURNS: mean([e.turns for e in episodes]),
        names.ENV_TOOL_CALLS: mean([e.tool_calls for e in episodes]),
        names.ENV_TOOL_ERRORS: mean([e.tool_errors for e in episodes]),
        names.ENV_FAILED_RATE: mean([float(e.failed) for e in episodes]),
        names.ENV_OBSERVATION_TOKENS: mean([e.observation_tokens for e in episodes]),
    }
    for reason in ENDED_BY[:-1]:  # failed is env/failed_rate
        metrics[names.env_ended_by(reason)] = mean([float(e.ended_by == reason) for e in episodes])
    return metrics
