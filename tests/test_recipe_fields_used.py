"""No dead recipe fields: every key of the schema is read somewhere in the package.

torchtune's PPO recipe declares `whiten_rewards` and never reads it; this test makes that impossible
here. A field counts as read when `.name` (attribute access) or a quoted 'name' appears in
ppo_cli/**/*.py outside recipe.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args, get_origin

from pydantic import BaseModel

from ppo_cli.recipe import Recipe

PACKAGE = Path(__file__).resolve().parents[1] / "ppo_cli"


def _models(tp, seen: set) -> None:
    """Collect every pydantic model reachable from a type (through lists, unions, Optional, Annotated)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        if tp in seen:
            return
        seen.add(tp)
        for field in tp.model_fields.values():
            _models(field.annotation, seen)
    elif get_origin(tp) is not None:
        for arg in get_args(tp):
            _models(arg, seen)


def schema_fields() -> dict[str, set[str]]:
    seen: set = set()
    _models(Recipe, seen)
    fields: dict[str, set[str]] = {}
    for model in seen:
        for name in model.model_fields:
            fields.setdefault(name, set()).add(model.__name__)
    return fields


def test_schema_walk_reaches_every_section():
    fields = schema_fields()
    assert {"kl_coef", "labels", "function", "target_modules", "horizon", "total_updates"} <= set(fields)


def test_every_recipe_field_is_read_outside_recipe_py():
    sources = "\n".join(
        path.read_text(encoding="utf-8") for path in PACKAGE.rglob("*.py") if path.name != "recipe.py"
    )
    unread = sorted(
        f"{name} ({', '.join(sorted(models))})"
        for name, models in schema_fields().items()
        if not re.search(rf"\.{name}\b|['\"]{name}['\"]", sources)
    )
    assert not unread, "recipe fields never read by the package: " + "; ".join(unread)
