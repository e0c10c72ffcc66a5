"""A python environment (`environment.type: python`): a simulated user who asks a follow-up.

The user asks the prompt's question; after the assistant's first answer this user asks to have it
again in five words or fewer (one of three phrasings, chosen by the reset seed, so a prompt's group of
episodes all hear the same one); after the second answer the episode is done. Steps give no reward:
recipes/rewards/follow_up.py scores whether the last answer honoured the request. What
recipes/smollm2_follow_up.yaml teaches SmolLM2-135M-Instruct: before training, 5 of its 24 held-out
episodes end with an answer of 5 words or fewer (most never hear the follow-up: the first answer runs
past 40 tokens); after 12 updates, 16 of 24.
"""

from __future__ import annotations

REQUESTS = (
    "Now say that in five words or fewer.",
    "Shorter, please: five words at most.",
    "Sum that up in five words or fewer.",
)


class FollowUp:
    def __init__(self):
        self.request = REQUESTS[0]
        self.answers = 0

    def reset(self, row: dict, seed: int) -> None:
        self.request = REQUESTS[seed % len(REQUESTS)]
        self.answers = 0
        return None  # the prompt's question is the first user message

    def step(self, message: dict) -> dict:
        self.answers += 1
        if self.answers == 1:
            return {"observation": self.request, "reward": 0.0, "done": False}
        return {"observation": None, "reward": 0.0, "done": True}
