"""Which dataset columns a reward function cannot do without, and the line that says the rows lack them.

One rule (``columns_required``) over a function's parameters, read from the imported function
(``required_columns``: train, scoring) or from its file's source without running it
(``declared_parameters`` / ``declared_columns``: validate). A function is called ``fn(prompts, responses, **columns)``, so its
columns are its parameters after the first two; a TRL-style function, one with a ``completions``
parameter, is given everything by keyword, so its columns are its parameters but TRL's own names.
Only parameters without a default count, never ``*args`` / ``**kwargs``. ``accepted_columns``: the
columns a function is given, by the same rule. ``per_row_error``: a function whose first or second
parameter is named like a row's value (verl's per-row ``compute_score(data_source, solution_str, ...)``),
which the lists of prompts and responses would reach.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Callable

from ppo_cli.engine.user_code import last_binding
from ppo_cli.errors import RewardFunctionError

# What TRL passes its reward functions besides the dataset's columns (trl GRPOTrainer._calculate_rewards),
# and ppo_cli's own name for the completions' text; ppo_cli passes all but NOT_PASSED.
TRL_ARGUMENTS = frozenset({"prompts", "completions", "responses", "completion_ids", "trainer_state"})
# verl's per-row reward function, compute_score(data_source, solution_str, ground_truth, extra_info=None)
# (verl/utils/reward_score): one of these names first or second says a function takes one row's values.
VERL_ROW_NAMES = frozenset({"data_source", "solution_str", "ground_truth", "extra_info"})
VERL_FIRST_NAMES = frozenset({"data_source", "solution_str"})  # its first two: the hint wraps a verl function
# TRL's GRPOTrainer passes these too: the token ids, its TrainerState, and (TRL 1.16) two logging callbacks.
NOT_PASSED = frozenset({"completion_ids", "trainer_state", "log_metric", "log_extra"})


def is_trl_style(names) -> bool:
    """A function written for TRL's GRPOTrainer: one of its parameters is named ``completions``."""
    return "completions" in names


def called_like_trl(fn: Callable) -> bool:
    return is_trl_style(inspect.signature(fn).parameters)


def columns_required(parameters: list[tuple[str, bool]]) -> set[str]:
    """``parameters``: (name, required) in signature order, *args and **kwargs included as not required."""
    if is_trl_style(name for name, _ in parameters):
        return {name for name, required in parameters if required and name not in TRL_ARGUMENTS}
    return {name for name, required in parameters[2:] if required}


def columns_taken(parameters: list[tuple[str, bool]]) -> set[str]:
    """Every name past the prompts and responses (TRL's arguments) that a function of these (name,
    required) parameters may be given a column by, a **kwargs included (by its own name)."""
    if is_trl_style(name for name, _ in parameters):
        return {name for name, _ in parameters} - TRL_ARGUMENTS
    return {name for name, _ in parameters[2:]}


def required_parameters(fn: Callable) -> list[str]:
    """``fn``'s parameters without a default, *args and **kwargs aside."""
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.default is p.empty and p.kind not in variadic]


def accepted_columns(fn: Callable) -> set[str] | None:
    """The keyword names ``fn`` takes past (prompts, responses), or past TRL's; None when it takes
    ``**kwargs`` (all)."""
    parameters = list(inspect.signature(fn).parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    if called_like_trl(fn):
        return {p.name for p in parameters if p.kind is not p.VAR_POSITIONAL} - TRL_ARGUMENTS
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return {p.name for p in positional[2:]} | {p.name for p in parameters if p.kind is p.KEYWORD_ONLY}


def signature_parameters(fn: Callable) -> list[tuple[str, bool]]:
    """(name, required) of the imported function ``fn``, as declared_parameters reads them from a source."""
    required = set(required_parameters(fn))
    return [(name, name in required) for name in inspect.signature(fn).parameters]


def required_columns(fn: Callable) -> set[str]:
    """The columns the imported function ``fn`` cannot do without."""
    return columns_required(signature_parameters(fn))


def declared_parameters(path: Path, name: str) -> list[tuple[str, bool]] | None:
    """(name, required) of the function ``name`` of the file ``path``, read, not run; None when the source
    does not say: the file does not parse, or ``name`` is last bound at its top level by something other
    than an undecorated ``def`` (an assignment, an import, a decorator that may change the signature).
    Scoring checks those."""
    function = _declared_function(path, name)
    return None if function is None else _parameters(function.args)


def declared_positional(path: Path, name: str) -> list[str] | None:
    """The positional parameters of the function ``name`` of the file ``path``, read as declared_parameters
    reads them."""
    function = _declared_function(path, name)
    return None if function is None else [arg.arg for arg in function.args.posonlyargs + function.args.args]


def positional_parameters(fn: Callable) -> list[str]:
    """The imported function ``fn``'s positional parameters, in order."""
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in positional]


