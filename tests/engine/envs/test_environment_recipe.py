"""The recipe's environment section: absent is one turn; each bad section is one located line."""

from __future__ import annotations

import pytest

from ppo_cli.recipe_loading import dump_resolved, load_recipe
from tests.recipe.test_recipe import BASE, error, write

GUESS = "environment:\n  type: python\n  class: recipes/envs/guess.py:GuessNumber\n  kwargs: {low: 1, high: 5}\n"


def test_no_environment_section_is_one_turn(tmp_path):
    assert load_recipe(write(tmp_path, BASE)).environment is None


def test_a_python_environment_reads_class_and_dumps_it_back_as_class(tmp_path):
    recipe = load_recipe(write(tmp_path, BASE + GUESS))
    environment = recipe.environment
    assert (environment.type, environment.class_, environment.kwargs) == ("python", "recipes/envs/guess.py:GuessNumber",
                                                                          {"low": 1, "high": 5})
    assert (environment.max_turns, environment.max_episode_tokens, environment.on_failure) == (4, 256, "skip")
    dumped = dump_resolved(recipe)
    assert "  class: recipes/envs/guess.py:GuessNumber\n" in dumped and "class_" not in dumped
    assert load_recipe(write(tmp_path, dumped, "resolved.yaml")) == recipe


@pytest.mark.parametrize("section, message, hint", [
    ("  type: tools\n", "18: environment.tools: needed by type 'tools'", "e.g. tools: [recipes/tools/calculator.py:calculate]"),
    ("  type: python\n", "18: environment.class: needed by type 'python'", "e.g. class: recipes/envs/guess.py:GuessNumber"),
    ("  type: http\n", "18: environment.url: needed by type 'http'", "e.g. url: http://127.0.0.1:8080"),
    ("  type: python\n  class: g.py:G\n  tools: [a.py:f]\n", "21: environment.tools: only used with type 'tools', but the "
     "type is 'python'", "remove environment.tools (from the command line: --set environment.tools=[]), or set environment.type: tools"),
    ("  type: tools\n  tools: [a.py:f]\n  url: http://127.0.0.1:1\n", "21: environment.url: only used with type 'http', "
     "but the type is 'tools'", "remove environment.url (from the command line: --set environment.url=null), or set environment.type: http"),
    ("  type: http\n  url: ftp://x\n", "20: environment.url: 'ftp://x' is not an http(s) URL",
     "write it as http://HOST:PORT or https://..."),
    ("  type: http\n  url: http://127.0.0.1:8080\n  headers: {Authorization: Bearer abc}\n",
     "21: environment.headers: header 'Authorization' holds a literal credential",
     "put it in an environment variable and write e.g. 'Bearer ${ENV_TOKEN}'"),
    ("  type: http\n  url: http://10.0.0.2:8080\n  headers: {Authorization: 'Bearer ${T}'}\n",
     "20: environment.url: would send credentials over plain http to 10.0.0.2", "use https"),
    ("  type: tools\n  tools: [calculate]\n", "20: environment.tools.0: invalid value 'calculate'", None),
])
def test_bad_environment_sections_are_one_located_line(tmp_path, section, message, hint):
    path = write(tmp_path, BASE + "environment:\n" + section)
    err = error(path)
    assert err.message == f"{path}:{message}"
    if hint is not None:
        assert err.hint == hint


def test_the_type_switches_from_the_command_line_as_the_hint_says(tmp_path):
    path = write(tmp_path, BASE + GUESS)
    switch = ["environment.type=tools", "environment.tools=[recipes/tools/calculator.py:calculate]"]
    assert "--set environment.class=null" in error(path, switch).hint
    assert "--set environment.kwargs={}" in error(path, switch + ["environment.class=null"]).hint
    environment = load_recipe(path, switch + ["environment.class=null", "environment.kwargs={}"]).environment
    assert (environment.type, environment.tools, environment.class_) == ("tools", ["recipes/tools/calculator.py:calculate"], None)


def test_an_unknown_environment_key_is_refused(tmp_path):
    err = error(write(tmp_path, BASE + GUESS + "  class_: x.py:Y\n"))
    assert "environment.class_" in err.message


def test_an_environment_with_several_processes_or_vllm_is_refused_in_one_line(tmp_path):
    """Episodes of several turns run in one process with transformers' generate: the others are refused
    before anything loads (ppo train --num-processes 2 here; vLLM through the same check)."""
    from typer.testing import CliRunner

    from ppo_cli.cli import app
    from ppo_cli.commands.inputs import check_environment
    from ppo_cli.errors import RecipeError

    result = CliRunner().invoke(app, ["train", str(write(tmp_path, BASE + GUESS)), "--num-processes", "2"])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[0] == "error: environment: episodes of several turns run in one process, not 2"
    assert "Traceback" not in result.output
    recipe = load_recipe(write(tmp_path, BASE + GUESS), ["generation.backend=vllm"])
    with pytest.raises(RecipeError, match="sample with generation.backend hf, not vllm"):
        check_environment(recipe)
    check_environment(load_recipe(write(tmp_path, BASE + GUESS)))  # one process, hf: accepted


