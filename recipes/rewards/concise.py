"""A reward for short, finished answers: what recipes/smollm2_concise.yaml teaches SmolLM2.

SmolLM2-135M-Instruct answers a question in several paragraphs; this pays an answer of 3 to 20 words
in full, less for every word past 20 (nothing at 40, negative beyond), and -1 for fewer than 3 words
so that saying nothing never wins. The recipe's missing_eos_penalty takes more off an answer cut
off at generation.max_new_tokens, so the policy learns to finish, not only to be brief.
"""

MIN_WORDS, FULL_MARKS_UP_TO, ZERO_AT = 3, 20, 40


def concise(prompts, responses):
    out = []
    for response in responses:
        words = len(response.split())
        if words < MIN_WORDS:
            out.append(-1.0)
        else:
            out.append(1.0 - max(0, words - FULL_MARKS_UP_TO) / (ZERO_AT - FULL_MARKS_UP_TO))
    return out
