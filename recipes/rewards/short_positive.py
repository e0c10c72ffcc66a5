"""A hand-written reward for the tiny review task: positive words pay, negative words cost.

Used by recipes/tiny_function_reward.yaml as `function: recipes/rewards/short_positive.py:reward`,
to show that a plain Python function trains as well as a reward model.
"""

import re

POSITIVE = {"great", "wonderful", "excellent", "amazing", "fantastic", "good", "love", "loved", "enjoyed",
            "beautiful", "brilliant", "perfect", "delightful", "superb", "recommend", "best", "solid"}
NEGATIVE = {"bad", "terrible", "awful", "boring", "poor", "worst", "hate", "hated", "disappointing",
            "broken", "slow", "waste", "dull", "mediocre", "annoying", "cheap", "flimsy"}


def reward(prompts, responses):
    """+10 for a response with more positive than negative words, -1 for the reverse, 0.1 otherwise."""
    out = []
    for response in responses:
        words = re.findall(r"[a-z']+", response.lower())
        balance = sum(w in POSITIVE for w in words) - sum(w in NEGATIVE for w in words)
        out.append(10.0 if balance > 0 else (-1.0 if balance < 0 else 0.1))
    return out
