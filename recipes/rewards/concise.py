"""A reward for short, finished answers: what recipes/smollm2_concise.yaml teaches SmolLM2.

SmolLM2-135M-Instruct answers a question in a paragraph or more: at temperature 0.7 about one answer
in five ends (its EOS, <|im_end|>) within 96 tokens, after 50-95 tokens, and none within 48. A reward
that pays only a one-sentence answer therefore sees nothing to reinforce for many updates. This one is
graded by length so that every update has a gradient: full marks for 3 to 25 words (a sentence or
two), then 1/50 less for every word past 25, reaching 0 at 75 words (about what 96 tokens hold), and
-1 for fewer than 3 words so that saying nothing never wins. The recipe's missing_eos_penalty takes 1
more off an answer cut off at generation.max_new_tokens, so a finished answer of 60 words (0.3)
already beats a cut-off one (about -0.9), and each shorter finished answer beats a longer one.
Words are whitespace-separated pieces of the decoded answer, so markdown and lists count as written.
"""

MIN_WORDS, FULL_MARKS_UP_TO, ZERO_AT = 3, 25, 75


def concise(prompts, responses):
    out = []
    for response in responses:
        words = len(response.split())
        if words < MIN_WORDS:
            out.append(-1.0)
        else:
            out.append(1.0 - max(0, words - FULL_MARKS_UP_TO) / (ZERO_AT - FULL_MARKS_UP_TO))
    return out
