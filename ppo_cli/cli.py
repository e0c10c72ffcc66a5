"""The `ppo` command line: parse arguments, load the recipe, call a command, show the result.

Every error a person can fix is a ``PpoError``; it is printed as ``error: <message>`` and
``hint: <hint>`` on stderr and the process exits with the error's code. Anything else is a bug: one
line and a pointer to ``--debug`` (or ``PPO_DEBUG=1``), which re-raises so the traceback shows.
Usage errors found by Typer itself keep its exit code 2.

Importing this module must not import torch (tests/cli/test_cli.py checks): ``ppo --help`` and
``ppo validate`` stay instant, and each command imports what it needs inside its function.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from ppo_cli import __version__
from ppo_cli.commands import inputs
from ppo_cli.errors import (EXIT_INTERRUPTED, EXIT_RUNTIME, EXIT_STDOUT_CLOSED, RESUME, RESUME_ENV, PpoError, UsageError,
                            first_line, print_error, stderr_console)

BUG_HINT = "run again with --debug for the traceback; this is a bug, please report it"


class _OneLineErrors(TyperGroup):
    """Runs a subcommand and turns what it raises into one line + hint + exit code.

    It sits in the group (not only in ``main``) so that Typer's CliRunner, which calls the app
    directly, sees exactly what a user sees.
    """

    def main(self, args=None, *rest, **extra):  # type: ignore[no-untyped-def]
        # The command line as given, for `ppo train --num-processes N` to forward whole (ctx.obj).
        args = list(sys.argv[1:] if args is None else args)
        extra.setdefault("obj", {"argv": args})
        return super().main(args, *rest, **extra)

    def invoke(self, ctx):  # type: ignore[no-untyped-def]
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, typer.TyperException):
            raise  # Typer's own flow: --help, usage errors (exit 2), explicit exits
        except (Exception, KeyboardInterrupt) as err:
            if ctx.params.get("debug"):
                raise
            raise typer.Exit(report_error(err, (ctx.obj or {}).get("resume"))) from None


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
    check_files: Annotated[bool, typer.Option(
        "--check-files/--no-check-files",
        help="Also check the files the recipe names (prompts, model paths, reward function files), as train does.")] = True,
) -> None:
    """Check a recipe; print it with every default filled in, and the sizes derived from it."""
    from ppo_cli.commands.validate import run
    from ppo_cli.recipe_loading import RecipeValidationError, load_recipe

    try:
        resolved = load_recipe(recipe, overrides or ())
    except RecipeValidationError as err:
        if not all_errors:
            raise
        for problem in err.problems:
            print_error(str(problem), problem.hint)
        raise typer.Exit(err.exit_code) from None
    result = run(resolved, check_files=check_files)
    print_yaml(result.resolved_yaml)
    stderr_console().print(result.summary)


@app.command()
def train(
    ctx: typer.Context,
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
            help="Resume from this run's latest complete checkpoint (bare --resume), or from a "
            "checkpoint or run directory.",
            show_default=False,
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="With --resume: accept a recipe that differs from the saved one.")
    ] = False,
    num_processes: Annotated[
        Optional[int],
        typer.Option("--num-processes", min=1, show_default=False,
                      help="Data-parallel processes in all, launched through `accelerate launch` (its --num_processes): "
                      "with --num-machines M, the total over the M machines, each starting its share. "
                      "Default: the --accelerate-config file's, else one per machine."),
    ] = None,
    accelerate_config: Annotated[
        Optional[Path],
        typer.Option("--accelerate-config", metavar="FILE", show_default=False,
                     help="Launch through `accelerate launch --config_file FILE`: its distributed type, precision "
                     "and backend apply as written (--num-processes, if given, overrides its process count)."),
    ] = None,
    num_machines: Annotated[
        Optional[int], typer.Option("--num-machines", min=1, metavar="M", show_default=False,
                                    help="Machines in the run (accelerate's --num_machines): start the same command "
                                    "on each. Default: the --accelerate-config file's, else 1.")
    ] = None,
    machine_rank: Annotated[
        Optional[int], typer.Option("--machine-rank", min=0, metavar="I", show_default=False,
                                    help="This machine's rank, 0 to M-1 (accelerate's --machine_rank); machine 0 hosts "
                                    "the rendezvous and writes the run's files. Default: the config file's, else 0.")
    ] = None,
    main_address: Annotated[
        Optional[str],
        typer.Option("--main-address", metavar="HOST:PORT", show_default=False,
                     help="Machine 0's address and a free port on it, the same on every machine (accelerate's "
                     "--main_process_ip/--main_process_port, static rendezvous)."),
    ] = None,
) -> None:
    """Train a policy as the recipe says (PPO, or GRPO, RLOO or REINFORCE++ by ppo.advantage); writes output_dir/name/."""
    from ppo_cli.launch import machines_for
    from ppo_cli.recipe_loading import load_recipe
    from ppo_cli.resume import resume_command

    resolved = load_recipe(recipe, overrides or ())
    repeated = [*(["--merge"] if merge else []), *_given_options(
        ("--num-processes", num_processes), ("--accelerate-config", accelerate_config), ("--num-machines", num_machines),
        ("--machine-rank", machine_rank), ("--main-address", main_address))]
    # What the hints saying "resume" print (errors.RESUME); a launched process gets its launcher's.
    obj = ctx.find_root().obj
    obj["resume"] = os.environ.get(RESUME_ENV) or resume_command(
        resolved, recipe, overrides or (), repeated, resuming=resume is not None, force=force)
    if accelerate_config is not None and not accelerate_config.is_file():
        raise UsageError(f"accelerate config not found: {accelerate_config}",
                         hint="give a file written by `accelerate config` (or one of recipes/accelerate/)")
    machines = machines_for(num_processes, num_machines, machine_rank, main_address, accelerate_config)
    total = num_processes or machines.count
    if total > 1:  # refused before launching
        from ppo_cli.commands.inputs import check_environment, check_vllm_backend

        check_vllm_backend(resolved, total)
        check_environment(resolved, total)
    if total > 1 or accelerate_config is not None or machines.address is not None:
        from ppo_cli.launch import launch_train

        # A config file keeps its own process count unless --num-processes says otherwise.
        launched = (num_processes or 1) if accelerate_config is not None else total
        raise typer.Exit(launch_train(launched, obj["argv"], accelerate_config, machines,
                                      resolved.train.collective_timeout_s, resume=obj["resume"]))
    from ppo_cli import report
    from ppo_cli.commands.train import run as run_train  # imports torch: only after the recipe is valid

    result = run_train(resolved, recipe_path=recipe, overwrite=overwrite, merge=merge, resume=resume, force=force,
                       show=report.TrainScreen(), overrides=overrides or ())
    if result.summary:  # the main process's; the others return none
        report.print_train_summary(result.summary)


def _given_options(*options: tuple[str, object]) -> list[str]:
    """``--option value`` for each option given (not None)."""
    return [str(part) for name, value in options if value is not None for part in (name, value)]


@app.command()
def plot(
    run_dir: Annotated[Path, typer.Argument(metavar="RUN_DIR", help="A run directory written by `ppo train`, e.g. runs/NAME.", show_default=False)],
) -> None:
    """Draw a run's learning curves (reward, losses, KL, EOS rate, clip fraction, length) to RUN_DIR/plots/."""
    from ppo_cli.plots import plot_run  # matplotlib is imported inside, only when drawing

    typer.echo(f"wrote {plot_run(run_dir)}")


