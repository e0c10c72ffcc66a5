"""reward type function: a Python function of the prompts, the responses and the rows' other columns.

Called as ``fn(prompts, responses, **columns)`` where each of the prompt rows' other dataset columns
(e.g. ``answer``) is a keyword list aligned with the responses. A function is given the columns its
signature names, or all of them if it takes ``**kwargs``; one that takes neither gets
``(prompts, responses)``. A function written for TRL's GRPOTrainer, one with a parameter named
``completions`` (``def accuracy(completions, solution, **kwargs)``), is called as TRL calls it: by
keyword, ``fn(prompts=..., completions=..., **columns)`` (and ``responses=``, the texts, if it takes
them), each completion a string for a plain-text prompt and ``[{"role": "assistant", "content": ...}]``
for a conversation; TRL's ``completion_ids`` and
``trainer_state`` are not passed (a function that requires them is refused when it loads). Which
columns a function requires: function_columns.py. ``async def`` functions are awaited, together with
the recipe's other asynchronous components. A None in what it returns (or a NaN or an infinity) is
TRL's "this reward does not apply here": the completion's reward is the sum of the components that
scored it; a completion no component scored leaves the update and is counted (reward/failed_rate),
as one a reward server failed to score does.
"""

from __future__ import annotations

import copy
import inspect
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ppo_cli.engine.rewards.function_columns import (NOT_PASSED, accepted_columns, called_like_trl, columns_required,
                                                     columns_taken, declared_parameters, declared_positional, is_trl_style,
                                                     missing_columns_error, per_row_error, positional_parameters,
                                                     required_columns, signature_parameters, unpassed_arguments_error)
from ppo_cli.engine.data import ambiguous_prompt
from ppo_cli.engine.user_code import import_named
from ppo_cli.errors import RewardFunctionError, RewardFunctionFailed
from ppo_cli.recipe import FunctionReward

if TYPE_CHECKING:
    from ppo_cli.engine.data import PromptSet


def check(component: FunctionReward, contact_servers: bool = True, import_functions: bool = False) -> None:
    """``import_functions`` (train): the module is imported, so an import error shows now. Else (validate)
    the file exists and defines the name: read, not run."""
    if import_functions:
        load_reward_function(component.function)
        return
    target, _, name = component.function.rpartition(":")
    if not target.endswith(".py"):
        return
    path = Path(target)
    if not path.is_file():
        raise RewardFunctionError(f"reward function file not found: {target}", hint="paths are relative to the current directory")
    check_defines(path, name)


def check_defines(path: Path, name: str) -> None:
    import ast
    import difflib

    from ppo_cli.engine.user_code import defined_names, last_binding

    defined = defined_names(path, RewardFunctionError,
                            f"fix the reward function's file; python -m py_compile {path} shows the error in full")
    if defined is not None and name not in defined:
        close = difflib.get_close_matches(name, sorted(defined), n=1)
        define = f"define def {name}(prompts, responses) -> list[float]"
        functions = [n for n in sorted(defined) if isinstance(last_binding(path, n), (ast.FunctionDef, ast.AsyncFunctionDef))]
        hint = (f"did you mean '{close[0]}'?" if close else
                f"it defines {', '.join(functions)}: name one of them, or {define}" if functions else define)
        raise RewardFunctionError(f"'{path}' has no function '{name}'", hint=hint)


def check_columns(component: FunctionReward, rows: list[tuple[str, PromptSet]], given: set[str] = frozenset(),
                  import_functions: bool = False) -> None:
    """Before any model loads: one line for a column the function takes that the rows of a prompts source
    (``rows``: (source, its PromptSet) pairs) lack; ``given``: the columns every row gets besides (an episode's
    ``messages``). The signature is the imported function's (``import_functions``: train) or its file's
    source (validate: read, not run); one the source does not say (a module, an assigned name) is checked
    when scoring. A function written per row (verl's compute_score) is refused first: the column it seems
    to lack (ground_truth) is not what is wrong with it."""
    required, reads, positional = _what_it_takes(component, import_functions)
    for _, prompt_set in rows:
        error = per_row_error(component.function, positional, prompt_set.column_names | given)
        if error is not None:
            raise error
    if reads:  # its rows' columns are found by the prompt (engine/data.PromptColumns): refused now, not mid-run
        ambiguous = ambiguous_prompt(rows)
        if ambiguous is not None:
            raise ambiguous
    if not required:
        return
    for source, prompt_set in rows:
        names = prompt_set.column_names | given
        missing = sorted(required - names)
        if missing:
            fields = names | ({prompt_set.column} if prompt_set.column else set())
            raise missing_columns_error(component.function, missing, f"the rows of {source}", fields)


