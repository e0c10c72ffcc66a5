"""The env/* metrics of one rollout's episodes (plain numbers: no torch)."""

from __future__ import annotations

from ppo_cli.envs.episode import ENDED_BY


def episode_metrics(episodes: list) -> dict[str, float]:
    """Means over the episodes (EpisodeRecord-like: turns, tool_calls, tool_errors, observation_tokens,
    failed, ended_by) and the fraction ended each way; {} for none."""
    n = len(episodes)
    if not n:
        return {}
    mean = lambda values: sum(values) / n  # noqa: E731
    metrics = {
        "env/turns": mean([e.turns for e in episodes]),
        "env/tool_calls": mean([e.tool_calls for e in episodes]),
        "env/tool_errors": mean([e.tool_errors for e in episodes]),
        "env/failed_rate": mean([float(e.failed) for e in episodes]),
        "env/observation_tokens": mean([e.observation_tokens for e in episodes]),
    }
    for reason in ENDED_BY[:3]:  # failed is env/failed_rate
        metrics[f"env/ended_by/{reason}"] = mean([float(e.ended_by == reason) for e in episodes])
    return metrics