@app.command()
def plan(
    recipe: RecipeArg,
    overrides: OverridesOpt = None,
    gpu_memory: Annotated[
        Optional[float],
        typer.Option("--gpu-memory", metavar="GB", min=0.1, help="Plan for a GPU with this much memory (GB) and say "
                     "whether the recipe fits. Default: the local GPU's memory, if any.", show_default=False),
    ] = None,
    num_processes: Annotated[
        int, typer.Option("--num-processes", metavar="N", help="Plan per process of N data-parallel processes "
                          "(one per GPU), as `ppo train --num-processes N` runs.")
    ] = 1,
    sharding: Annotated[
        str, typer.Option("--sharding", metavar="none|zero2|zero3|fsdp", help="What the N processes split: none "
                          "(DDP: each holds everything), zero2 (gradients and AdamW states), zero3 or fsdp (also the "
                          "policy's and critic's weights; the policy is gathered whole for generation).")
    ] = "none",
) -> None:
    """Memory each role needs, from the model configs alone; if it does not fit, the changes that would fit.

    Counts weights, LoRA, gradients, optimizer states, activations and the KV cache, per role and phase."""
    from ppo_cli.recipe_loading import load_recipe

    from ppo_cli.commands.plan import check_sharding

    check_sharding(num_processes, sharding)
    resolved = load_recipe(recipe, overrides or ())
    from ppo_cli.commands.plan import render, set_args  # imports torch: only after the recipe is valid
    from ppo_cli.commands.plan import run as run_plan
    from ppo_cli.report import console
    from rich.console import Console

    result = run_plan(resolved, gpu_memory, processes=num_processes, sharding=sharding)
    # A console of this call's own: rich reads COLUMNS when a console is made, and the table's width is
    # the terminal's now, not the one it had when ppo_cli.report was first imported.
    Console(highlight=False).print(render(result))
    if result.suggestions:  # one unwrapped line to copy, whatever the terminal's width
        import shlex

        best = next((sug for sug in result.suggestions if sug.fits), result.suggestions[-1])
        argv = ["ppo", "train", str(recipe), *set_args([*(overrides or ()), *best.overrides])]
        console.print(f"to apply \"{best.change}\": {shlex.join(argv)}", soft_wrap=True, markup=False, highlight=False)
    if result.budget_gb is not None and not result.fits:
        from ppo_cli.errors import EXIT_DOES_NOT_FIT

        raise typer.Exit(EXIT_DOES_NOT_FIT)  # so that scripts can act on the verdict