def _what_it_takes(component: FunctionReward, import_functions: bool) -> tuple[set[str] | None, bool, list[str]]:
    """The columns the function cannot do without (None: the source does not say), whether it reads any, and
    its positional parameters ([] for one called by keyword, like TRL's): from the imported function
    (``import_functions``) or its file's source."""
    if import_functions:
        fn = load_reward_function(component.function)
        taken = accepted_columns(fn)
        return required_columns(fn), taken is None or bool(taken), [] if called_like_trl(fn) else positional_parameters(fn)
    target, _, name = component.function.rpartition(":")
    parameters = declared_parameters(Path(target), name) if target.endswith(".py") else None
    if parameters is None:
        return None, False, []
    error = unpassed_arguments_error(component.function, parameters)  # what load_reward_function refuses at train
    if error is not None:
        raise error
    positional = [] if is_trl_style(parameter for parameter, _ in parameters) else declared_positional(Path(target), name)
    return columns_required(parameters), bool(columns_taken(parameters)), positional


def display_name(component: FunctionReward) -> str:
    return component.function.rpartition(":")[2]


def load_reward_function(spec: str) -> Callable:
    """Import 'package.module:name' or 'path/to/file.py:name' (engine/user_code.py) and check it takes
    (prompts, responses), or TRL's keywords (called_like_trl)."""
    target, _, name = spec.rpartition(":")
    define = f"define def {name}(prompts, responses) -> list[float]"
    fn = import_named(spec, "reward function", RewardFunctionError, kind="function", define=define)
    if not callable(fn):
        raise RewardFunctionError(f"'{target}' has no function '{name}'",
                                  hint=f"'{name}' there is a {type(fn).__name__}; {define}")
    if called_like_trl(fn):
        error = unpassed_arguments_error(spec, signature_parameters(fn))
        if error is not None:
            raise error
        return fn
    try:
        inspect.signature(fn).bind_partial(["p"], ["r"])  # further parameters are dataset columns
    except TypeError:
        raise RewardFunctionError(
            f"reward function '{spec}' must take two arguments (prompts, responses), or be written for TRL "
            "(a parameter named completions, called by keyword)",
            hint=f"def {name}(prompts: list[str], responses: list[str], **columns) -> list[float], "
                 f"or def {name}(completions, **kwargs) -> list[float]",
        ) from None
    return fn


def as_completions(prompts: list, responses: list[str]) -> list:
    """TRL's ``completions``: the response text for a plain-text prompt, one assistant message for a
    conversation."""
    return [[{"role": "assistant", "content": r}] if isinstance(p, list) else r for p, r in zip(prompts, responses)]


