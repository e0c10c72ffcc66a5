"""Tool calls in the assistant's text, in the hermes format (Qwen2.5/3, Hermes, many tool-tuned models):

    <tool_call>{"name": "calculate", "arguments": {"expression": "12 * 7"}}</tool_call>

Several per message. A call whose JSON does not parse, is not an object, or lacks a string ``name``
is a malformed call: it is answered with an error message (and counted), never raised. An opening
tag without its closing tag is malformed too (the text to the end is its body).

``tool_call_format: auto`` is the chat template's own format: hermes when the template writes
``<tool_call>`` or has no tool format at all (then the tools are described in the system message,
``describe_tools``). A template with a tool format of its own (Llama 3.1's JSON, Mistral's
[TOOL_CALLS]) is refused in one line: it is not parsed here, and the model would be told one format
and be read in another.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ppo_cli.errors import EnvironmentSetupError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str | None  # None: malformed
    arguments: Any  # the parsed "arguments" ({} when absent); None when malformed
    error: str | None = None  # why the call is malformed (what the model reads), None for a well-formed call

    def as_message_call(self) -> dict:
        """The OpenAI/transformers shape of a well-formed call, for the transcript's ``tool_calls``."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every ``<tool_call>...</tool_call>`` in ``text``, in order, well-formed or not."""
    return [_parse_one(match.group(1), closed=match.group(0).endswith(CLOSE)) for match in _CALL.finditer(text)]


def _parse_one(body: str, closed: bool) -> ToolCall:
    if not closed:
        return ToolCall(None, None, f"malformed tool call: no {CLOSE} after {OPEN}")
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall(None, None, f"malformed tool call: not JSON ({err.msg} at character {err.pos})")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
        return ToolCall(None, None, 'malformed tool call: expected {"name": "...", "arguments": {...}}')
    return ToolCall(call["name"], call.get("arguments", {}))


def text_before_calls(text: str) -> str:
    """The assistant's words before its first tool call (its "content" beside ``tool_calls``)."""
    return text.split(OPEN, 1)[0].strip()


def describe_tools(schemas: list[dict]) -> str:
    """A system-message paragraph offering the tools in hermes form, for templates that do not render
    ``tools`` themselves (Qwen2.5's wording)."""
    listed = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            f'within {OPEN}{CLOSE} XML tags:\n{OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def template_renders_tools(tokenizer) -> bool:
    """Does the chat template take ``tools`` (it then shows their schemas to the model itself)?"""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def resolve_tool_call_format(tokenizer, tool_call_format: str) -> str:
    """'hermes' (the only format parsed), or one line when ``auto`` meets a template of another format."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if tool_call_format == "hermes" or OPEN in template or "tool_call" not in template:
        return "hermes"
    raise EnvironmentSetupError(
        f"the chat template of '{tokenizer.name_or_path}' writes tool calls in a format of its own, not hermes "
        f"({OPEN}...{CLOSE}), the only one read",
        hint="set environment.tool_call_format: hermes (the tools are then offered, and read, in hermes form)",
    )
