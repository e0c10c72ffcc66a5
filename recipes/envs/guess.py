"""A python environment (`environment.type: python`): guess the number, told higher or lower each turn.

The episode's number comes from the reset seed, so the episodes of one prompt's group all chase the same
number (GRPO compares them on equal terms). Step reward: 1 for the right number, else 0; the episode
ends when the number is found (done) or at environment.max_turns.
"""

from __future__ import annotations

import random
import re


class GuessNumber:
    def __init__(self, low: int = 1, high: int = 10):
        self.low, self.high = low, high
        self.number = low

    def reset(self, row: dict, seed: int) -> str:
        self.number = random.Random(seed).randint(self.low, self.high)
        return f"I am thinking of a number from {self.low} to {self.high}. Answer with one number."

    def step(self, message: dict) -> dict:
        numbers = re.findall(r"-?\d+", message["content"])
        if not numbers:
            return {"observation": "Answer with one number.", "reward": 0.0, "done": False}
        guess = int(numbers[-1])
        if guess == self.number:
            return {"observation": "Correct!", "reward": 1.0, "done": True}
        return {"observation": "Higher." if guess < self.number else "Lower.", "reward": 0.0, "done": False}

    def close(self) -> None:
        pass