def _declared_function(path: Path, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    function = last_binding(path, name)
    if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or function.decorator_list:
        return None
    return function


def declared_columns(path: Path, name: str) -> set[str] | None:
    """The columns the function ``name`` of the file ``path`` cannot do without (declared_parameters)."""
    parameters = declared_parameters(path, name)
    return None if parameters is None else columns_required(parameters)


def unpassed_arguments_error(spec: str, parameters: list[tuple[str, bool]]) -> RewardFunctionError | None:
    """A TRL-style function that requires what ppo_cli does not pass (NOT_PASSED), from its (name,
    required) parameters: the same line from the imported function (train) and its source (validate)."""
    if not is_trl_style(name for name, _ in parameters):
        return None
    unpassed = sorted({name for name, required in parameters if required} & NOT_PASSED)
    if not unpassed:
        return None
    return RewardFunctionError(
        f"reward function '{spec}' requires {', '.join(unpassed)}, which ppo_cli does not pass "
        "(it passes prompts, completions and the rows' columns, by keyword)",
        hint=f"give {', '.join(unpassed)} a default (=None), or drop {'it' if len(unpassed) == 1 else 'them'} "
             "and take **kwargs (kwargs.get(...) is None here)")


def _parameters(args: ast.arguments) -> list[tuple[str, bool]]:
    """(name, required) in the order inspect.signature lists them."""
    positional = args.posonlyargs + args.args
    first_default = len(positional) - len(args.defaults)  # defaults belong to the last positional parameters
    parameters = [(arg.arg, index < first_default) for index, arg in enumerate(positional)]
    parameters += [(args.vararg.arg, False)] if args.vararg else []
    parameters += [(arg.arg, default is None) for arg, default in zip(args.kwonlyargs, args.kw_defaults)]
    return parameters + ([(args.kwarg.arg, False)] if args.kwarg else [])


def missing_columns_error(spec: str, missing: list[str], rows: str, fields: set[str]) -> RewardFunctionError:
    """``rows``: which rows, e.g. "the rows of data/train.jsonl"; ``fields``: what they have (the prompt
    column included where known: a missing column among them is the prompt's, which is not passed by name)."""
    prompt_column = [name for name in missing if name in fields]
    hint = (f"'{prompt_column[0]}' is the prompt column: the function gets it as its first argument (prompts)"
            if prompt_column else "use a .jsonl or dataset whose rows carry them (each row's other fields are its columns)")
    return RewardFunctionError(
        f"reward function '{spec}' takes the column(s) {', '.join(missing)}, which {rows} do not have "
        f"(they have: {', '.join(sorted(fields)) or 'none'})",
        hint=hint,
    )


def per_row_error(spec: str, positional: list[str], columns: set[str]) -> RewardFunctionError | None:
    """A function written per row, its first or second positional parameter named like one row's value:
    verl's compute_score(data_source, solution_str, ground_truth, extra_info), or a column of the rows
    (``columns``). ppo passes the lists of prompts and responses there, so it would fail inside its own
    code, or score the wrong text. The same line from the imported function (train) and its source (validate)."""
    named = [(parameter, given) for parameter, given in zip(positional, ("prompts", "responses"))
             if parameter in columns or parameter in VERL_ROW_NAMES]
    if not named:
        return None
    target, _, name = spec.rpartition(":")
    listed = " and ".join(parameter for parameter, _ in named)
    gets = " and ".join(f"{parameter} would get the list of {given}" if index == 0 else f"{parameter} the list of {given}"
                        for index, (parameter, given) in enumerate(named))
    if set(positional[:2]) & VERL_FIRST_NAMES:
        like, hint = "as verl's per-row compute_score(data_source, solution_str, ground_truth, extra_info) does", \
            _verl_wrapper(target, name, columns)
    else:
        like = "like a column" if len(named) == 1 else "like columns"
        hint = ("take the lists and return one value per response, in order: "
                f"def {name}(prompts, responses, {', '.join(p for p, _ in named)}, **columns) -> list[float]")
    return RewardFunctionError(
        f"reward function '{spec}' names its parameter{'s' * (len(named) > 1)} {listed} {like}: "
        f"ppo calls reward functions batched, f(prompts, responses, **columns) -> list, so {gets}",
        hint=hint)


def _verl_wrapper(target: str, name: str, columns: set[str]) -> str:
    """Three lines that call verl's per-row ``name`` once per response: the row's ground truth from a
    ``ground_truth`` column, else from verl's ``reward_model`` struct (its parquet files' layout)."""
    column, truth = ("ground_truth", "g") if "ground_truth" in columns else ("reward_model", 'g["ground_truth"]')
    batched = f"{name}_batched"
    return (f"add this wrapper to {target} and name it in the recipe (function: {target}:{batched}):\n"
            f"    def {batched}(prompts, responses, {column}, data_source=None, extra_info=None):\n"
            f"        rows = zip(data_source or [None] * len(responses), responses, {column}, extra_info or [None] * len(responses))\n"
            f"        return [{name}(d, r, {truth}, e) for d, r, g, e in rows]")
