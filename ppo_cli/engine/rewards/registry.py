"""The reward types: a component's ``type`` -> the module that owns it.

Each module holds everything its type means beyond the schema (recipe.py):

- ``Scorer``: built as ``Scorer(component, device, system_prompt)`` when the engine loads, called as
  ``scorer(prompts, responses) -> list[float | None]`` or awaited as ``scorer.ascore(prompts,
  responses, columns)``; ``reads_columns`` if it wants the rows' other columns, ``failure`` (its
  latest failure, one line) if it can fail;
- ``check(component, contact_servers, import_functions)``: its files, credentials and servers, before
  any model loads (`ppo validate`, train's preflight; rewards/checks.py);
- ``display_name(component)``: its name in the metrics, logs and summary;
- optionally ``check_columns(component, rows, given, import_functions)``: the dataset columns it takes by
  name, against the prompts' rows, before any model loads (rewards/checks.py).

Importing this registry imports no torch: the type modules load their models only when a scorer is built.
"""

from __future__ import annotations

from ppo_cli.engine.rewards import function, http, judge, model

REWARD_TYPES = {
    "model": model,
    "classifier": model,
    "function": function,
    "http": http,
    "judge": judge,
}