# --- rollout / score / eval / compare: models on prompts, composed through JSONL files ----------

ModelArg = Annotated[
    str,
    typer.Argument(
        metavar="MODEL",
        help="base | aligned (of --run, default the latest run) | a run or checkpoint directory | "
        "a local model directory | a hub id.",
        show_default=False,
    ),
]
PromptsOpt = Annotated[
    Optional[Path],
    typer.Option("--prompts", help="Prompts: .txt (one per line), .jsonl, .parquet, .csv, .json, a dataset directory or a "
                 "hub dataset id. Default: the recipe's data.eval_prompts, else data.prompts.", show_default=False),
]
FieldOpt = Annotated[Optional[str], typer.Option("--field", help="Prompt column of .jsonl / dataset rows. Default: the recipe's data.field, else 'prompt', else 'messages'.", show_default=False)]
RunOpt = Annotated[
    Optional[Path],
    typer.Option("--run", help="Run directory that base/aligned refer to. Default: the run --recipe names "
                 "(output_dir/name) where it exists, else the most recently modified run under the recipe's "
                 "output_dir (runs/).", show_default=False),
]
RecipeOpt = Annotated[
    Optional[Path],
    typer.Option("--recipe", help="Recipe for the reward, tokenizer options and generation settings. "
                 "Default: the model's run's recipe.yaml.", show_default=False),
]
MaxNewTokensOpt = Annotated[Optional[int], typer.Option("--max-new-tokens", min=1, help="Override generation.max_new_tokens.", show_default=False)]
TemperatureOpt = Annotated[Optional[float], typer.Option("--temperature", help="Override generation.temperature (> 0).", show_default=False)]
SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Sampling seed. Default: the recipe's seed.", show_default=False)]
NumSamplesOpt = Annotated[int, typer.Option("--num-samples", min=1, help="Responses per prompt.")]
BatchSizeOpt = Annotated[
    Optional[int],
    typer.Option("--batch-size", min=1, help="Prompts per generation batch; it changes the sampled responses. Default: the recipe's "
                 "ppo.rollout_batch_size, as `ppo train` samples its held-out prompts.", show_default=False),
]


def _note(message: str) -> None:
    """The inference commands' side remarks (which recipe and models, skipped lines), dim on stderr."""
    from ppo_cli import report

    report.note(message)


@app.command()
def rollout(
    model: ModelArg,
    out: Annotated[Path, typer.Option("--out", help="Output JSONL file (written whole or not at all).", show_default=False)],
    prompts: PromptsOpt = None, field: FieldOpt = None, run: RunOpt = None, recipe: RecipeOpt = None,
    overrides: OverridesOpt = None, max_new_tokens: MaxNewTokensOpt = None, temperature: TemperatureOpt = None,
    seed: SeedOpt = None, num_samples: NumSamplesOpt = 1, batch_size: BatchSizeOpt = None,
    tokens: Annotated[bool, typer.Option("--tokens", help="Also write each row's token_ids (the prompt's and every "
                                         "token after it), loss_mask (1 where the policy's sampled token is trained) "
                                         "and logprobs (the policy's, where loss_mask is 1): what training sees.")] = False,
) -> None:
    """Sample responses from MODEL; one JSON object per (prompt, sample) in --out."""
    from ppo_cli.runs import check_output_path

    check_output_path(out)
    resolved, (model_ref,) = inputs.recipe_and_models([model], run, recipe, overrides, max_new_tokens, temperature, seed, note=_note)
    prompt_list, source, columns = inputs.command_prompts(prompts, field, resolved, _note)
    inputs.cut_prompts_notes(resolved, [model_ref], prompt_list, _note)
    from ppo_cli import report
    from ppo_cli.commands.rollout import run as run_rollout

    settings = inputs.sampling_settings(resolved, num_samples, batch_size)
    with report.progress_bar("rollout", len(prompt_list) * num_samples) as advance:
        result = run_rollout(resolved, model_ref, prompt_list, settings, out, progress=advance, columns=columns,
                             tokens=tokens)
    report.print_rollout(str(result.out), result.rows, result.prompts, result.model, result.env_failed, result.env_failure)


