"""`ppo validate`: the resolved recipe, the sizes derived from it, and the files it names. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ppo_cli.auto import value_kind
from ppo_cli.recipe import Recipe
from ppo_cli.recipe_loading import dump_resolved


@dataclass(frozen=True)
class ValidateResult:
    resolved_yaml: str  # every default filled in; what `ppo train` writes to runs/<name>/recipe.yaml
    run_dir: Path
    num_mini_batches: int  # optimizer steps per PPO epoch
    grad_accum_steps: int  # micro-batches per optimizer step
    value_kind: str  # 'auto' resolved: adapter / head / model / none

    @property
    def summary(self) -> str:
        return (
            f"valid: run directory {self.run_dir}; num_mini_batches={self.num_mini_batches}, "
            f"grad_accum_steps={self.grad_accum_steps}, value kind={self.value_kind}"
        )


def check_recipe_files(recipe: Recipe) -> None:
    """The files the recipe names, as `ppo train` checks them before loading anything: prompts files
    (readable, not empty), model paths (a saved model, or a hub id), reward function files. A
    reward function is not imported here: its module's code runs only when training asks for it."""
    from ppo_cli.engine.data import check_reward_reads_conversations, read_recipe_prompts
    from ppo_cli.errors import DataError, RewardFunctionError
    from ppo_cli.model_refs import check_adapter_reference, check_model_reference, has_chat_template

    for which in ("prompts", "eval_prompts"):
        if getattr(recipe.data, which):
            check_reward_reads_conversations(recipe.reward, read_recipe_prompts(recipe.data, which).prompts)
    for path in (recipe.policy.path, recipe.reference.path, recipe.value.path):
        if path:
            check_model_reference(path)
    if recipe.policy.adapter:
        check_adapter_reference(recipe.policy.adapter)
    for component in recipe.reward.components:
        if component.type != "function":
            check_model_reference(component.path)
            if component.text == "conversation" and has_chat_template(component.path) is False:
                raise DataError(
                    f"reward component '{component.path}' reads text: conversation but its tokenizer has no chat template",
                    hint="use a reward model whose tokenizer has a chat template, or text: prompt_and_response / response",
                )
            continue
        target, _, name = component.function.rpartition(":")
        if target.endswith(".py") and not Path(target).is_file():
            raise RewardFunctionError(f"reward function file not found: {target}", hint="paths are relative to the current directory")
        if target.endswith(".py"):
            _check_defines(Path(target), name)


def _check_defines(path: Path, name: str) -> None:
    """The file defines ``name`` at its top level: read, not run (its code runs only when training)."""
    import ast
    import difflib

    from ppo_cli.errors import RewardFunctionError

    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return  # importing it says what is wrong, when training
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    defined |= {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
    defined |= {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom) for a in node.names}
    if name not in defined:
        close = difflib.get_close_matches(name, sorted(defined), n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"define def {name}(prompts, responses) -> list[float]"
        raise RewardFunctionError(f"'{path}' has no function '{name}'", hint=hint)


def run(recipe: Recipe, check_files: bool = True) -> ValidateResult:
    if check_files:
        check_recipe_files(recipe)
    return ValidateResult(
        resolved_yaml=dump_resolved(recipe),
        run_dir=recipe.run_dir,
        num_mini_batches=recipe.num_mini_batches,
        grad_accum_steps=recipe.ppo.grad_accum_steps,
        value_kind=value_kind(recipe),
    )
