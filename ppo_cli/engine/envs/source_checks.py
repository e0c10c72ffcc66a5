"""`ppo validate`'s checks of a recipe's tools and environment class, from their files' source (read with
``ast``, not run, as for reward functions): what loading them at train would refuse (engine/envs/tools.py,
environments.py), said before a model loads. What the source cannot say (a decorated function, a class
with bases, a name imported from elsewhere) is left to train, which imports the code and checks it.

The tool rules are transformers' ``get_json_schema``'s: a docstring, a type hint on every argument, and
a description of every argument in the docstring's ``Args:`` section.
"""

from __future__ import annotations

import ast
import re

from ppo_cli.errors import EnvironmentSetupError

SCHEMA_HINT = "give every argument a type hint and a Google-style docstring with an Args: section"


def check_tool_source(spec: str, node: ast.stmt | None) -> None:
    """One line for a tool whose source shows it cannot be one: not a function, or no JSON schema."""
    if node is None or isinstance(node, (ast.Import, ast.ImportFrom)):
        return
    if isinstance(node, ast.ClassDef) or (isinstance(node, (ast.Assign, ast.AnnAssign))
                                         and isinstance(node.value, ast.Constant)):
        raise EnvironmentSetupError(f"tool '{spec}' is not a function", hint="name a def or async def")
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
        return
    problem = _schema_problem(node)
    if problem is not None:
        raise EnvironmentSetupError(f"tool '{spec}' has no JSON schema: {problem}", hint=SCHEMA_HINT)


def check_environment_class_source(spec: str, node: ast.stmt | None) -> None:
    """One line for an environment class whose source shows no reset or step (a class without bases)."""
    if node is None or isinstance(node, (ast.Import, ast.ImportFrom)):
        return
    if isinstance(node, ast.ClassDef):
        if any(not (isinstance(b, ast.Name) and b.id == "object") for b in node.bases) or node.decorator_list:
            return  # they may come from a base class
        methods = {item.name for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if {"reset", "step"} <= methods:
            return
    elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return  # an assignment: what it holds shows when it is imported
    raise EnvironmentSetupError(f"environment class '{spec}' is not a class with reset and step",
                                hint="def reset(self, row, seed) and def step(self, message)")


def _schema_problem(function: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """get_json_schema's refusal of this function, in its words; None where it would build a schema."""
    name = function.name
    docstring = ast.get_docstring(function)
    if not docstring:
        return f"Cannot generate JSON schema for {name} because it has no docstring!"
    args = function.args
    arguments = [a for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
    for argument in arguments:
        if argument.annotation is None:
            return f"Argument {argument.arg} is missing a type hint in function {name}"
    described = _described_arguments(docstring)
    for argument in arguments:
        if argument.arg not in described:
            return (f"Cannot generate JSON schema for {name} because the docstring has no description for the "
                    f"argument '{argument.arg}'")
    return None


def _described_arguments(docstring: str) -> set[str]:
    """The names the docstring's Args: section describes ('name: ...' or 'name (type): ...')."""
    match = re.search(r"^\s*Args:\s*$(.*?)(?=^\s*(?:Returns?|Raises?|Yields?|Examples?|Notes?):\s*$|\Z)",
                      docstring, re.MULTILINE | re.DOTALL)
    if match is None:
        return set()
    return set(re.findall(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:", match.group(1), re.MULTILINE))

