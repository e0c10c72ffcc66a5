"""A reward for honouring a simulated user's follow-up: "say that in five words or fewer".

Used with recipes/envs/follow_up.py (recipes/smollm2_follow_up.yaml). ``messages`` is each episode's
transcript after the prompt; ``responses`` its last assistant message. An episode whose first answer
was cut at generation.max_new_tokens never heard the follow-up (one assistant message): 0, and the
recipe's missing_eos_penalty takes 1 more off. Otherwise the last answer is graded by its words
(whitespace-separated pieces): 1 for 1 to 5 words (the request honoured: a success), then 1/15 less
for every word past 5, reaching 0 at 20 words, so that shorter is always better and every group has
a gradient; an empty answer gets -1, so that saying nothing never wins.
"""

MAX_WORDS, ZERO_AT = 5, 20


def follow_up_score(messages: list[dict], response: str) -> float:
    """One episode: its transcript after the prompt and its last assistant message -> reward."""
    if sum(m["role"] == "assistant" for m in messages) < 2:
        return 0.0
    words = len(response.split())
    if words == 0:
        return -1.0
    return max(0.0, 1.0 - max(0, words - MAX_WORDS) / (ZERO_AT - MAX_WORDS))


def follow_up(prompts, responses, messages, **kwargs):
    return [follow_up_score(m, r) for m, r in zip(messages, responses)]
