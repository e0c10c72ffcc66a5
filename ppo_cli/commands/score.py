"""`ppo score`: add the recipe's reward to every row of a rollouts file.

The reward is the training RewardStack (same components, weights and penalties). All rows are
scored in one call, so the reward models see the same batches every time: scoring a file twice, or
scoring what `ppo eval` sampled, gives the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ppo_cli.engine.data import prompt_from_value, read_jsonl_objects
from ppo_cli.errors import DataError
from ppo_cli.evaluation import env_failures, mean_step_reward, no_row_scored, score_rows, scored_mean
from ppo_cli.report import STEP_REWARDS
from ppo_cli.recipe import Recipe


@dataclass
class ScoreRunResult:
    out: Path
    rows: int
    mean_reward: float
    components: dict[str, float]  # name -> mean value over the rows it scored, before its weight
    failed: int = 0  # rows without a reward (a component failed to score them, or the episode's environment)
    failure: str | None = None  # the first reason one said
    weights: dict[str, float] = field(default_factory=dict)  # the components whose weight is not 1
    covered: dict[str, int] = field(default_factory=dict)  # the components that scored fewer rows than all: how many


ROLLOUTS_HINT = "a rollouts file has one JSON object per line, as `ppo rollout` writes"
MISSING_HINT = "give a file written by `ppo rollout MODEL --out FILE`"


def check_rollouts_file(path: Path) -> None:
    """A missing rollouts file, said before any recipe is looked for (the latest run's would be named for nothing)."""
    if not Path(path).exists():
        raise DataError(f"rollouts file not found: {path}", hint=MISSING_HINT)


def read_rollouts(path: Path, recipe: Recipe) -> list[dict]:
    """Rows of a rollouts JSONL file, each checked for the fields the recipe's reward needs."""
    path = Path(path)
    needed = {"prompt": (str, list), "response": str}
    if recipe.reward.missing_eos_penalty is not None:
        needed["finished"] = bool  # reward.missing_eos_penalty reads it
    if recipe.reward.max_response_tokens is not None or recipe.reward.overlong_buffer > 0:
        needed["response_tokens"] = int  # reward.max_response_tokens and reward.overlong_buffer read it
    rows = []
    for lineno, row in read_jsonl_objects(path, "rollouts file", ROLLOUTS_HINT, MISSING_HINT):
        for name, kind in needed.items():
            if name not in row:
                raise DataError(f"{path}:{lineno}: no '{name}' field (fields: {', '.join(sorted(row)) or 'none'})",
                                hint="score files written by `ppo rollout`")
            if not isinstance(row[name], kind) or (kind is int and isinstance(row[name], bool)):
                raise DataError(f"{path}:{lineno}: '{name}' must be {_KIND_NAMES[kind]}, got {type(row[name]).__name__}")
        prompt_from_value(row["prompt"], "prompt", f"{path}:{lineno}")  # a string or a conversation
        if not isinstance(row.get("columns", {}), dict):
            raise DataError(f"{path}:{lineno}: 'columns' must be an object of the prompt row's other fields, "
                            f"got {type(row['columns']).__name__}")
        rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows in this file", hint="write rollouts with `ppo rollout MODEL --out FILE`")
    return rows


_KIND_NAMES = {str: "a string", bool: "true or false", int: "an integer", (str, list): "a string or a list of messages"}


def run(recipe: Recipe, rollouts: Path, out: Path) -> ScoreRunResult:
    from ppo_cli.engine.inference import load_reward_stack
    from ppo_cli.runs import write_jsonl_atomic

    rows = read_rollouts(rollouts, recipe)
    columns = None
    if any("columns" in row for row in rows):  # `ppo rollout` kept its prompts' columns: the rewards get those
        from ppo_cli.engine.data import PromptColumns, PromptSet

        columns = PromptColumns([PromptSet([r["prompt"] for r in rows], columns=[r.get("columns", {}) for r in rows])])
    failures: list[str] = []  # each component's first failure (a server's answer, a function's None)
    stack = load_reward_stack(recipe, columns, str(rollouts))
    scored = score_rows(stack, rows, failures)
    if failures and all(r["reward"] is None for r in scored):
        raise no_row_scored(failures[0])
    write_jsonl_atomic(out, scored)
    names = list(scored[0]["reward_components"])
    components = {name: scored_mean([r["reward_components"][name] for r in scored]) for name in names}
    if "step_reward" in scored[0]:  # episodes of several turns: their reward adds the environment's step rewards
        components[STEP_REWARDS] = mean_step_reward(scored)
    failed = sum(r["reward"] is None for r in scored)
    why = failures[0] if failures else env_failures(scored)[1]
    weights = {name: weight for name, weight, _ in stack.scorers if weight != 1.0}
    covered = {name: n for name in names
               if (n := sum(r["reward_components"][name] is not None for r in scored)) < len(scored)}
    return ScoreRunResult(Path(out), len(scored), scored_mean([r["reward"] for r in scored]), components, failed, why,
                          weights, covered)
