"""Hermes tool calls parsed from the assistant's text; malformed ones are records, never exceptions."""

from __future__ import annotations

import pytest

from ppo_cli.engine.envs.tool_calls import (
    ToolCall,
    describe_tools,
    parse_tool_calls,
    resolve_tool_call_format,
    template_renders_tools,
    text_before_calls,
)
from ppo_cli.errors import EnvironmentSetupError


def test_parse_tool_calls_reads_several_calls_in_order():
    text = ('Let me compute. <tool_call>{"name": "calculate", "arguments": {"expression": "1 + 2"}}</tool_call>\n'
            '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("calculate", {"expression": "1 + 2"}), ToolCall("search", {})]
    assert text_before_calls(text) == "Let me compute."


def test_a_call_without_arguments_gets_an_empty_object():
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>') == [ToolCall("now", {})]


@pytest.mark.parametrize("text, error", [
    ('<tool_call>{"name": "calculate", "arguments": {"expression": }</tool_call>',
     "malformed tool call: not JSON (Expecting value at character 50)"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'malformed tool call: expected {"name": "...", "arguments": {...}}'),
    ('<tool_call>["calculate"]</tool_call>', 'malformed tool call: expected {"name": "...", "arguments": {...}}'),
    ('<tool_call>{"name": "calculate", "arguments": {}}', "malformed tool call: no </tool_call> after <tool_call>"),
])
def test_malformed_calls_are_records_with_the_reason(text, error):
    assert parse_tool_calls(text) == [ToolCall(None, None, error)]


def test_text_without_a_call_has_none():
    assert parse_tool_calls("The answer is 84.") == []


def test_auto_is_hermes_for_chatml_and_refuses_a_template_with_a_format_of_its_own(chatml):
    assert resolve_tool_call_format(chatml, "auto") == "hermes"
    own = chatml.__class__(tokenizer_object=chatml.backend_tokenizer, eos_token="<|im_end|>")
    own.chat_template = "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls|tojson }}{% endif %}{% endfor %}"
    with pytest.raises(EnvironmentSetupError, match="writes tool calls in a format of its own") as info:
        resolve_tool_call_format(own, "auto")
    assert info.value.hint == "set environment.tool_call_format: hermes (the tools are then offered, and read, in hermes form)"
    assert resolve_tool_call_format(own, "hermes") == "hermes"


def test_describe_tools_lists_each_schema_in_hermes_form(chatml):
    schema = {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {}}}
    text = describe_tools([schema])
    assert '<tools>\n{"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {}}}\n</tools>' in text
    assert text.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    assert template_renders_tools(chatml) is False  # SmolLM2's ChatML: the tools go in the system message
