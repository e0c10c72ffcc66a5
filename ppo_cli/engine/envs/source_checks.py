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


def check_environment_class_source(spec: str, node: ast.stmt | None, kwargs: dict | None = None) -> None:
    """One line for an environment class whose source (a class without bases) shows no reset or step, or
    an __init__ that environment.kwargs does not fit."""
    if node is None or isinstance(node, (ast.Import, ast.ImportFrom)):
        return
    if isinstance(node, ast.ClassDef):
        if any(not (isinstance(b, ast.Name) and b.id == "object") for b in node.bases) or node.decorator_list:
            return  # they may come from a base class
        methods = {item.name: item for item in node.body if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if {"reset", "step"} <= set(methods):
            _check_init_takes(spec, methods.get("__init__"), kwargs or {})
            return
    elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return  # an assignment: what it holds shows when it is imported
    raise EnvironmentSetupError(f"environment class '{spec}' is not a class with reset and step",
                                hint="def reset(self, row, seed) and def step(self, message)")


def _check_init_takes(spec: str, init: ast.FunctionDef | None, kwargs: dict) -> None:
    """environment.kwargs against the class's own __init__ (none: it takes no arguments)."""
    if init is not None and (init.args.kwarg is not None or init.decorator_list):
        return
    args = init.args if init is not None else None
    positional = (args.posonlyargs + args.args)[1:] if args is not None else []  # past self
    takes = [a.arg for a in positional + (args.kwonlyargs if args is not None else [])]
    unknown = sorted(set(kwargs) - set(takes))
    if unknown:
        said = f"takes: {', '.join(takes)}" if takes else "takes no arguments"
        raise EnvironmentSetupError(
            f"environment.kwargs gives {', '.join(unknown)}, which environment class '{spec}' does not take (its __init__ {said})",
            hint="give environment.kwargs only the arguments its __init__ takes")
    if args is None:
        return
    required = [a.arg for a in positional[:len(positional) - len(args.defaults)]]
    required += [a.arg for a, default in zip(args.kwonlyargs, args.kw_defaults) if default is None]
    missing = [name for name in required if name not in kwargs]
    if missing:
        raise EnvironmentSetupError(
            f"environment class '{spec}' needs {', '.join(missing)} in environment.kwargs (its __init__ has no default for "
            f"{'it' if len(missing) == 1 else 'them'})", hint=f"set environment.kwargs: {{{missing[0]}: ...}}")


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

