"""The inference engine of `ppo rollout / score / eval / compare`: a policy (a run's final/ or checkpoint,
a local model or a hub id) and its reference, no critic, in the training Engine's shape, so that
sampling, log-probs and the KL to the reference are computed exactly as in training.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ppo_cli.engine.actor_critic import ActorCritic
from ppo_cli.engine.critics import NoCritic
from ppo_cli.engine.generate import resolve_stop_token_id
from ppo_cli.engine.models import (
    POLICY_ADAPTER,
    disable_dropout,
    freeze,
    load_causal_lm,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
)
from ppo_cli.engine.precision import check_mixed_precision, recipe_mixed_precision
from ppo_cli.engine.rewards.stack import RewardStack
from ppo_cli.engine.engine import Engine, make_sampler, quiet_libraries
from ppo_cli.errors import ModelLoadError, first_line
from ppo_cli.model_refs import ResolvedModel
from ppo_cli.recipe import Recipe


class InferencePolicy(ActorCritic):
    """A policy and its reference without a critic, in the training ActorCritic's shape, so that
    Engine.generate, policy_forward and reference_logprobs run on it unchanged.

    The reference is the base with the LoRA adapter disabled (a peft policy and no ``ref_model``),
    a separate frozen ``ref_model``, or, when the policy is itself the reference (``base``), the
    policy: ``reference_is_policy`` makes the KL exactly 0 without a second forward.
    """

    def __init__(self, policy: torch.nn.Module, ref_model: torch.nn.Module | None = None, reference_is_policy: bool = False):
        policy.requires_grad_(False)
        super().__init__(policy, critic=NoCritic(), value_head=None, ref_model=ref_model)
        self.reference_is_policy = reference_is_policy


def _same_model(a: str, b: str) -> bool:
    """Two model references name the same weights (local paths compared after resolving)."""
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b


def _same_adapter(a: str | None, b: str | None) -> bool:
    return a is None and b is None or a is not None and b is not None and _same_model(a, b)


def load_reward_stack(recipe: Recipe, columns=None, source: str | None = None) -> RewardStack:
    """The recipe's reward alone (for `ppo score`, and shared by both models in `ppo compare`);
    its files checked and its servers asked whether they answer first, before anything loads.

    ``columns``: the other columns of the prompts the command was given (engine/data.PromptColumns,
    read from ``source``), else the recipe's data; a reward function that needs a column they lack is
    refused here, before any model loads."""
    from ppo_cli.engine.data import recipe_prompt_columns
    from ppo_cli.engine.rewards.checks import check_reward_components

    check_reward_components(recipe.reward)
    quiet_libraries()

    device = resolve_device(recipe.train.device)
    # under the training run's autocast, as its rollouts and held-out prompts were scored (a reward model
    # in bf16 moves scores by about 1e-4: compare's "before" would not be the run's own)
    stack = RewardStack(recipe.reward, device, recipe.data.system_prompt,
                        columns if columns is not None else lambda: recipe_prompt_columns(recipe.data),
                        max_new_tokens=recipe.generation.max_new_tokens,
                        mixed_precision=recipe_mixed_precision(recipe, device))
    if columns is not None:  # an episode's transcript is a column too, with an environment
        given = {"messages"} if recipe.environment is not None else set()
        stack.check_columns(columns.names | given, source or "the prompts", columns.fields | given)
    return stack


def load_inference_engine(recipe: Recipe, model: ResolvedModel, reward: RewardStack | None = None,
                          columns=None) -> Engine:
    """An Engine for sampling and log-probs from ``model`` with the recipe's tokenizer options,
    generation settings and reference; ``reward`` is kept as given (None when only sampling). An
    environment's reset reads each prompt's row from the reward's columns, else ``columns`` (the
    command's prompts, engine/data.PromptColumns), else the recipe's data.

    The weights are ``model.weights_path`` with ``model.base_adapter`` merged in (+ the LoRA adapter,
    loaded as the ``policy`` adapter); the reference is the recipe's (``reference.path``, else
    ``policy.path`` with ``policy.adapter`` merged in): the same base with the adapter disabled when
    it is the adapter's base, the policy itself when it is the same model, otherwise a separate
    frozen copy.
    """
    quiet_libraries()
    device = resolve_device(recipe.train.device)
    if recipe.train.num_threads:
        torch.set_num_threads(recipe.train.num_threads)
    pol = recipe.policy
    revision = pol.revision if model.weights_path == pol.path else None
    common = dict(device=device, trust_remote_code=pol.trust_remote_code, attn_implementation=pol.attn_implementation)
    tokenizer = load_tokenizer(model.tokenizer_path, trust_remote_code=pol.trust_remote_code,
                               revision=revision if model.tokenizer_path == pol.path else None)
    stop_token_id = resolve_stop_token_id(tokenizer, recipe.generation.stop_token)
    policy = load_causal_lm(model.weights_path, model.base_adapter, dtype=resolve_dtype(pol.dtype, device),
                            quantization=pol.quantization, revision=revision, **common)
    if model.adapter_dir is not None:
        policy = _load_adapter(policy, model.adapter_dir)
    freeze(policy)

    reference_path = recipe.reference.path or pol.path
    reference_adapter = None if recipe.reference.path else pol.adapter
    same_start = _same_adapter(reference_adapter, model.base_adapter)
    ref_model, reference_is_policy = None, False
    if model.adapter_dir is not None and same_start and _same_model(reference_path, model.base_path):
        pass  # the base with the adapter disabled, as in training
    elif model.adapter_dir is None and same_start and _same_model(reference_path, model.weights_path):
        reference_is_policy = True
    else:
        ref = recipe.reference
        ref_model = load_causal_lm(
            reference_path, reference_adapter, dtype=resolve_dtype(ref.dtype or pol.dtype, device),
            quantization=ref.quantization, revision=pol.revision if reference_path == pol.path else None, **common,
        )
        freeze(ref_model)
    actor = InferencePolicy(policy, ref_model, reference_is_policy)
    # Sampled and scored under the training run's autocast (train.mixed_precision), as its rollouts were.
    mixed_precision = recipe_mixed_precision(recipe, device)
    check_mixed_precision(mixed_precision, device)
    # sampled as `ppo train` samples with this recipe (vLLM: on the model's weights / saved adapter)
    sampler = make_sampler(recipe, device, policy, stop_token_id, tokenizer.pad_token_id, mixed_precision, model=model,
                           tokenizer=tokenizer, columns_for=_rows_of_prompts(recipe, reward, columns))
    return Engine(recipe, device, tokenizer, actor, reward, stop_token_id, sampler=sampler, mixed_precision=mixed_precision)


def _rows_of_prompts(recipe: Recipe, reward: RewardStack | None, columns):
    """prompts -> {column: [value per prompt]}: what an environment's reset reads as each prompt's row."""
    if reward is not None:
        return reward.columns_for
    if columns is not None:
        return columns.columns_for
    from ppo_cli.engine.data import recipe_prompt_columns

    return lambda prompts: recipe_prompt_columns(recipe.data).columns_for(prompts)


def _load_adapter(base: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    from peft import PeftModel

    try:
        model = PeftModel.from_pretrained(base, str(adapter_dir), adapter_name=POLICY_ADAPTER)
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        raise ModelLoadError(f"cannot load the LoRA adapter in {adapter_dir}: {first_line(err)}") from err
    disable_dropout(model)
    return model
