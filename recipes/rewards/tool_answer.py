"""A verifiable reward for tool-using episodes: 1 when the final answer is the row's `answer`, else 0.

Used by recipes/tiny_tools.yaml as `function: recipes/rewards/tool_answer.py:correct`. In a multi-turn
episode `responses` are the assistant's last messages; the row's `answer` column
(recipes/data/tiny_tools.jsonl) arrives as a keyword list aligned with them, as TRL passes columns.
The final answer is the last integer of the response outside its tool calls: the numbers inside
`<tool_call>...</tool_call>` are the question's, not an answer (an episode cut off by max_turns ends
on a call). No math-verify: two-number integer arithmetic needs none.
"""

from __future__ import annotations

import re

_CALLS = re.compile(r"<tool_call>.*?(?:</tool_call>|\Z)", re.DOTALL)
_INTEGER = re.compile(r"-?\d+")


def final_integer(response: str) -> str | None:
    """The last integer of ``response`` outside its tool calls, as written ('-8', '85'); None if none."""
    numbers = _INTEGER.findall(_CALLS.sub(" ", response))
    return numbers[-1] if numbers else None


def correct(prompts, responses, answer, **kwargs) -> list[float | None]:
    """Per response: 1.0 when its final integer equals the row's answer (as integers), else 0.0; None
    (not scored, counted as a failed reward) when its row has no answer."""
    out = []
    for response, reference in zip(responses, answer):
        if reference is None:
            out.append(None)
            continue
        guess = final_integer(response)
        out.append(1.0 if guess is not None and int(guess) == int(str(reference).strip()) else 0.0)
    return out