def test_an_environment_reads_each_prompts_row_in_the_inference_commands_too(tmp_path):
    """ppo rollout has no reward: the rows come from the command's prompts file, else the recipe's data."""
    from ppo_cli.engine.data import PromptColumns, read_recipe_prompts
    from ppo_cli.engine.inference import _rows_of_prompts
    from tests.conftest import ROOT

    recipe = load_recipe(ROOT / "recipes" / "tiny_math.yaml", [f"data.prompts={ROOT / 'recipes/data/tiny_math.jsonl'}"])
    prompt = "What is 12 * 6? Give the number."
    assert _rows_of_prompts(recipe, None, None)([prompt]) == {"answer": ["72"]}  # the recipe's eval rows
    given = PromptColumns([read_recipe_prompts(recipe.data, "eval_prompts")])
    assert _rows_of_prompts(recipe, None, given)([prompt]) == {"answer": ["72"]}


TOOLS_CODE = '''
def calculate(expression: str) -> str:
    """Compute.

    Args:
        expression: two numbers and an operator
    """
    return expression


def undocumented(expression):
    return expression


class Game:
    def reset(self, row, seed):
        return None

    def step(self, message):
        return {"observation": None, "reward": 1.0, "done": True}


class NoStep:
    def reset(self, row, seed):
        return None
'''


@pytest.mark.parametrize("section, message, hint", [
    ("  type: tools\n  tools: [{dir}/code.py:calc]\n", "'{dir}/code.py' has no tool 'calc'", "did you mean 'calculate'?"),
    ("  type: tools\n  tools: [{dir}/nope.py:calculate]\n", "tool file not found: {dir}/nope.py",
     "paths are relative to the current directory ({cwd})"),
    ("  type: python\n  class: {dir}/code.py:Gmae\n", "'{dir}/code.py' has no environment class 'Gmae'", "did you mean 'Game'?"),
    ("  type: python\n  class: {dir}/code.py:Board\n", "'{dir}/code.py' has no environment class 'Board'",
     "define class Board with reset(self, row, seed) and step(self, message)"),
    ("  type: python\n  class: {dir}/broken.py:Game\n", "{dir}/broken.py:1: Python syntax error: invalid syntax",
     "python -m py_compile {dir}/broken.py shows the error in full"),
])
def test_validate_checks_the_environments_files_and_names_without_running_them(tmp_path, section, message, hint):
    """`ppo validate` reads the tool and class files as it reads reward function files: there, defining
    the name, and usable as a tool or class as far as the source shows (one line, exit 2), without importing them."""
    from pathlib import Path

    from ppo_cli.commands.validate import check_environment_code
    from ppo_cli.errors import EXIT_USAGE, EnvironmentSetupError

    (tmp_path / "code.py").write_text(TOOLS_CODE + "\nraise RuntimeError('imported')\n")  # validate must not run it
    (tmp_path / "broken.py").write_text("def (:\n")
    recipe = load_recipe(write(tmp_path, BASE + "environment:\n" + section.format(dir=tmp_path)))
    with pytest.raises(EnvironmentSetupError) as err:
        check_environment_code(recipe.environment)
    assert err.value.message == message.format(dir=tmp_path)
    assert err.value.hint == hint.format(dir=tmp_path, cwd=Path.cwd())
    assert err.value.exit_code == EXIT_USAGE
    fine = "  type: tools\n  tools: [{dir}/code.py:calculate]\n"
    check_environment_code(load_recipe(write(tmp_path, BASE + "environment:\n" + fine.format(dir=tmp_path))).environment)
    # what train's import would refuse, read from the source (tests/engine/envs/test_source_checks.py: the same words)
    for refused in ("  type: tools\n  tools: [{dir}/code.py:undocumented]\n", "  type: python\n  class: {dir}/code.py:NoStep\n"):
        with pytest.raises(EnvironmentSetupError):
            check_environment_code(load_recipe(write(tmp_path, BASE + "environment:\n" + refused.format(dir=tmp_path))).environment)


