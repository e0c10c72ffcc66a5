"""The `ppo` CLI: one-line errors with hints and exit codes, --debug tracebacks, thin commands.

Commands are patched where they would load models, so nothing here imports torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ppo_cli import __version__, report
from ppo_cli.cli import BUG_HINT, app, main
from ppo_cli.errors import EXIT_INTERRUPTED, EXIT_RUNTIME, EXIT_USAGE, RESUME, RESUME_ENV, Interrupted, UsageError
from ppo_cli.recipe_loading import dump_resolved, load_recipe

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = ROOT / "tests" / "fixtures" / "recipes" / "minimal.yaml"
SUMMARY = "valid: run directory runs/minimal; num_mini_batches=2, grad_accum_steps=2, value kind=head"

runner = CliRunner()


def invoke(*args: str, **kwargs):
    return runner.invoke(app, [str(a) for a in args], **kwargs)


@pytest.fixture
def bad_recipe(tmp_path: Path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(MINIMAL.read_text().replace("  mini_batch_size: 4\n", "  mini_batch_size: 4\n  kl_coeff: 1\n"))
    return path


@pytest.fixture
def fake_train(monkeypatch) -> list[dict]:
    """Stands in for ppo_cli.commands.train (which loads models) and records its calls."""
    calls: list[dict] = []
    module = types.ModuleType("ppo_cli.commands.train")

    def run(recipe, **kwargs):
        calls.append({"recipe": recipe, **kwargs})
        return types.SimpleNamespace(summary={})  # a process that is not the main one has no summary

    module.run = run
    monkeypatch.setitem(sys.modules, "ppo_cli.commands.train", module)
    return calls


def boom(*args, **kwargs):
    raise RuntimeError("boom\nsecond line")


# --- help and version --------------------------------------------------------------------------


def test_help_lists_the_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("train", "validate"):
        assert command in result.stdout


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout == f"ppo {__version__}\n"


def test_no_arguments_shows_help_with_usage_exit_code():
    result = invoke()
    assert result.exit_code == EXIT_USAGE
    assert "Usage" in result.output


def test_importing_the_cli_does_not_import_torch_or_datasets():
    code = "import sys, ppo_cli.cli; assert not {'torch', 'datasets'} & set(sys.modules), 'torch or datasets imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# --- validate ------------------------------------------------------------------------------------


def test_validate_prints_the_resolved_recipe_and_the_summary():
    result = invoke("validate", MINIMAL, "--no-check-files")  # the fixture names files that do not exist
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout) == yaml.safe_load(dump_resolved(load_recipe(MINIMAL)))
    assert result.stderr.strip() == SUMMARY
    assert SUMMARY in result.output


def test_validate_applies_set_overrides():
    result = invoke("validate", MINIMAL, "--no-check-files", "--set", "ppo.kl_coef=0.2", "--set", "policy.lora=null")
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.stdout)
    assert resolved["ppo"]["kl_coef"] == 0.2
    assert resolved["policy"]["lora"] is None
    assert "value kind=head" in result.stderr


def test_validate_checks_the_files_the_recipe_names_as_train_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "prompts.txt").write_text("\n  \n")
    result = invoke("validate", MINIMAL)
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.splitlines()[0] == "error: prompts.txt: no prompts in this file"
    (tmp_path / "prompts.txt").write_text("The movie was\n")
    result = invoke("validate", MINIMAL)
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.splitlines()[0] == (
        "error: policy.path: model 'tiny/policy' is not a local directory and the hub is offline (HF_HUB_OFFLINE=1)"), result.output
    (tmp_path / "tiny" / "policy").mkdir(parents=True)
    (tmp_path / "tiny" / "policy" / "config.json").write_text("{}")
    result = invoke("validate", MINIMAL)
    assert result.stderr.splitlines()[0] == "error: reward function file not found: rewards.py", result.output
    (tmp_path / "rewards.py").write_text("raise SystemExit('imported')\n")  # validate must not run it
    result = invoke("validate", MINIMAL)
    assert result.stderr.splitlines()[0] == "error: 'rewards.py' has no function 'length_reward'", result.output
    (tmp_path / "rewards.py").write_text("raise SystemExit('imported')\ndef length_reward(prompts, responses):\n    return []\n")
    result = invoke("validate", MINIMAL)
    assert result.exit_code == 0, result.output
    assert result.stderr.strip() == SUMMARY


def _minimal_workspace(tmp_path: Path, monkeypatch, reward: str) -> None:
    """MINIMAL's files in tmp_path: a policy directory, rewards.py holding ``reward``, the prompts as my/train.jsonl."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "tiny" / "policy").mkdir(parents=True)
    (tmp_path / "tiny" / "policy" / "config.json").write_text("{}")
    (tmp_path / "my").mkdir()
    (tmp_path / "my" / "train.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    (tmp_path / "rewards.py").write_text("raise SystemExit('imported')\n" + reward)  # validate must not run it


def test_validate_reports_a_syntax_error_in_the_reward_functions_file_without_running_it(tmp_path, monkeypatch):
    _minimal_workspace(tmp_path, monkeypatch, "\ndef length_reward(prompts, responses:\n")
    result = invoke("validate", MINIMAL, "--set", "data.prompts=my/train.jsonl")
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.stderr.splitlines() == [
        "error: rewards.py:3: Python syntax error: '(' was never closed",
        "hint: fix the reward function's file; python -m py_compile rewards.py shows the error in full",
    ]


@pytest.mark.parametrize("signature", ["(prompts, responses, solution)", "(completions, solution, **kwargs)"],
                         ids=["positional", "trl-style"])
def test_validate_refuses_a_reward_function_taking_a_column_the_prompt_rows_lack(tmp_path, monkeypatch, signature):
    _minimal_workspace(tmp_path, monkeypatch, f"def length_reward{signature}:\n    return []\n")
    result = invoke("validate", MINIMAL, "--set", "data.prompts=my/train.jsonl")
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.stderr.splitlines() == [
        "error: reward function 'rewards.py:length_reward' takes the column(s) solution, which the rows of "
        "my/train.jsonl do not have (they have: answer, prompt)",
        "hint: use a .jsonl or dataset whose rows carry them (each row's other fields are its columns)",
    ]


def test_validate_refuses_a_trl_reward_function_requiring_what_ppo_cli_does_not_pass(tmp_path, monkeypatch):
    """As train does when it imports the function (engine/rewards/function.py), from the source."""
    _minimal_workspace(tmp_path, monkeypatch, "def length_reward(completions, trainer_state, **kwargs):\n    return []\n")
    result = invoke("validate", MINIMAL, "--set", "data.prompts=my/train.jsonl")
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.stderr.splitlines() == [
        "error: reward function 'rewards.py:length_reward' requires trainer_state, which ppo_cli does not pass "
        "(it passes prompts, completions and the rows' columns, by keyword)",
        "hint: give trainer_state a default (=None), or drop it and take **kwargs (kwargs.get(...) is None here)",
    ]


def test_validate_checks_the_eval_prompts_rows_columns_too(tmp_path, monkeypatch):
    _minimal_workspace(tmp_path, monkeypatch, "def length_reward(prompts, responses, answer, hint=None):\n    return []\n")
    result = invoke("validate", MINIMAL, "--set", "data.prompts=my/train.jsonl")
    assert result.exit_code == 0, result.output  # the rows have answer; hint has a default
    (tmp_path / "my" / "eval.txt").write_text("3+4?\n")
    result = invoke("validate", MINIMAL, "--set", "data.prompts=my/train.jsonl", "--set", "data.eval_prompts=my/eval.txt")
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.stderr.splitlines()[0] == (
        "error: reward function 'rewards.py:length_reward' takes the column(s) answer, which the rows of "
        "my/eval.txt do not have (they have: none)")


def test_validate_says_a_reward_asking_for_the_prompt_column_gets_it_as_prompts(tmp_path, monkeypatch):
    _minimal_workspace(tmp_path, monkeypatch, "def length_reward(prompts, responses, prompt):\n    return []\n")
    result = invoke("validate", MINIMAL, "--set", "data.prompts=my/train.jsonl")
    assert result.exit_code == EXIT_USAGE, result.output
    assert result.stderr.splitlines()[1] == (
        "hint: 'prompt' is the prompt column: the function gets it as its first argument (prompts)")


def test_validate_refuses_a_conversation_reward_model_without_a_chat_template(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.txt").write_text("The movie was\n")
    for model in ("tiny/policy", "rm"):
        (tmp_path / model).mkdir(parents=True)
        (tmp_path / model / "config.json").write_text("{}")
    (tmp_path / "rm" / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(MINIMAL.read_text().replace(
        "    - type: function\n      function: rewards.py:length_reward\n",
        "    - type: model\n      path: rm\n      text: conversation\n"))
    result = invoke("validate", recipe)
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.splitlines() == [
        "error: reward component 'rm' reads text: conversation but its tokenizer has no chat template",
        "hint: use a reward model whose tokenizer has a chat template, or text: prompt_and_response / response",
    ]
    (tmp_path / "rm" / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert invoke("validate", recipe).exit_code == 0


def test_validate_bad_recipe_is_one_error_line_and_a_hint(bad_recipe):
    result = invoke("validate", bad_recipe)
    assert result.exit_code == EXIT_USAGE
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert lines[0] == f"error: {bad_recipe}:16: ppo.kl_coeff: unknown key 'kl_coeff' in ppo"
    assert lines[1].startswith("hint: did you mean 'kl_coef'? allowed keys: rollout_batch_size,")
    assert len(lines) == 2
    assert "Traceback" not in result.output


def test_validate_all_errors_lists_every_error(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text(MINIMAL.read_text().replace("r: 4", "r: four").replace("total_updates: 2", "total_updates: -1"))
    first = invoke("validate", path)
    assert first.stderr.splitlines()[0] == (
        f"error: {path}:6: policy.lora.r: expected an integer, got 'four' "
        f"(and 1 more error; run `ppo validate {path} --all-errors` for all)"
    )
    result = invoke("validate", path, "--all-errors")
    assert result.exit_code == EXIT_USAGE
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        f"error: {path}:6: policy.lora.r: expected an integer, got 'four'",
        f"error: {path}:18: train.total_updates: must be > 0, got -1",
    ]


def test_validate_bad_set_syntax(bad_recipe):
    result = invoke("validate", MINIMAL, "--set", "ppo.kl_coef")
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.splitlines()[0] == "error: --set ppo.kl_coef: expected key.path=value"


def test_validate_missing_file():
    result = invoke("validate", "no/such/recipe.yaml")
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.splitlines() == [
        "error: no/such/recipe.yaml: no such recipe file",
        "hint: check the path; shipped recipes are in recipes/",
    ]


def test_error_text_is_not_read_as_rich_markup(tmp_path):
    path = tmp_path / "markup.yaml"
    path.write_text(MINIMAL.read_text().replace("name: minimal", "name: '[bold]x[/]'"))
    result = invoke("validate", path)
    assert result.exit_code == EXIT_USAGE
    assert f"error: {path}:2: name: invalid value '[bold]x[/]'" in result.stderr


def test_missing_argument_is_a_usage_error():
    result = invoke("validate")
    assert result.exit_code == 2
    assert "Missing argument" in result.output


# --- train ----------------------------------------------------------------------------------------


def test_train_loads_the_recipe_and_calls_the_train_command(fake_train):
    result = invoke("train", MINIMAL, "--set", "train.total_updates=5", "--overwrite", "--resume", "latest")
    assert result.exit_code == 0, result.output
    [call] = fake_train
    assert call["recipe"].train.total_updates == 5
    assert call["recipe_path"] == MINIMAL
    assert (call["overwrite"], call["merge"], call["resume"]) == (True, False, "latest")


def test_train_defaults(fake_train):
    assert invoke("train", MINIMAL, "--merge").exit_code == 0
    [call] = fake_train
    assert (call["overwrite"], call["merge"], call["resume"]) == (False, True, None)
    assert isinstance(call["show"], report.TrainScreen)  # the run prints nothing itself; the CLI draws it


def test_train_invalid_recipe_never_reaches_the_train_command(fake_train, bad_recipe):
    result = invoke("train", bad_recipe)
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.startswith(f"error: {bad_recipe}:16: ppo.kl_coeff:")
    assert fake_train == []


def test_train_vllm_with_several_processes_is_refused_before_launching(monkeypatch, fake_train):
    launched = []
    monkeypatch.setattr("ppo_cli.launch.launch_train", lambda *a, **k: launched.append(a) or 0)
    result = invoke("train", MINIMAL, "--set", "generation.backend=vllm", "--num-processes", "2")
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.splitlines() == [
        "error: generation.backend 'vllm' runs in one process only",
        "hint: train with one process (no --num-processes / accelerate launch), or set generation.backend: hf",
    ]
    assert launched == [] and fake_train == []


def test_train_ppo_error_keeps_its_exit_code_and_hint(monkeypatch, fake_train):
    def refuse(recipe, **kwargs):
        raise UsageError("runs/minimal exists", hint="pass --overwrite or change name")

    monkeypatch.setattr(sys.modules["ppo_cli.commands.train"], "run", refuse)
    result = invoke("train", MINIMAL)
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.splitlines() == ["error: runs/minimal exists", "hint: pass --overwrite or change name"]



def _interrupted(monkeypatch) -> None:
    """ppo_cli.commands.train's run stopped by Ctrl-C, with the hint it raises (errors.RESUME in it)."""
    def stop(recipe, **kwargs):
        raise Interrupted("interrupted after update 4; checkpoint saved", hint=f"resume with: {RESUME}")

    monkeypatch.setattr(sys.modules["ppo_cli.commands.train"], "run", stop)


@pytest.mark.parametrize("args, command", [
    # --set overrides: the run's saved recipe holds them (the recipe file names another run, or differs)
    (["--set", "name=ci", "--set", "ppo.rollout_batch_size=16", "--overwrite"], "ppo train runs/ci/recipe.yaml --resume"),
    (["--set", "ppo.kl_coef=0.1", "--merge"], "ppo train runs/minimal/recipe.yaml --merge --resume"),
    # none: the command as given
    ([], f"ppo train {MINIMAL} --resume"),
    # a command that resumed was accepted once: itself (its --set may extend the run, --force more)
    (["--set", "train.total_updates=8", "--resume", "runs/minimal/checkpoints/step-000002"],
     f"ppo train {MINIMAL} --set train.total_updates=8 --resume"),
    (["--set", "seed=4", "--resume", "latest", "--force"], f"ppo train {MINIMAL} --set seed=4 --resume --force"),
])
def test_a_resume_hint_gives_a_command_that_resumes_this_run(monkeypatch, fake_train, args, command):
    _interrupted(monkeypatch)
    result = invoke("train", MINIMAL, *args)
    assert result.exit_code == EXIT_INTERRUPTED
    assert result.stderr.splitlines() == ["stopped: interrupted after update 4; checkpoint saved",
                                          f"hint: resume with: {command}"]


def test_a_resume_hint_keeps_the_launchers_options_and_reaches_the_launched_processes(monkeypatch, fake_train):
    import ppo_cli.launch

    launched = {}
    monkeypatch.setattr(ppo_cli.launch, "launch_train", lambda *args, resume=None, **kwargs: launched.update(resume=resume) or 0)
    result = invoke("train", MINIMAL, "--set", "name=ci", "--num-processes", "2", "--set", "seed=2")
    assert result.exit_code == 0, result.output
    assert launched["resume"] == "ppo train runs/ci/recipe.yaml --num-processes 2 --resume"
    # A launched process sees the command line less --num-processes; its hints print the launcher's command.
    monkeypatch.setenv(RESUME_ENV, launched["resume"])
    _interrupted(monkeypatch)
    result = invoke("train", MINIMAL, "--set", "name=ci", "--set", "seed=2")
    assert result.stderr.splitlines()[1] == "hint: resume with: ppo train runs/ci/recipe.yaml --num-processes 2 --resume"

# --- unexpected errors, Ctrl-C and --debug ---------------------------------------------------------


def test_unexpected_error_is_one_line_with_the_bug_hint(monkeypatch):
    monkeypatch.setattr("ppo_cli.commands.validate.run", boom)
    result = invoke("validate", MINIMAL)
    assert result.exit_code == EXIT_RUNTIME
    assert result.stderr.splitlines() == ["error: unexpected RuntimeError: boom", f"hint: {BUG_HINT}"]
    assert "Traceback" not in result.output


def test_keyboard_interrupt_exits_130(monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("ppo_cli.commands.validate.run", interrupt)
    result = invoke("validate", MINIMAL)
    assert result.exit_code == EXIT_INTERRUPTED
    assert result.stderr.splitlines() == ["error: interrupted"]


def test_debug_reraises(monkeypatch):
    monkeypatch.setattr("ppo_cli.commands.validate.run", boom)
    result = invoke("--debug", "validate", MINIMAL)
    assert isinstance(result.exception, RuntimeError)
    assert "error:" not in result.output


def test_debug_from_the_environment(monkeypatch):
    monkeypatch.setattr("ppo_cli.commands.validate.run", boom)
    result = invoke("validate", MINIMAL, env={"PPO_DEBUG": "1"})
    assert isinstance(result.exception, RuntimeError)


def test_main_exits_with_the_command_exit_code(capsys, bad_recipe):
    with pytest.raises(SystemExit) as exit_info:
        main(["validate", str(bad_recipe)])
    assert exit_info.value.code == EXIT_USAGE
    assert capsys.readouterr().err.startswith(f"error: {bad_recipe}:16: ppo.kl_coeff:")


def _ppo(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "PPO_DEBUG"} | env
    return subprocess.run(
        [sys.executable, "-m", "ppo_cli", *args], capture_output=True, text=True, cwd=ROOT, env=environment
    )


def test_real_process_without_debug_has_no_traceback():
    result = _ppo("validate", "no/such.yaml")
    assert result.returncode == EXIT_USAGE
    assert result.stderr.startswith("error: no/such.yaml: no such recipe file\nhint: ")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("args", [("--debug", "validate", "no/such.yaml"), ("validate", "no/such.yaml", "--debug")])
def test_real_process_with_debug_shows_the_traceback(args):
    result = _ppo(*args)
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "RecipeError: no/such.yaml: no such recipe file" in result.stderr


def test_a_users_accelerate_config_is_launched_as_written(tmp_path):
    """--accelerate-config: its precision and backend are the user's, not overridden by ppo's defaults."""
    from ppo_cli.launch import launch_command

    config = tmp_path / "fsdp.yaml"
    with_config = launch_command(1, ["train", "r.yaml", "--set", "seed=1"], config)
    assert with_config[1:] == ["-m", "ppo_cli.launch", "--config_file", str(config),
                               "-m", "ppo_cli", "train", "r.yaml", "--set", "seed=1"]
    assert launch_command(4, ["train", "r.yaml"], config)[5:7] == ["--num_processes", "4"]
    default = launch_command(2, ["train", "r.yaml"])
    assert "--config_file" not in default and default[default.index("--mixed_precision") + 1] == "no"


@pytest.mark.parametrize("argv, forwarded", [
    (["train", "r.yaml", "--num-processes", "2"], ["train", "r.yaml"]),
    (["train", "r.yaml", "--num-processes=2", "--set", "seed=1"], ["train", "r.yaml", "--set", "seed=1"]),
    (["train", "--accelerate-config", "ds.yaml", "r.yaml", "--num-processes", "4", "--overwrite"],
     ["train", "r.yaml", "--overwrite"]),
    (["--debug", "train", "r.yaml", "--accelerate-config=ds.yaml", "--resume", "latest", "--force"],
     ["--debug", "train", "r.yaml", "--resume", "latest", "--force"]),
    # A --set value that looks like a launcher option is the user's, as is everything after `--`.
    (["train", "r.yaml", "--set", "name=--num-processes", "--num-processes", "2"],
     ["train", "r.yaml", "--set", "name=--num-processes"]),
    (["train", "r.yaml", "--num-processes", "2", "--", "--num-processes"], ["train", "r.yaml", "--", "--num-processes"]),
])
def test_the_launched_processes_get_the_command_line_less_the_launchers_options(argv, forwarded):
    from ppo_cli.launch import forwarded_args

    assert forwarded_args(argv) == forwarded


def test_ppo_train_forwards_options_it_does_not_know_about(monkeypatch, tmp_path):
    """`ppo train ... --num-processes 2` hands the launcher its command line as given: an option
    added to `ppo train` later is forwarded without a change to the launcher."""
    import ppo_cli.launch
    from ppo_cli.cli import main

    launched = {}

    def fake_launch(num_processes, argv, config_file=None, machines=ppo_cli.launch.Machines(), timeout_s=None, resume=None):
        launched.update(num_processes=num_processes, command=ppo_cli.launch.launch_command(
            num_processes, ppo_cli.launch.forwarded_args(argv), config_file, machines, timeout_s))
        return 0

    monkeypatch.setattr(ppo_cli.launch, "launch_train", fake_launch)
    recipe = str(ROOT / "recipes" / "tiny_sentiment.yaml")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", recipe, "--set", "seed=3", "--num-processes", "2", "--merge", "--resume"])
    assert exit_info.value.code == 0
    command = launched["command"]
    assert launched["num_processes"] == 2
    # --resume without a value became --resume latest (cli._bare_resume), as a single process sees it
    assert command[command.index("ppo_cli") + 1:] == ["train", recipe, "--set", "seed=3", "--merge", "--resume", "latest"]
    # The same through Typer's CliRunner (which calls the app, not main()).
    result = CliRunner().invoke(app, ["train", recipe, "--num-processes=2", "--overwrite", "--set", "seed=4"])
    assert result.exit_code == 0, result.output
    assert launched["command"][command.index("ppo_cli") + 1:] == ["train", recipe, "--overwrite", "--set", "seed=4"]


def test_a_missing_accelerate_config_is_one_line():
    result = _ppo("train", str(ROOT / "recipes" / "tiny_sentiment.yaml"), "--accelerate-config", "nowhere.yaml")
    assert result.returncode == 2
    assert result.stderr.splitlines()[0] == "error: accelerate config not found: nowhere.yaml"


def test_train_launched_process_refuses_vllm_before_loading_models(monkeypatch):
    from ppo_cli.commands.train import preflight

    monkeypatch.setenv("WORLD_SIZE", "2")  # what accelerate launch / torchrun set in each process
    recipe = load_recipe(MINIMAL, ["generation.backend=vllm"])
    with pytest.raises(UsageError, match="generation.backend 'vllm' runs in one process only"):
        preflight(recipe)


STDOUT_CLOSED = """
import os, sys
from ppo_cli.cli import report_error
if sys.argv[1] == "closed":
    read_end, write_end = os.pipe()
    os.close(read_end)
    os.dup2(write_end, sys.stdout.fileno())
sys.stderr.write(f"exit code {report_error(BrokenPipeError(32, 'Broken pipe'))}\\n")
"""


@pytest.mark.parametrize("stdout", ["closed", "open"])
def test_a_closed_stdout_ends_the_command_quietly_and_a_broken_socket_is_still_an_error(stdout):
    # `ppo train --help | head` once ended with "error: unexpected BrokenPipeError ... this is a bug".
    done = subprocess.run([sys.executable, "-c", STDOUT_CLOSED, stdout], cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if stdout == "closed":
        assert (done.returncode, done.stderr) == (0, "exit code 141\n")
    else:
        assert done.stderr.splitlines() == ["error: unexpected BrokenPipeError: [Errno 32] Broken pipe",
                                            "hint: run again with --debug for the traceback; this is a bug, please report it",
                                            "exit code 1"]
