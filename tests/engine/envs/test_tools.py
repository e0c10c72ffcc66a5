"""Tools: schema from hints + docstring (transformers' get_json_schema), and calls that never raise."""

from __future__ import annotations

import asyncio
import time

import pytest

from ppo_cli.engine.user_code import import_named
from ppo_cli.engine.envs.tools import call_tool, load_tool, load_tools
from ppo_cli.errors import EnvironmentSetupError

CALCULATOR = "recipes/tools/calculator.py:calculate"

TOOLS_FILE = '''
import asyncio, time

def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"

async def aslow(seconds: float) -> str:
    """Sleep without blocking.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "woke"

async def add(a: int, b: int) -> dict:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return {"sum": a + b}

def undocumented(x: int) -> int:
    return x
'''


@pytest.fixture()
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS_FILE)
    return str(path)


def run(coroutine):
    return asyncio.run(coroutine)


def test_load_tool_reads_the_schema_from_hints_and_docstring():
    tool = load_tool(CALCULATOR)
    assert tool.name == "calculate"
    function = tool.schema["function"]
    assert function["description"] == "Compute one arithmetic operation on two numbers."
    assert function["parameters"]["properties"]["expression"]["type"] == "string"
    assert function["parameters"]["required"] == ["expression"]


def test_load_tool_refuses_a_function_without_docstring_in_one_line(tools_file):
    with pytest.raises(EnvironmentSetupError) as info:
        load_tool(f"{tools_file}:undocumented")
    assert info.value.message == f"tool '{tools_file}:undocumented' has no JSON schema: Cannot generate JSON schema for undocumented because it has no docstring!"
    assert "Args:" in info.value.hint


def test_import_named_says_which_file_or_name_is_missing(tools_file):
    with pytest.raises(EnvironmentSetupError, match="^tool file not found: nowhere.py$"):
        import_named("nowhere.py:f", "tool", EnvironmentSetupError)
    with pytest.raises(EnvironmentSetupError, match=r"has no tool 'nothing'$"):
        import_named(f"{tools_file}:nothing", "tool", EnvironmentSetupError)


def test_two_tools_of_one_name_are_refused():
    with pytest.raises(EnvironmentSetupError, match="^two tools are named 'calculate'$"):
        load_tools([CALCULATOR, CALCULATOR])


def test_call_tool_answers_a_valid_call_and_every_failure_as_text(tools_file):
    tools = load_tools([CALCULATOR, f"{tools_file}:add"])
    answers = [run(call_tool(tools, name, arguments, timeout_s=5)) for name, arguments in [
        ("calculate", {"expression": "12 * 7"}),
        ("add", {"a": 2, "b": 3}),  # async def; a dict answer is JSON
        ("calculate", {"expr": "12 * 7"}),
        ("calculate", {"expression": "1 / 0"}),
        ("search", {"q": "x"}),
        ("calculate", ["12 * 7"]),
    ]]
    assert [(a.content, a.error) for a in answers] == [
        ("84", False),
        ('{"sum": 5}', False),
        ("error: wrong arguments for tool 'calculate': missing a required argument: 'expression'", True),
        ("error: tool 'calculate' raised ValueError: division by zero", True),
        ("error: unknown tool 'search'; the tools are: add, calculate", True),
        ("error: the arguments of tool 'calculate' must be a JSON object, got list", True),
    ]


@pytest.mark.parametrize("name", ["slow", "aslow"])
def test_a_tool_past_its_timeout_is_an_error_answer_and_nothing_waits_for_it(tools_file, name):
    tools = load_tools([f"{tools_file}:{name}"])
    started = time.monotonic()
    answer = run(call_tool(tools, name, {"seconds": 5.0}, timeout_s=0.2))
    assert (answer.content, answer.error) == (f"error: tool '{name}' did not answer within 0.2 s", True)
    assert time.monotonic() - started < 2.0  # asyncio.run returned without waiting for the sleeping thread
