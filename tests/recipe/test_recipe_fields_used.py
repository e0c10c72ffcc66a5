"""No dead recipe fields: every leaf of the schema is read somewhere in the package, on its own section.

torchtune's PPO recipe declares `whiten_rewards` and never reads it; this test makes that impossible
here. A name alone proves nothing (`path`, `dtype`, `type` are attributes of many things), so a field
counts as read only where `.field` is taken of something that holds its section:

- an attribute named as the section is in its parent: `recipe.ppo.kl_coef`, `cfg.policy.lora.r`;
- a variable bound to such an attribute (`gen = recipe.generation`, `for c in reward.components`),
  or named as the section (`def build(lora, ...)`), or annotated with the section's class
  (`config: RewardConfig`);
- an attribute the module set to such a thing (`self.config = config`, then `self.config.window`);
- the same through `getattr(section, "field")`, or `getattr(section, which)` with `which` a parameter
  whose default is "field".

Reads in recipe.py itself count only through what the package reads: a derived property of the section
(`ppo.kl_in_loss` reads `kl_penalty`); its validators checking a value are not the program using it.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args, get_origin

from pydantic import BaseModel

from ppo_cli.recipe import Recipe

PACKAGE = Path(__file__).resolve().parents[2] / "ppo_cli"
ROOT_NAMES = ("recipe",)  # what the whole Recipe is called where it is passed around


def _models_in(tp) -> list[type[BaseModel]]:
    """The pydantic models a field's type holds (through list, dict, Union, Optional, Annotated)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for arg in get_args(tp) for m in _models_in(arg)] if get_origin(tp) is not None else []


def schema() -> tuple[dict[type, set[str]], list[tuple[str, type, str]]]:
    """(section class -> the names it is reached by, [(dotted path, section class, field)] for each leaf)."""
    names: dict[type, set[str]] = {Recipe: set(ROOT_NAMES)}
    leaves: list[tuple[str, type, str]] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for field, info in model.model_fields.items():
            inner = _models_in(info.annotation)
            if not inner:
                leaves.append((f"{prefix}{field}", model, field))
            for sub in inner:
                first = sub not in names
                names.setdefault(sub, set()).add(field)
                if first:
                    suffix = "[]" if get_origin(info.annotation) is list else ""
                    walk(sub, f"{prefix}{field}{suffix}.")

    walk(Recipe, "")
    return names, leaves


