"""verl's per-row reward function, called by ppo's batched one: the pattern for a compute_score brought from verl.

verl calls ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` once per response;
ppo calls a reward function once per batch, ``f(prompts, responses, **columns) -> list``, each of the
rows' other columns a list aligned with the responses. ``verl_score`` is that batched function for a
verl-shaped dataset (the parquet files verl's examples/data_preprocess scripts write): ``reward_model``
is a {style, ground_truth} struct and ``extra_info`` a struct, each arriving as one dict per row, and
``data_source`` a string. Point the recipe at it::

    reward:
      components:
        - {type: function, function: "recipes/rewards/verl_compute_score.py:verl_score"}

and put your own function in place of ``compute_score`` (``from my_rewards import compute_score``).
The one here is GSM8K's: the last number of the response against the row's ground truth.
"""

import re
from decimal import Decimal, InvalidOperation

# A number as GSM8K's answers write them: a sign, thousands commas, a decimal part ("-1,234.50").
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """verl's signature, per row: 1.0 when the last number of ``solution_str`` equals ``ground_truth``
    (as numbers: "1,000" and "1000.0" match "1000"), else 0.0 (none there, or another)."""
    found = NUMBER.findall(solution_str)
    truth = _number(str(ground_truth))
    return 1.0 if found and truth is not None and _number(found[-1]) == truth else 0.0


def verl_score(prompts, responses, reward_model, data_source=None, extra_info=None) -> list[float]:
    """ppo's batched signature: ``compute_score`` once per response, with its row's values. A row without
    a ground truth gets None, ppo's "this reward does not apply here"."""
    rows = zip(data_source or [None] * len(responses), responses, reward_model, extra_info or [None] * len(responses))
    return [compute_score(source, response, model["ground_truth"], info) if model and model.get("ground_truth") is not None
            else None for source, response, model, info in rows]


def _number(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", ""))
    except InvalidOperation:
        return None
