"""What the recipe's ``auto`` settings stand for on this run: the critic kind and the weights' dtype.

These choices read the models' files (config.json, tokenizer.json) or the device, so they run after
validation, never inside it: the schema (recipe.py) checks what the recipe says; callers that need the
resolved critic call ``value_kind`` / ``value_settings`` here. Imports the standard library and the
schema only (no torch): ``ppo validate`` and ``ppo plan`` use it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from ppo_cli.errors import ModelReferenceError
from ppo_cli.recipe import Recipe


def weights_dtype(name: str | None, device_type: str, cuda_bf16: bool = True) -> str:
    """A dtype setting (None and 'auto' included) as a concrete name: 'auto' is bfloat16 on a GPU that
    supports it (``cuda_bf16``), float32 elsewhere (CPU matmuls in bf16 are not reliably faster)."""
    if name in (None, "auto"):
        return "bfloat16" if device_type == "cuda" and cuda_bf16 else "float32"
    return name


class ValueSettings(NamedTuple):
    """``value.*`` as the run uses it: 'auto' made concrete (value_settings)."""

    kind: str
    init_from: str
    train_backbone: bool | None
    path: str | None
    dtype: str | None


def value_settings(recipe: Recipe) -> ValueSettings:
    """The critic 'auto' stands for, chosen by wall-clock to a target reward (docs/benchmarks.md,
    "Choosing the default critic"): the frozen reward-model critic (kind model on the reward model,
    init_from reward, train_backbone false: it starts as the reward model and trains only its head)
    when a scalar reward model can serve as one (``frozen_critic_reward``); otherwise the value head,
    with LoRA and without. A separate model when the recipe names one (value.path, init_from reward),
    the adapter when it gives the adapter's settings (value.lora). A concrete kind is kept as written.
    No critic (none) for a critic-free ppo.advantage."""
    v = recipe.value
    as_written = ValueSettings(v.kind, v.init_from, v.train_backbone, v.path, v.dtype)
    if v.kind != "auto":
        return as_written
    if recipe.ppo.critic_free:  # grpo, rloo, reinforce_pp: the baseline comes from the scores, not a critic
        return as_written._replace(kind="none")
    if v.path is not None or v.init_from == "reward":
        return as_written._replace(kind="model")
    if v.lora is not None and recipe.policy.lora is not None:
        return as_written._replace(kind="adapter")
    if v.train_backbone is not True and (reward := frozen_critic_reward(recipe)) is not None:
        return ValueSettings("model", "reward", False, reward.path, v.dtype or reward.dtype)
    return as_written._replace(kind="head")


def value_kind(recipe: Recipe) -> str:
    """``value.kind`` with 'auto' resolved (value_settings): 'adapter', 'head', 'model' or 'none'."""
    return value_settings(recipe).kind


def value_model_path(recipe: Recipe) -> str:
    """The separate value model's checkpoint (kind model): value.path, the reward model, or the policy."""
    settings = value_settings(recipe)
    if settings.path is not None:
        return settings.path
    if settings.init_from == "policy":
        return recipe.policy.path
    return first_reward_model_path(recipe)


def first_reward_model_path(recipe: Recipe) -> str:
    """The first reward component that is a model (a separate critic can start from it)."""
    for component in recipe.reward.components:
        if component.loads_model:
            return component.path
    raise ModelReferenceError(
        "value.init_from is 'reward' but the reward has no model component",
        hint="set value.init_from: policy, or value.path",
    )


def frozen_critic_reward(recipe: Recipe):
    """The first ``type: model`` reward component (a scalar reward model, so the value head starts as
    its score head) that can be a frozen critic: unquantized (its weights are shared), of the policy's
    architecture (config.json model_type: a causal decoder like the policy, whose hidden state at a
    position sees only the tokens before it) and on the policy's tokenizer (it reads the policy's
    token ids). Read from the models' files, without loading them; None when no component qualifies or
    a file cannot be read (then 'auto' does not guess)."""
    policy = recipe.policy
    for component in recipe.reward.components:
        if component.type != "model" or component.quantization != "none":
            continue
        policy_type = _config_model_type(policy.path, policy.revision)
        if policy_type is not None and _config_model_type(component.path) == policy_type \
                and same_tokenizer(policy.path, policy.revision, component.path) is True:
            return component
    return None


def model_file(ref: str, name: str, revision: str | None = None) -> Path | None:
    """A model's file from a local directory or the hub cache (never the network)."""
    directory = Path(ref).expanduser()
    if directory.is_dir():
        return directory / name if (directory / name).is_file() else None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(ref, name, revision=revision)
    except Exception:  # not a repo id either: nothing to read
        return None
    return Path(found) if isinstance(found, str) else None


def _config_model_type(ref: str, revision: str | None = None) -> str | None:
    path = model_file(ref, "config.json", revision)
    try:
        return json.loads(path.read_text()).get("model_type") if path else None
    except (OSError, ValueError):
        return None


TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt")


def _vocabulary(tokenizer_json: dict) -> tuple:
    """What a tokenizer.json maps text to ids with: its vocabulary, merges and added tokens (not its
    padding or truncation settings, nor fields that versions of `tokenizers` write differently, such
    as a merge as "a b" or ["a", "b"], or an unset prefix as null or "")."""
    model = tokenizer_json.get("model") or {}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    added = sorted((t.get("id"), t.get("content")) for t in tokenizer_json.get("added_tokens") or [])
    return model.get("type"), model.get("vocab"), merges, added


def same_tokenizer(ref_a: str, revision_a: str | None, ref_b: str, revision_b: str | None = None) -> bool | None:
    """Do two models tokenize alike, so that one can read the other's token ids? tokenizer.json's
    vocabulary (``_vocabulary``), else the vocabulary files byte for byte; None when neither can be
    read. The one rule for both the frozen-critic choice and the separate value model's check."""
    a, b = model_file(ref_a, "tokenizer.json", revision_a), model_file(ref_b, "tokenizer.json", revision_b)
    if a and b:
        try:
            return _vocabulary(json.loads(a.read_text())) == _vocabulary(json.loads(b.read_text()))
        except (OSError, ValueError):
            return None
    pairs = [(model_file(ref_a, n, revision_a), model_file(ref_b, n, revision_b)) for n in TOKENIZER_FILES]
    pairs = [(x, y) for x, y in pairs if x or y]
    if not pairs:
        return None
    return all(x and y and x.read_bytes() == y.read_bytes() for x, y in pairs)