def test_train_imports_the_environments_code_before_any_model_loads(tmp_path):
    """`ppo train`'s preflight imports the tools or the class (import_code): what only importing shows (no
    docstring, no step method) is one line before loading, not after."""
    from ppo_cli.commands.validate import check_environment_code
    from ppo_cli.errors import EnvironmentSetupError

    (tmp_path / "code.py").write_text(TOOLS_CODE)

    def environment(section):
        return load_recipe(write(tmp_path, BASE + "environment:\n" + section.format(dir=tmp_path))).environment

    with pytest.raises(EnvironmentSetupError) as err:
        check_environment_code(environment("  type: tools\n  tools: [{dir}/code.py:undocumented]\n"), import_code=True)
    assert err.value.message.startswith(f"tool '{tmp_path}/code.py:undocumented' has no JSON schema")
    with pytest.raises(EnvironmentSetupError) as err:
        check_environment_code(environment("  type: python\n  class: {dir}/code.py:NoStep\n"), import_code=True)
    assert err.value.message == f"environment class '{tmp_path}/code.py:NoStep' is not a class with reset and step"
    check_environment_code(environment("  type: python\n  class: {dir}/code.py:Game\n"), import_code=True)
    check_environment_code(environment("  type: tools\n  tools: [{dir}/code.py:calculate]\n"), import_code=True)


def test_train_builds_and_resets_one_python_environment_before_any_model_loads(tmp_path):
    """What only running the class shows (kwargs it does not take, a reset that raises or answers outside the
    contract) is one line before the models load, with the first prompt's row, as for an http server."""
    from ppo_cli.commands.validate import check_environment_code
    from ppo_cli.errors import EnvironmentSetupError

    (tmp_path / "games.py").write_text(
        "class Game:\n    resets = []\n    def __init__(self, size=3):\n        self.size = size\n"
        "    def reset(self, row, seed):\n        Game.resets.append((row, seed))\n        return row['word'][: self.size]\n"
        "    def step(self, message):\n        return {'done': True}\n"
        "class Tuple(Game):\n    def reset(self, row, seed):\n        return 'hi', {}\n")

    def environment(name, kwargs="{}"):
        return load_recipe(write(tmp_path, BASE + f"environment:\n  type: python\n  class: {tmp_path}/games.py:{name}\n"
                                 f"  kwargs: {kwargs}\n")).environment

    check_environment_code(environment("Game"), import_code=True, row={"word": "apple"})
    from ppo_cli.engine.user_code import import_named
    assert import_named(f"{tmp_path}/games.py:Game", "environment class", EnvironmentSetupError).resets == [({"word": "apple"}, 0)]
    cases = [(environment("Game", "{tries: 3}"), f"environment {tmp_path}/games.py:Game(**kwargs) raised TypeError: "),
             (environment("Game"), f"environment {tmp_path}/games.py:Game.reset raised KeyError: 'word'"),
             (environment("Tuple"), f"environment {tmp_path}/games.py:Tuple.reset gave ")]
    for config, message in cases:
        with pytest.raises(EnvironmentSetupError) as err:
            check_environment_code(config, import_code=True, row={"answer": "x"} if "KeyError" in message else {"word": "w"})
        assert err.value.message.startswith(message), err.value.message
        assert err.value.hint.startswith("fix the environment class")


def test_an_environment_with_a_policy_without_a_chat_template_is_one_line(tmp_path, chatml, monkeypatch):
    """Each turn is rendered by the policy's chat template: a base model without one is refused in one line,
    before loading from its files (validate, train), and by the sampler for a model given on the command line
    (it was 'unexpected ValueError: Cannot use chat template functions ...: this is a bug')."""
    import copy
    import json

    from ppo_cli.commands.validate import check_recipe_files
    from ppo_cli.engine.envs.environments import EnvironmentFactory
    from ppo_cli.engine.envs.multi_turn import MultiTurnSampler
    from ppo_cli.errors import EXIT_USAGE, EnvironmentSetupError
    from ppo_cli.recipe import EnvironmentConfig
    from tests.conftest import ROOT

    model = tmp_path / "base"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    monkeypatch.chdir(tmp_path)  # the BASE recipe's files are relative
    (tmp_path / "prompts.txt").write_text("hello\n")
    (tmp_path / "rewards.py").write_text("def length_reward(prompts, responses):\n    return [0.0 for _ in responses]\n")
    recipe = load_recipe(write(tmp_path, BASE + GUESS.replace("recipes/envs/guess.py", f"{ROOT}/recipes/envs/guess.py")),
                         [f"policy.path={model}"])
    message = f"environment: an episode of several turns is rendered with the policy's chat template, but '{{}}' has none"
    hint = "use a chat model (a tokenizer with a chat template) as policy.path, e.g. models/tiny-tools/policy"
    with pytest.raises(EnvironmentSetupError) as err:
        check_recipe_files(recipe)
    assert (err.value.message, err.value.hint, err.value.exit_code) == (message.format(model), hint, EXIT_USAGE)

    plain = copy.deepcopy(chatml)
    plain.chat_template = None
    environment = EnvironmentConfig.model_validate({"type": "tools", "tools": [f"{ROOT}/recipes/tools/calculator.py:calculate"]})
    with pytest.raises(EnvironmentSetupError) as err:
        MultiTurnSampler(None, EnvironmentFactory(environment), plain, environment, plain.eos_token_id, plain.pad_token_id)
    assert err.value.message == message.format(plain.name_or_path or "the policy")