@app.command()
def score(
    rollouts: Annotated[Path, typer.Argument(metavar="ROLLOUTS", help="A JSONL file written by `ppo rollout`.", show_default=False)],
    out: Annotated[Optional[Path], typer.Option("--out", help="Output JSONL file. Default: ROLLOUTS with .scored.jsonl.", show_default=False)] = None,
    recipe: Annotated[Optional[Path], typer.Option(
        "--recipe", help="Recipe whose reward scores the rows. Default: the recipe.yaml of --run, else of the run "
        "whose model wrote ROLLOUTS, else of the most recently modified run under runs/.", show_default=False)] = None,
    run: Annotated[Optional[Path], typer.Option(
        "--run", help="Run directory whose recipe.yaml gives the reward (without --recipe).", show_default=False)] = None,
    overrides: OverridesOpt = None,
) -> None:
    """Add reward and reward_components (penalties included) to every row, with the recipe's reward."""
    from ppo_cli.commands.score import check_rollouts_file
    from ppo_cli.runs import check_output_path

    check_rollouts_file(rollouts)
    out = check_output_path(out or rollouts.with_name(rollouts.name.removesuffix(".jsonl") + ".scored.jsonl"))
    if recipe is None and run is None:
        recipe = inputs.recipe_of_rollouts(rollouts, _note)
    resolved, _ = inputs.recipe_and_models([], run, recipe, overrides, note=_note)
    from ppo_cli import report
    from ppo_cli.commands.score import run as run_score

    result = run_score(resolved, rollouts, out)
    report.print_score(str(result.out), result.rows, result.mean_reward, result.components, result.failed,
                       result.failure, result.weights, result.covered)


@app.command(name="eval")
def eval_(
    model: ModelArg, prompts: PromptsOpt = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="JSON summary file. Default: eval-<MODEL>.json in the model's run directory (base, aligned, a run's checkpoint), else in the current directory.", show_default=False)] = None,
    field: FieldOpt = None, run: RunOpt = None, recipe: RecipeOpt = None, overrides: OverridesOpt = None,
    max_new_tokens: MaxNewTokensOpt = None, temperature: TemperatureOpt = None, seed: SeedOpt = None,
    num_samples: NumSamplesOpt = 1, batch_size: BatchSizeOpt = None,
) -> None:
    """Sample, score and summarise MODEL: reward statistics, EOS rate, length, KL, distinct-n."""
    from ppo_cli.runs import check_output_path

    if out is not None:
        check_output_path(out)  # before anything loads
    resolved, (model_ref,) = inputs.recipe_and_models([model], run, recipe, overrides, max_new_tokens, temperature, seed, note=_note)
    # beside the run it measures: evaluating another run from the same directory replaces nothing of this one's
    out = check_output_path(out or Path(model_ref.run_dir or ".") / f"eval-{inputs.slug(model)}.json")
    replaced = out.exists()
    prompt_list, source, columns = inputs.command_prompts(prompts, field, resolved, _note)
    inputs.cut_prompts_notes(resolved, [model_ref], prompt_list, _note)
    from ppo_cli import report
    from ppo_cli.commands.eval import run as run_eval

    with report.progress_bar("eval", len(prompt_list) * num_samples) as advance:
        result = run_eval(resolved, model_ref, prompt_list, inputs.sampling_settings(resolved, num_samples, batch_size),
                          prompts_source=source, out=out, progress=advance, columns=columns)
    report.print_eval(result.summary, str(result.out), replaced)