def _annotation_names(node: ast.expr | None) -> set[str]:
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def reads(source: str, names: dict[type, set[str]]) -> set[tuple[type, str]]:
    """(section class, field) for every field ``source`` reads on something that holds that section."""
    tree = ast.parse(source)
    holders: dict[type, set[str]] = {cls: set(n) for cls, n in names.items()}  # variables holding each section
    kept: dict[type, set[str]] = {cls: set() for cls in names}  # attributes set to a section (self.config)
    defaults: dict[str, set[str]] = {}  # parameter -> its string defaults
    for node in ast.walk(tree):
        if isinstance(node, ast.arguments):
            params = [*node.posonlyargs, *node.args][-len(node.defaults):] if node.defaults else []
            for param, default in [*zip(params, node.defaults), *zip(node.kwonlyargs, node.kw_defaults)]:
                if isinstance(default, ast.Constant) and isinstance(default.value, str):
                    defaults.setdefault(param.arg, set()).add(default.value)

    def sections_of(expr: ast.expr) -> list[type]:
        if isinstance(expr, ast.Attribute):
            return [cls for cls, n in names.items() if expr.attr in n or expr.attr in kept[cls]]
        if isinstance(expr, ast.Name):
            return [cls for cls, h in holders.items() if expr.id in h]
        if isinstance(expr, ast.Subscript):  # components[0]
            return sections_of(expr.value)
        if isinstance(expr, ast.BoolOp):  # ref.dtype or pol.dtype
            return [cls for value in expr.values for cls in sections_of(value)]
        if isinstance(expr, ast.IfExp):  # config if config is not None else MonitorConfig()
            return sections_of(expr.body) + sections_of(expr.orelse)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):  # MonitorConfig(): a fresh section
            return [cls for cls in names if cls.__name__ == expr.func.id]
        return []

    # Bindings first (a whole module at once: names are short-lived and reused for the same thing).
    for _ in range(2):  # an alias of an alias
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, (ast.For, ast.comprehension)):
                targets, value = [node.target], node.iter
                if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "enumerate" and value.args:
                    value = value.args[0]
                    targets = [t.elts[1] for t in targets if isinstance(t, ast.Tuple) and len(t.elts) == 2]
            elif isinstance(node, ast.NamedExpr):
                targets, value = [node.target], node.value
            elif isinstance(node, ast.arg):
                wanted = _annotation_names(node.annotation)
                for cls in names:
                    if cls.__name__ in wanted:
                        holders[cls].add(node.arg)
                continue
            else:
                continue
            for cls in sections_of(value):
                holders[cls].update(t.id for t in targets if isinstance(t, ast.Name))
                kept[cls].update(t.attr for t in targets if isinstance(t, ast.Attribute))

    found: set[tuple[type, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            found.update((cls, node.attr) for cls in sections_of(node.value))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr" and len(node.args) >= 2:
            name = node.args[1]
            fields = ({name.value} if isinstance(name, ast.Constant) else
                      defaults.get(name.id, set()) if isinstance(name, ast.Name) else set())
            found.update((cls, field) for cls in sections_of(node.args[0]) for field in fields)
    return found


def derived_reads(names: dict[type, set[str]]) -> dict[tuple[type, str], set[str]]:
    """(section class, property or method) -> the section's own fields it reads (``self.field``), from recipe.py."""
    by_name = {cls.__name__: cls for cls in names}
    tree = ast.parse((PACKAGE / "recipe.py").read_text(encoding="utf-8"))
    derived: dict[tuple[type, str], set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in by_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    derived[(by_name[node.name], item.name)] = {
                        n.attr for n in ast.walk(item)
                        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return derived


def read_fields(sources: list[str], names: dict[type, set[str]]) -> set[tuple[type, str]]:
    """reads() over every source, plus the fields behind each derived property read there."""
    found = set().union(*(reads(source, names) for source in sources))
    derived = derived_reads(names)
    while True:
        more = {(cls, field) for (cls, prop), fields in derived.items() if (cls, prop) in found for field in fields}
        if more <= found:
            return found
        found |= more


def test_schema_walk_reaches_every_section_and_names_leaves_by_path():
    names, leaves = schema()
    paths = {path for path, _, _ in leaves}
    assert {"ppo.kl_coef", "policy.lora.r", "ppo.adaptive_kl.horizon", "train.total_updates",
            "reward.components[].labels", "reward.components[].function"} <= paths
    assert names[next(cls for cls in names if cls.__name__ == "LoraConfig")] == {"lora"}


def test_a_field_counts_only_when_read_on_its_own_section():
    names, _ = schema()
    by_name = {cls.__name__: cls for cls in names}
    ppo, policy, lora = by_name["PPOConfig"], by_name["PolicyConfig"], by_name["LoraConfig"]
    assert (ppo, "kl_coef") in reads("x = recipe.ppo.kl_coef", names)
    assert (ppo, "kl_coef") not in reads("x = other.kl_coef", names)
    assert (policy, "path") not in reads("p = component.path", names)  # a reward's path is not the policy's
    assert (policy, "path") in reads("pol = recipe.policy\np = pol.path", names)
    assert (lora, "r") in reads("def f(config: 'LoraConfig | None'):\n    return config.r", names)
    assert (ppo, "gamma") in reads("getattr(recipe.ppo, 'gamma')", names)
    assert (ppo, "gamma") in reads("def f(ppo, which='gamma'):\n    return getattr(ppo, which)", names)
    assert (lora, "r") in reads("class A:\n    def __init__(self, lora):\n        self.c = lora\n"
                                "    def f(self):\n        return self.c.r", names)
    assert (ppo, "kl_penalty") in read_fields(["if recipe.ppo.kl_in_loss: pass"], names)
    assert (ppo, "kl_penalty") not in read_fields(["x = recipe.ppo.gamma"], names)


def test_every_recipe_field_is_read_on_its_section_outside_recipe_py():
    names, leaves = schema()
    sources = [path.read_text(encoding="utf-8") for path in PACKAGE.rglob("*.py") if path.name != "recipe.py"]
    found = read_fields(sources, names)
    unread = [path for path, cls, field in leaves if (cls, field) not in found]
    assert not unread, "recipe fields never read by the package: " + ", ".join(unread)
