"""What the inference commands (rollout, score, eval, compare) read before they run: the recipe (theirs,
or the run's of the models they name), the models, the prompts and the sampling settings.

No torch import: the CLI calls these before any model loads, so bad input fails at once. Nothing is
printed here: the side remarks (which recipe, which models, skipped lines) go to the ``note(message)``
callback the CLI passes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ppo_cli.errors import UsageError


def recipe_of_rollouts(rollouts: Path, note: Callable[[str], None]) -> Path | None:
    """The recipe of the run whose model wrote the rollouts (its rows' model_path), if it is one;
    otherwise None, and the usual default (the latest run's) applies."""
    import json

    from ppo_cli.errors import PpoError
    from ppo_cli.model_refs import resolve_model_reference

    try:
        with open(rollouts, encoding="utf-8") as f:
            model_path = str(json.loads(next((line for line in f if line.strip()), "{}"))["model_path"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the file is checked, with a clear error, when it is read
    try:
        return resolve_model_reference(model_path).recipe_path
    except PpoError:
        note(f"the rollouts' model {model_path} is not found from here, so its run's recipe is not used")
        return None


def recipe_and_models(refs, run, recipe_path, overrides, max_new_tokens=None, temperature=None, seed=None, *,
                      note: Callable[[str], None]):
    """Load the recipe (--recipe, else the models' run's) with the flags applied, and resolve the models."""
    from ppo_cli.model_refs import MODEL_ALIASES, recipe_for_models, resolve_model_reference
    from ppo_cli.recipe_loading import load_recipe

    if temperature is not None and not temperature > 0:
        raise UsageError(f"--temperature must be > 0, got {temperature:g}", hint="sampling needs a positive temperature; 1.0 samples as trained")
    flags = {"generation.max_new_tokens": max_new_tokens, "generation.temperature": temperature, "seed": seed}
    sets = [*(overrides or ()), *(f"{key}={value}" for key, value in flags.items() if value is not None)]
    loaded = load_recipe(recipe_path, sets) if recipe_path is not None else None
    root = loaded.output_dir if loaded is not None else "runs"
    if run is None and loaded is not None and any(ref in MODEL_ALIASES for ref in refs):
        from ppo_cli.runs import RunDir

        if RunDir(loaded.run_dir).is_run():  # base / aligned of the run --recipe names, where it has run
            run = loaded.run_dir
    models = [resolve_model_reference(ref, run, output_root=root) for ref in refs]
    if loaded is None:
        recipe_path = recipe_for_models(models, run, output_root=root)
        loaded = load_recipe(recipe_path, sets)
    check_policy_override(sets, loaded.policy.path, models)
    note(f"recipe: {recipe_path}")
    for model in models:
        note(f"model: {model.describe()}")
    if models:  # before the reward model or any policy loads
        check_vllm_backend(loaded, models=models)
    check_environment(loaded)
    return loaded, models


def check_policy_override(sets: list[str], override: str, models) -> None:
    """--set policy.path (``override``, as the loaded recipe has it) names a model, but `base` and `aligned`
    are a run's, which it cannot change: refused in one line rather than sampling the run's model while
    the user thinks it is theirs. ``sets``: the --set items, already checked by load_recipe."""
    from ppo_cli.recipe_loading import _parse_override

    if not any(_parse_override(item)[0] == ["policy", "path"] for item in sets):
        return
    for model in models:
        if model.kind in ("base", "aligned") and Path(model.base_path).resolve() != Path(override).resolve():
            raise UsageError(
                f"--set policy.path={override} does not change `{model.reference}`: that is run {model.run_dir}'s "
                f"model, trained from {model.base_path}",
                hint=f"to sample {override}, pass it as MODEL in place of `{model.reference}`; for the run's "
                     f"`{model.reference}`, drop the --set",
            )


def check_vllm_backend(recipe, world_size: int = 1, models=()) -> None:
    """generation.backend vllm, refused in one line before anything loads: more than one process
    (``world_size``: --num-processes, or WORLD_SIZE as the launcher sets it), vllm not installed, or a
    model (``models``: ResolvedModel) it would not sample as transformers does. Every command's check."""
    if recipe.generation.backend == "vllm_server":
        from ppo_cli.engine.vllm_server_sampler import check_server

        check_server(recipe, world_size, models)
        return
    if recipe.generation.backend != "vllm":
        return
    from ppo_cli.engine.vllm_sampler import check_can_sample, check_one_process, check_vllm_installed

    check_one_process(world_size)
    check_vllm_installed()
    for model in models:
        check_can_sample(model)


def check_environment(recipe, world_size: int = 1) -> None:
    """The recipe's environment section (episodes with several turns), refused in one line before
    anything loads where a command cannot run it. Every command's check, beside check_vllm_backend."""
    if recipe.environment is None:
        return
    from ppo_cli.errors import RecipeError

    if world_size > 1:
        raise RecipeError(
            f"environment: episodes of several turns run in one process, not {world_size}",
            hint="train with one process (no --num-processes); several are not supported with an environment yet",
        )
    if recipe.generation.backend != "hf":
        raise RecipeError(
            f"environment: episodes of several turns sample with generation.backend hf, not {recipe.generation.backend}",
            hint="set generation.backend: hf (vLLM turns are not supported with an environment yet)",
        )


def cut_prompts_notes(recipe, models, prompts: list, note: Callable[[str], None]) -> None:
    """The note `ppo train` gives where prompts are longer than data.max_prompt_tokens (they lose their
    first tokens), for each model's tokenizer that cuts them; read from the tokenizer files alone."""
    from ppo_cli.engine.chat import cut_prompts_note
    from ppo_cli.engine.models import load_tokenizer
    from ppo_cli.errors import PpoError

    if recipe.environment is not None:  # an episode's prompts are the environment's, not these
        return
    said = set()
    for model in models:
        if model.tokenizer_path in said:
            continue
        said.add(model.tokenizer_path)
        pol = recipe.policy
        try:
            tokenizer = load_tokenizer(model.tokenizer_path, trust_remote_code=pol.trust_remote_code,
                                       revision=pol.revision if model.tokenizer_path == pol.path else None)
            message = cut_prompts_note(prompts, tokenizer, recipe.data)
        except PpoError:  # a model or prompts the command refuses with its own line, after its other checks
            continue
        if message:
            note(message + (f" ({model.reference})" if len(models) > 1 else ""))


def command_prompts(path, field, recipe, note: Callable[[str], None]):
    """The prompts (--prompts, else the recipe's), where they come from, and their rows' other columns
    (engine/data.PromptColumns), which rewards that read columns are given, as in training."""
    from ppo_cli.engine.data import PromptColumns, read_recipe_prompts  # no torch, and `datasets` only for datasets

    which = "eval_prompts" if path is None and recipe.data.eval_prompts else "prompts"
    prompt_set = read_recipe_prompts(recipe.data, which, source=path, field_name=field)
    path = path or getattr(recipe.data, which)
    if prompt_set.skipped_blank:
        n = prompt_set.skipped_blank
        note(f"note: skipped {n} blank line{'s' * (n != 1)} in {path}")
    return prompt_set.prompts, str(path), PromptColumns([prompt_set])


def sampling_settings(recipe, num_samples: int, batch_size: int | None):
    from ppo_cli.evaluation import recipe_sampling

    return recipe_sampling(recipe, recipe.seed, num_samples, batch_size)


def slug(reference: str) -> str:
    """'aligned' -> 'aligned'; 'runs/x/final' -> 'runs-x-final': a file-name-safe model name."""
    import re

    return re.sub(r"[^A-Za-z0-9_.-]+", "-", reference.strip("/.")).strip("-") or "model"