@app.command()
def compare(
    model_a: Annotated[str, typer.Argument(metavar="A", help="First model (see MODEL in `ppo eval --help`), e.g. base.", show_default=False)],
    model_b: Annotated[str, typer.Argument(metavar="B", help="Second model, e.g. aligned.", show_default=False)],
    prompts: PromptsOpt = None,
    out: Annotated[Optional[Path], typer.Option("--out", help="Directory for compare.md, compare.json and rows.jsonl. Default: none written (the table only).", show_default=False)] = None,
    field: FieldOpt = None, run: RunOpt = None, recipe: RecipeOpt = None, overrides: OverridesOpt = None,
    max_new_tokens: MaxNewTokensOpt = None, temperature: TemperatureOpt = None, seed: SeedOpt = None,
    num_samples: NumSamplesOpt = 1, batch_size: BatchSizeOpt = None,
) -> None:
    """Both models on the same prompts and seed, side by side, with reward difference and win rate."""
    if out is not None and out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; compare writes a directory", hint="give a directory name, e.g. --out compare-out")
    resolved, models = inputs.recipe_and_models([model_a, model_b], run, recipe, overrides, max_new_tokens, temperature, seed,
                                               note=_note)
    prompt_list, source, columns = inputs.command_prompts(prompts, field, resolved, _note)
    inputs.cut_prompts_notes(resolved, models, prompt_list, _note)
    from ppo_cli import report
    from ppo_cli.commands.compare import run as run_compare

    with report.progress_bar("compare", 2 * len(prompt_list) * num_samples) as advance:
        result = run_compare(resolved, *models, prompt_list, inputs.sampling_settings(resolved, num_samples, batch_size),
                             prompts_source=source, out_dir=out, progress=advance, columns=columns)
    report.print_compare(result.a, result.b, result.difference, result.pairs, [str(f) for f in result.files])


def main(argv: list[str] | None = None) -> None:
    """The `ppo` console script. Errors are mapped to one line in ``_OneLineErrors``; this is the
    last resort for anything raised outside a subcommand."""
    args = _bare_resume(_debug_first(list(sys.argv[1:] if argv is None else argv)))
    from ppo_cli.engine.malloc import ask_torch_for_huge_pages

    ask_torch_for_huge_pages()  # before any command imports torch (engine/malloc.py)
    try:
        app(args=args, prog_name="ppo")
    except (Exception, KeyboardInterrupt) as err:
        if "--debug" in args or _env_debug():
            raise
        sys.exit(report_error(err))


def report_error(err: BaseException, resume: str | None = None) -> int:
    """Print ``err`` as one line (+ hint) on stderr; return the exit code for it. ``resume``: the `ppo train`
    line that continues the run, for hints that say to resume (errors.RESUME)."""
    if isinstance(err, PpoError):
        print_error(err.message, err.hint, resume, err.label)
        return err.exit_code
    if isinstance(err, KeyboardInterrupt):
        print_error("interrupted")
        return EXIT_INTERRUPTED
    if isinstance(err, BrokenPipeError) and stdout_reader_gone():
        return EXIT_STDOUT_CLOSED  # nothing to say: whoever would read it has gone, as after `| head`
    from ppo_cli.resource_errors import is_out_of_memory

    if is_out_of_memory(err):  # outside training's phases (loading, eval, compare): still not a bug
        print_error(f"out of memory: {first_line(err)}", "run `ppo plan RECIPE` to see what each role needs and what would fit")
        return EXIT_RUNTIME
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):  # e.g. appending to metrics.jsonl
        print_error(f"disk full: {first_line(err)}", f"free space on the output directory's disk, then resume ({RESUME})", resume)
        return EXIT_RUNTIME
    print_error(f"unexpected {type(err).__name__}: {first_line(err)}", BUG_HINT)
    return EXIT_RUNTIME


def stdout_reader_gone() -> bool:
    """stdout is a pipe whose reading end is closed (Linux's poll says POLLERR); then stdout is pointed
    at /dev/null, so that Python's last flush at exit does not print a second BrokenPipeError. A broken
    socket (a reward server's) is not this, and stays an error."""
    import os
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poller.poll(0))
        if gone:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return gone
    except (AttributeError, OSError, ValueError):  # no poll (Windows), or stdout is not a real file
        return False


def print_yaml(text: str) -> None:
    """YAML on stdout: highlighted on a terminal, plain (pipeable) otherwise."""
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.syntax import Syntax

        Console().print(Syntax(text, "yaml", background_color="default"))
    else:
        sys.stdout.write(text)


def _debug_first(args: list[str]) -> list[str]:
    """Accept `--debug` anywhere (`ppo validate r.yaml --debug`) by moving it before the command."""
    end = args.index("--") if "--" in args else len(args)
    if "--debug" in args[:end]:
        args = ["--debug"] + [a for i, a in enumerate(args) if a != "--debug" or i >= end]
    return args


def _bare_resume(args: list[str]) -> list[str]:
    """`ppo train r.yaml --resume` (no value) means the latest checkpoint: click options need a value."""
    out = []
    for i, arg in enumerate(args):
        out.append(arg)
        following = args[i + 1] if i + 1 < len(args) else None
        if arg == "--resume" and (following is None or following.startswith("-")):
            out.append("latest")
    return out


def _env_debug() -> bool:
    import os

    return os.environ.get("PPO_DEBUG", "").lower() in ("1", "true", "yes", "on")
