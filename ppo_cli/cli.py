"""The `ppo` command line: parse arguments, load the recipe, call a command, show the result.

Every error a person can fix is a ``PpoError``; it is printed as ``error: <message>`` and
``hint: <hint>`` on stderr and the process exits with the error's code. Anything else is a bug: one
line and a pointer to ``--debug`` (or ``PPO_DEBUG=1``), which re-raises so the traceback shows.
Usage errors found by Typer itself keep its exit code 2.

Importing this module must not import torch (tests/test_cli.py checks): ``ppo --help`` and
``ppo validate`` stay instant, and each command imports what it needs inside its function.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from ppo_cli import __version__
from ppo_cli.errors import EXIT_INTERRUPTED, EXIT_RUNTIME, PpoError

BUG_HINT = "run again with --debug for the traceback; this is a bug, please report it"


class _OneLineErrors(TyperGroup):
    """Runs a subcommand and turns what it raises into one line + hint + exit code.

    It sits in the group (not only in ``main``) so that Typer's CliRunner, which calls the app
    directly, sees exactly what a user sees.
    """

    def invoke(self, ctx):  # type: ignore[no-untyped-def]
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise  # Typer's own flow: --help, usage errors (exit 2), explicit exits
        except (Exception, KeyboardInterrupt) as err:
            if ctx.params.get("debug"):
                raise
            raise typer.Exit(report_error(err)) from None


app = typer.Typer(
    name="ppo",
    cls=_OneLineErrors,
    help="Fine-tune language models with PPO (RLHF) from YAML recipes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # never a rich traceback with locals (they can hold tokens, tensors)
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

RecipeArg = Annotated[Path, typer.Argument(metavar="RECIPE", help="The recipe YAML file.", show_default=False)]
OverridesOpt = Annotated[
    Optional[list[str]],
    typer.Option(
        "--set",
        metavar="KEY.PATH=VALUE",
        help="Override a recipe value, written as YAML; repeatable. "
        "e.g. --set ppo.kl_coef=0.1 --set policy.lora=null --set reward.components.0.weight=2",
        show_default=False,
    ),
]


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"ppo {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    debug: Annotated[
        bool, typer.Option("--debug", envvar="PPO_DEBUG", help="Show the full traceback of an error (env PPO_DEBUG=1).")
    ] = False,
) -> None:
    """Fine-tune language models with PPO (RLHF) from YAML recipes."""


@app.command()
def validate(
    recipe: RecipeArg,
    overrides: OverridesOpt = None,
    all_errors: Annotated[bool, typer.Option("--all-errors", help="List every error, not only the first.")] = False,
) -> None:
    """Check a recipe; print it with every default filled in, and the sizes derived from it."""
    from ppo_cli.commands.validate import run
    from ppo_cli.recipe import RecipeValidationError, load_recipe

    try:
        resolved = load_recipe(recipe, overrides or ())
    except RecipeValidationError as err:
        if not all_errors:
            raise
        for problem in err.problems:
            print_error(str(problem), problem.hint)
        raise typer.Exit(err.exit_code) from None
    result = run(resolved)
    print_yaml(result.resolved_yaml)
    _stderr().print(result.summary)


@app.command()
def train(
    recipe: RecipeArg,
    overrides: OverridesOpt = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing run of the same name.")] = False,
    merge: Annotated[
        bool, typer.Option("--merge", help="Also save a merged full model in final/ (LoRA runs).")
    ] = False,
    resume: Annotated[
        Optional[str],
        typer.Option(
            "--resume",
            metavar="CHECKPOINT",
            help="Resume from a checkpoint directory, or 'latest' for this run's latest checkpoint.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Train a policy with PPO as the recipe says; writes output_dir/name/."""
    from ppo_cli.recipe import load_recipe

    resolved = load_recipe(recipe, overrides or ())
    from ppo_cli.commands.train import run as run_train  # imports torch: only after the recipe is valid

    run_train(resolved, recipe_path=recipe, overwrite=overwrite, merge=merge, resume=resume)


# `ppo rollout | score | eval | compare` go here, one short function each, in the same shape:
# parse -> load_recipe -> `from ppo_cli.commands.<name> import run` (inside the function) -> print.


def main(argv: list[str] | None = None) -> None:
    """The `ppo` console script. Errors are mapped to one line in ``_OneLineErrors``; this is the
    last resort for anything raised outside a subcommand."""
    args = _debug_first(list(sys.argv[1:] if argv is None else argv))
    try:
        app(args=args, prog_name="ppo")
    except (Exception, KeyboardInterrupt) as err:
        if "--debug" in args or _env_debug():
            raise
        sys.exit(report_error(err))


def report_error(err: BaseException) -> int:
    """Print ``err`` as one line (+ hint) on stderr; return the exit code for it."""
    if isinstance(err, PpoError):
        print_error(err.message, err.hint)
        return err.exit_code
    if isinstance(err, KeyboardInterrupt):
        print_error("interrupted")
        return EXIT_INTERRUPTED
    first_line = next(iter(str(err).splitlines()), "")
    print_error(f"unexpected {type(err).__name__}: {first_line}", BUG_HINT)
    return EXIT_RUNTIME


def print_error(message: str, hint: str | None = None) -> None:
    from rich.text import Text

    console = _stderr()
    # Text, not a markup string: messages quote user input such as '[bold]' or '[/]'.
    console.print(Text.assemble(("error:", "bold red"), " ", message))
    if hint:
        console.print(Text.assemble(("hint:", "bold"), " ", hint))


def print_yaml(text: str) -> None:
    """YAML on stdout: highlighted on a terminal, plain (pipeable) otherwise."""
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.syntax import Syntax

        Console().print(Syntax(text, "yaml", background_color="default"))
    else:
        sys.stdout.write(text)


def _stderr():  # type: ignore[no-untyped-def]
    from rich.console import Console

    # Made per call so a redirected sys.stderr (tests, CliRunner) is honoured; soft_wrap: one line stays one.
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _debug_first(args: list[str]) -> list[str]:
    """Accept `--debug` anywhere (`ppo validate r.yaml --debug`) by moving it before the command."""
    end = args.index("--") if "--" in args else len(args)
    if "--debug" in args[:end]:
        args = ["--debug"] + [a for i, a in enumerate(args) if a != "--debug" or i >= end]
    return args


def _env_debug() -> bool:
    import os

    return os.environ.get("PPO_DEBUG", "").lower() in ("1", "true", "yes", "on")
