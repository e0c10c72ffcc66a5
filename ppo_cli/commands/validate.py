"""`ppo validate`: the resolved recipe, the sizes derived from it, and the files it names. Imports no torch
unless a LoRA lists its target_modules (check_lora_targets)."""

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


def check_recipe_files(recipe: Recipe, import_functions: bool = False) -> tuple[list[str], list[str]]:
    """The one check before any model loads, for `ppo validate` and `ppo train` alike: prompts files
    (readable, not empty), model paths (a saved model, or a hub id), each reward component's files,
    that each reward server and judge answers (and an http environment's server: one episode reset and
    closed), and that the prompts' rows (held-out ones too) have the
    columns each reward function takes (engine/rewards/checks.py). Returns the prompts and the
    held-out prompts. A reward function's module is imported (its code runs) only with
    ``import_functions``: when training asks for it, not when a recipe is validated."""
    from ppo_cli.engine.data import check_reward_reads_conversations, read_recipe_prompts
    from ppo_cli.errors import ModelReferenceError, naming_field
    from ppo_cli.model_refs import check_adapter_reference, check_model_reference
    from ppo_cli.engine.rewards.checks import check_reward_columns, check_reward_components

    rows = [(str(recipe.data.prompts), read_recipe_prompts(recipe.data))]
    if recipe.data.eval_prompts:  # held-out prompts are scored with the same reward
        rows.append((str(recipe.data.eval_prompts), read_recipe_prompts(recipe.data, "eval_prompts")))
    prompts = rows[0][1].prompts
    eval_prompts = rows[1][1].prompts if recipe.data.eval_prompts else []
    check_reward_reads_conversations(recipe.reward, prompts + eval_prompts)
    check_policy_chat_template(recipe, prompts + eval_prompts)
    for key, path in (("policy.path", recipe.policy.path), ("reference.path", recipe.reference.path),
                      ("value.path", recipe.value.path)):
        if path:
            with naming_field(key, (ModelReferenceError,)):
                check_model_reference(path)
    if recipe.policy.adapter:
        check_adapter_reference(recipe.policy.adapter)
    check_reward_components(recipe.reward, import_functions=import_functions)  # files, credentials, servers
    # an episode's transcript is a column too, with an environment (Engine.episode_columns)
    given = {"messages"} if recipe.environment is not None else set()
    check_reward_columns(recipe.reward, rows, given, import_functions=import_functions)
    if recipe.environment is not None:
        from ppo_cli.model_refs import has_chat_template

        if has_chat_template(recipe.policy.path) is False:  # read from its files: before any model loads
            from ppo_cli.engine.envs.episode import no_chat_template_error

            raise no_chat_template_error(recipe.policy.path)
        first_columns = rows[0][1].columns
        first_row = first_columns[0] if first_columns else {}  # what a probe episode resets on
        check_environment_code(recipe.environment, import_code=import_functions, row=first_row)
        if recipe.environment.type == "http":
            from ppo_cli.engine.envs.environments import check_server

            check_server(recipe.environment, first_row)
    check_lora_targets(recipe)
    return prompts, eval_prompts


def check_policy_chat_template(recipe: Recipe, prompts: list) -> None:
    """Prompts that go through a chat template, for a policy whose tokenizer files define none: the
    error encode_prompt would raise once the models are loaded, now, from the files."""
    from ppo_cli.engine.chat import NO_TEMPLATE_HINT, PROMPTS_NEED_TEMPLATE, needs_chat_template
    from ppo_cli.errors import DataError
    from ppo_cli.model_refs import has_chat_template

    if recipe.environment is None and needs_chat_template(prompts, recipe.data) and has_chat_template(recipe.policy.path) is False:
        raise DataError(f"{PROMPTS_NEED_TEMPLATE} but the tokenizer of {recipe.policy.path} has no chat template",
                        hint=NO_TEMPLATE_HINT)


def check_environment_code(environment, import_code: bool = False, row: dict | None = None) -> None:
    """The files of the environment's tools (type tools) or class (type python). ``import_code`` (train):
    imported and checked as the engine will (schemas, reset and step; a class is built and reset once on
    ``row``), so a missing or unusable one is one line before any model loads, not after. Else (validate):
    each file is there and defines the name, and what its source shows train would refuse
    (engine/envs/source_checks.py), read, not run, as for reward functions."""
    import difflib

    from ppo_cli.engine.envs.source_checks import check_environment_class_source, check_tool_source
    from ppo_cli.engine.user_code import defined_names, last_binding
    from ppo_cli.errors import EnvironmentSetupError

    if import_code:
        from ppo_cli.engine.envs.environments import EnvironmentFactory, check_python_environment

        if environment.type == "python" and row is not None:
            check_python_environment(environment, row)  # imports the class, builds one and resets it
        else:
            EnvironmentFactory(environment)  # imports the tools or the class; the engine builds its own
        return
    what = "tool" if environment.type == "tools" else "environment class"
    specs = environment.tools if environment.type == "tools" else [environment.class_] if environment.type == "python" else []
    for spec in specs:
        target, _, name = spec.rpartition(":")
        if not target.endswith(".py"):
            continue  # a module: imported when training
        path = Path(target)
        if not path.is_file():
            raise EnvironmentSetupError(f"{what} file not found: {target}",
                                        hint=f"paths are relative to the current directory ({Path.cwd()})")
        defined = defined_names(path, EnvironmentSetupError, f"python -m py_compile {path} shows the error in full")
        if defined is None:
            continue  # importing it says what is wrong, when training
        if name not in defined:
            close = difflib.get_close_matches(name, sorted(defined), n=1)
            hint = f"did you mean '{close[0]}'?" if close else (
                f"define {name} in {target}" if environment.type == "tools"
                else f"define class {name} with reset(self, row, seed) and step(self, message)")
            raise EnvironmentSetupError(f"'{target}' has no {what} '{name}'", hint=hint)
        if environment.type == "tools":  # what loading it at train would refuse, from the source
            check_tool_source(spec, last_binding(path, name))
        else:
            check_environment_class_source(spec, last_binding(path, name), environment.kwargs)


def check_lora_targets(recipe: Recipe) -> None:
    """Every module a LoRA's target_modules lists is in the policy (peft fails on none found, and adapts
    fewer layers than asked when some are), read from a meta-device model of its config: no weights. The
    value adapter sits on the policy's base too."""
    from ppo_cli.errors import RecipeError

    loras = [("policy.lora", recipe.policy.lora)] + ([("value.lora", recipe.value.lora)] if value_kind(recipe) == "adapter" else [])
    listed = [(key, lora.target_modules) for key, lora in loras if lora is not None and lora.target_modules != "all-linear"]
    if not listed:
        return
    from ppo_cli.plan_memory import describe_model  # imports torch

    pol = recipe.policy
    shape = describe_model(pol.path, "causal_lm", trust_remote_code=pol.trust_remote_code, revision=pol.revision)
    for key, targets in listed:
        if missing := shape.unmatched_targets(targets):
            raise RecipeError(f"{key}.target_modules: {', '.join(missing)} not found in {pol.path}; its linear modules "
                              f"are {', '.join(shape.linear_names)}",
                              hint=f"set {key}.target_modules to some of them, or to all-linear")


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
