"""A length floor for the tiny review task: a response shorter than a sentence costs a little per missing token.

The sentiment classifier pays the same +10 for "excellent." as for a whole sentence, so on its own
PPO drifts to 2-5 token answers (the shortest text the classifier is sure about, and an early EOS).
This component closes that shortcut; the classifier stays the reward that says what to write.
"""

import re

MIN_TOKENS = 8  # a short sentence in the tiny tokenizer (about one token per word or punctuation mark)
PER_TOKEN = 1.0  # 4 tokens ("a real delight.") then cost 4 of the classifier's 10

# The tiny tokenizer splits on words and on punctuation, so this count matches its token count
# closely without loading it (the function only sees text).
_TOKEN = re.compile(r"\w+|[^\w\s]")


def too_short(prompts, responses):
    """-PER_TOKEN for each token a response falls short of MIN_TOKENS; 0 from MIN_TOKENS on."""
    return [PER_TOKEN * min(0, len(_TOKEN.findall(r)) - MIN_TOKENS) for r in responses]
