"""Tools the policy may call: Python functions named 'path/to/file.py:function', with a deadline.

A tool is a ``def`` or ``async def`` with type hints and a Google-style docstring; its JSON schema (what
the chat template shows the model) is transformers' ``get_json_schema``, the one TRL's ``tools=`` uses.
Calling a tool never raises: an unknown name, arguments its signature does not take, a raise inside
it or a call past ``timeout_s`` each become an ``error: ...`` text the model reads as the tool's
answer, marked ``error=True`` so it is counted (env/tool_errors).
"""

from __future__ import annotations

import asyncio
import inspect
import json
from dataclasses import dataclass
from typing import Any, Callable

from ppo_cli.engine.envs.calls import call_bounded
from ppo_cli.engine.user_code import import_named
from ppo_cli.errors import EnvironmentSetupError

QUOTED_ERROR = 200  # characters of a tool's exception message shown to the model


@dataclass(frozen=True)
class Tool:
    name: str
    function: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}


@dataclass(frozen=True)
class ToolAnswer:
    content: str  # what the model reads in the tool message
    error: bool  # True: an error text (counted), not the tool's own answer


def load_tool(spec: str) -> Tool:
    """Import ``spec`` and read its schema; one line naming the fix when it cannot be a tool."""
    from transformers.utils import get_json_schema
    from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

    function = import_named(spec, "tool", EnvironmentSetupError)
    if not callable(function) or inspect.isclass(function):
        raise EnvironmentSetupError(f"tool '{spec}' is not a function", hint="name a def or async def")
    try:
        schema = get_json_schema(function)
    except (DocstringParsingException, TypeHintParsingException) as err:
        raise EnvironmentSetupError(
            f"tool '{spec}' has no JSON schema: {err}",
            hint="give every argument a type hint and a Google-style docstring with an Args: section",
        ) from None
    return Tool(schema["function"]["name"], function, schema)


def load_tools(specs: list[str]) -> dict[str, Tool]:
    """name -> Tool for each spec; two tools of one name are refused (the model could not tell them apart)."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec)
        if tool.name in tools:
            raise EnvironmentSetupError(f"two tools are named '{tool.name}'", hint="rename one of the functions")
        tools[tool.name] = tool
    return tools


def tool_schemas(tools: dict[str, Tool]) -> list[dict]:
    """What apply_chat_template(tools=...) takes."""
    return [tool.schema for tool in tools.values()]


def answer_text(value: Any) -> str:
    """A tool's return value as the text the model reads: a string as is, anything else as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(value)


async def call_tool(tools: dict[str, Tool], name: str, arguments: Any, timeout_s: float) -> ToolAnswer:
    """The answer to one call of ``name`` with ``arguments`` (a dict), never an exception."""
    tool = tools.get(name)
    if tool is None:
        return ToolAnswer(f"error: unknown tool '{name}'; the tools are: {', '.join(sorted(tools))}", True)
    if not isinstance(arguments, dict):
        return ToolAnswer(f"error: the arguments of tool '{name}' must be a JSON object, got {type(arguments).__name__}", True)
    try:
        inspect.signature(tool.function).bind(**arguments)
    except TypeError as err:
        return ToolAnswer(f"error: wrong arguments for tool '{name}': {err}", True)
    try:
        value = await call_bounded(tool.function, timeout_s=timeout_s, **arguments)
    except asyncio.TimeoutError:
        return ToolAnswer(f"error: tool '{name}' did not answer within {timeout_s:g} s", True)
    except Exception as err:  # the tool's own failure: the model reads it and may try again
        message = " ".join(str(err).split())[:QUOTED_ERROR]
        return ToolAnswer(f"error: tool '{name}' raised {type(err).__name__}: {message}".rstrip(": "), True)
    return ToolAnswer(answer_text(value), False)
