"""Example Python rewards: any callable ``name(prompts, responses) -> list[float]`` works.

Name one in a recipe as ``{type: function, function: "ppo_cli.examples.rewards:positive_words"}``.
"""

from __future__ import annotations

import re

POSITIVE = frozenset(
    "great wonderful excellent amazing fantastic good love loved enjoyed beautiful brilliant perfect "
    "delightful superb recommend happy best solid pleasant".split()
)
NEGATIVE = frozenset(
    "bad terrible awful boring poor worst hate hated disappointing broken slow waste dull mediocre "
    "annoying cheap flimsy".split()
)
_WORD = re.compile(r"[a-z']+")


def positive_words(prompts: list[str], responses: list[str]) -> list[float]:
    """Positive words minus negative words in each response (prompts are ignored)."""
    scores = []
    for response in responses:
        words = _WORD.findall(response.lower())
        scores.append(float(sum(w in POSITIVE for w in words) - sum(w in NEGATIVE for w in words)))
    return scores