class FunctionScorer:
    def __init__(self, component: FunctionReward, device=None, system_prompt: str | None = None):
        self.spec = component.function
        self.fn = load_reward_function(component.function)
        self.columns = accepted_columns(self.fn)
        self.like_trl = called_like_trl(self.fn)
        self.parameters = set(inspect.signature(self.fn).parameters)
        self.reads_columns = self.columns is None or bool(self.columns)
        self.failure: str | None = None
        self.skips_none = True  # a None is TRL's "does not apply here" (RewardStack: combine_components)
        self.where = f"reward function '{self.spec}'"
        if inspect.iscoroutinefunction(self.fn):
            self.ascore = self._ascore

    def check_columns(self, names: set[str], rows: str, fields: set[str] | None = None) -> None:
        """``names``: the columns the rows have; ``fields``: what they show (with the prompt column), if known."""
        per_row = None if self.like_trl else per_row_error(self.spec, positional_parameters(self.fn), names)
        if per_row is not None:
            raise per_row
        missing = sorted(required_columns(self.fn) - names)
        if missing:
            raise missing_columns_error(self.spec, missing, rows, names if fields is None else fields)

    def _arguments(self, prompts: list, responses: list[str], columns: dict[str, list] | None) -> tuple[tuple, dict]:
        """``prompts`` as the data has them, like TRL's reward functions: strings for plain-text rows,
        lists of {role, content} for conversations (without data.system_prompt); copies, so the
        function cannot change the rollout's prompts. By keyword for a function called like TRL's."""
        columns = columns or {}
        self.check_columns(set(columns), "the prompt rows")
        chosen = columns if self.columns is None else {k: v for k, v in columns.items() if k in self.columns}
        prompts, responses, chosen = copy.deepcopy(list(prompts)), list(responses), copy.deepcopy(chosen)
        if not self.like_trl:
            return (prompts, responses), chosen
        passed = {"prompts": prompts, "completions": as_completions(prompts, responses), "responses": responses}
        if self.columns is not None:  # no **kwargs: only the names it has
            passed = {k: v for k, v in passed.items() if k in self.parameters}
        return (), {**passed, **chosen}

    def __call__(self, prompts: list, responses: list[str], columns: dict[str, list] | None = None) -> list[float | None]:
        args, kwargs = self._arguments(prompts, responses, columns)
        try:
            values = self.fn(*args, **kwargs)
        except Exception as err:
            raise self._raised(err) from err
        return self._checked(values, len(responses))

    async def _ascore(self, prompts: list, responses: list[str], columns: dict[str, list] | None = None) -> list[float | None]:
        args, kwargs = self._arguments(prompts, responses, columns)
        try:
            values = await self.fn(*args, **kwargs)
        except Exception as err:
            raise self._raised(err) from err
        return self._checked(values, len(responses))

    def _raised(self, err: Exception) -> RewardFunctionFailed:
        hint = "fix the function; run again with --debug for its traceback"
        if isinstance(err, KeyError) and err.args and err.args[0] in NOT_PASSED:  # kwargs["log_metric"] in TRL's style
            hint = f"ppo_cli does not pass TRL's {err.args[0]}: read it with kwargs.get('{err.args[0]}') and skip it when None"
        return RewardFunctionFailed(f"reward function '{self.spec}' raised {type(err).__name__}: {err}", hint=hint)

    def _checked(self, values, count: int) -> list[float | None]:
        one_each = "return a list with one number (or None) per response, in the order given"
        if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
            raise RewardFunctionError(f"reward function '{self.spec}' returned {type(values).__name__}, not a list of numbers",
                                      hint=one_each)
        values = list(values)
        text = next((i for i, v in enumerate(values) if isinstance(v, (str, bytes))), None)
        if text is not None:  # float("0.5") would pass: a string here is a bug in the function, not a score
            raise RewardFunctionError(f"reward function '{self.spec}' returned the string {values[text]!r} for response "
                                      f"{text + 1}, not a number", hint=one_each)
        try:
            values = [None if v is None else float(v) for v in values]
        except (TypeError, ValueError):
            raise RewardFunctionError(f"reward function '{self.spec}' must return a list of numbers", hint=one_each) from None
        if len(values) != count:
            raise RewardFunctionError(f"reward function '{self.spec}' returned {len(values)} value{'s' * (len(values) != 1)} "
                                      f"for {count} response{'s' * (count != 1)}", hint=one_each)
        missing = sum(v is None for v in values)
        not_finite = sum(v is not None and not math.isfinite(v) for v in values)
        if missing or not_finite:
            said = " and ".join(f"{what} for {n}" for what, n in (("None", missing), ("NaN or inf", not_finite)) if n)
            self.failure = f"reward function '{self.spec}' returned {said} of {count} responses"
        return [v if v is not None and math.isfinite(v) else None for v in values]


Scorer = FunctionScorer
