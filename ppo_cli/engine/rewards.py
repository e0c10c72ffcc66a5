"""Rewards: scalar reward models, classifiers with a label->value map, Python functions, penalties.

A reward is a weighted sum of components, minus penalties (missing stop token, over-length).
Every component's per-episode value is kept so `ppo score` and the metrics can show them.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ppo_cli.engine.chat import check_chat_template, conversation_text
from ppo_cli.engine.data import is_conversation
from ppo_cli.errors import DataError, RecipeError, RewardFunctionError, RewardFunctionFailed
from ppo_cli.recipe import ClassifierReward, FunctionReward, ModelReward, RewardConfig


def load_reward_function(spec: str) -> Callable[[list[str], list[str]], list[float]]:
    """Import 'package.module:name' or 'path/to/file.py:name' and check it takes (prompts, responses)."""
    target, _, name = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_file():
                raise RewardFunctionError(f"reward function file not found: {target}", hint="paths are relative to the current directory")
            module_name = f"ppo_reward_{abs(hash(str(path.resolve())))}"
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except RewardFunctionError:
        raise
    except Exception as err:  # the user's module raised while importing
        raise RewardFunctionError(
            f"cannot import reward function module '{target}': {type(err).__name__}: {err}"
        ) from err
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardFunctionError(f"'{target}' has no function '{name}'", hint=f"define def {name}(prompts, responses) -> list[float]")
    try:
        inspect.signature(fn).bind(["p"], ["r"])
    except TypeError:
        raise RewardFunctionError(
            f"reward function '{spec}' must take two arguments (prompts, responses)",
            hint=f"def {name}(prompts: list[str], responses: list[str]) -> list[float]",
        ) from None
    return fn


class FunctionScorer:
    def __init__(self, component: FunctionReward, device: torch.device | None = None, system_prompt: str | None = None):
        self.spec = component.function
        self.fn = load_reward_function(component.function)

    def __call__(self, prompts: list, responses: list[str]) -> list[float]:
        """``prompts`` as the data has them, like TRL's reward functions: strings for plain-text rows,
        lists of {role, content} for conversations (without data.system_prompt); copies, so the
        function cannot change the rollout's prompts."""
        try:
            values = self.fn(copy.deepcopy(list(prompts)), list(responses))
        except Exception as err:
            raise RewardFunctionFailed(
                f"reward function '{self.spec}' raised {type(err).__name__}: {err}",
                hint="fix the function; run again with --debug for its traceback",
            ) from err
        try:
            values = [float(v) for v in values]
        except (TypeError, ValueError):
            raise RewardFunctionError(f"reward function '{self.spec}' must return a list of numbers") from None
        if len(values) != len(responses):
            raise RewardFunctionError(
                f"reward function '{self.spec}' returned {len(values)} values for {len(responses)} responses"
            )
        return values


class ModelScorer:
    """A sequence-classification model read as a scalar reward or through a label->value map."""

    def __init__(self, component: ModelReward | ClassifierReward, device: torch.device, system_prompt: str | None = None):
        from transformers import AutoModelForSequenceClassification

        from ppo_cli.engine.models import freeze, load_pretrained, load_tokenizer, resolve_dtype

        self.component = component
        self.device = device
        self.system_prompt = system_prompt
        self.tokenizer = load_tokenizer(component.path, trust_remote_code=component.trust_remote_code)
        self.tokenizer.padding_side = "right"
        if component.text == "conversation":
            check_chat_template(
                self.tokenizer, f"reward component '{component.path}' reads text: conversation",
                "use a reward model whose tokenizer has a chat template, or text: prompt_and_response / response",
            )
        self.model = load_pretrained(
            AutoModelForSequenceClassification, component.path, dtype=resolve_dtype(component.dtype, device),
            device=device, quantization=component.quantization, trust_remote_code=component.trust_remote_code,
        )
        freeze(self.model)
        check_has_trained_score_head(self.model.config, component.path)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if isinstance(component, ClassifierReward):
            self.label_values = self._label_values(component)
        elif self.model.config.num_labels != 1:
            raise RecipeError(
                f"reward model '{component.path}' has {self.model.config.num_labels} outputs; type: model needs one",
                hint="use type: classifier with a labels map for a classifier",
            )

    def _label_values(self, component: ClassifierReward) -> torch.Tensor:
        id2label = {int(i): str(label).lower() for i, label in self.model.config.id2label.items()}
        wanted = {label.lower(): value for label, value in component.labels.items()}
        unknown = sorted(set(wanted) - set(id2label.values()))
        if unknown:
            raise RecipeError(
                f"reward classifier '{component.path}' has no label(s) {', '.join(unknown)}",
                hint=f"its labels are: {', '.join(id2label[i] for i in sorted(id2label))}",
            )
        return torch.tensor([wanted.get(id2label[i], 0.0) for i in range(len(id2label))], device=self.device)

    def texts(self, prompts: list, responses: list[str]) -> list[str]:
        """What the model reads, per ``component.text``."""
        text = self.component.text
        if text == "response":
            return list(responses)
        if text == "conversation":
            return [conversation_text(p, r, self.tokenizer, self.system_prompt) for p, r in zip(prompts, responses)]
        for i, prompt in enumerate(prompts):
            if is_conversation(prompt):
                raise DataError(
                    f"reward component '{self.component.path}' reads text: prompt_and_response, but prompt {i} is a conversation",
                    hint="set `text: conversation` (its chat template is applied to prompt + response) or `text: response`",
                )
        return [p + r for p, r in zip(prompts, responses)]

    def _tokenize(self, texts: list[str], **kwargs):
        # A chat template writes its own special tokens; adding them again would double the BOS.
        return self.tokenizer(texts, truncation=True, max_length=self.component.max_length,
                              add_special_tokens=self.component.text != "conversation", **kwargs)

    def token_ids(self, prompts: list, responses: list[str]) -> list[list[int]]:
        """The ids the model reads for each row (before padding)."""
        return self._tokenize(self.texts(prompts, responses))["input_ids"]

    @torch.no_grad()
    def __call__(self, prompts: list, responses: list[str]) -> list[float]:
        texts = self.texts(prompts, responses)
        values: list[float] = []
        for start in range(0, len(texts), self.component.batch_size):
            enc = self._tokenize(texts[start : start + self.component.batch_size], return_tensors="pt",
                                 padding=True).to(self.device)
            logits = self.model(**enc).logits.float()
            values += self._logits_to_rewards(logits).tolist()
        return values

    def _logits_to_rewards(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, num_labels) -> (B,): the scalar head, or the label map (optionally value x confidence)."""
        if isinstance(self.component, ModelReward):
            return logits[:, 0]
        probs = logits.softmax(dim=-1)
        if self.component.mode == "expected":
            return probs @ self.label_values
        confidence, label = probs.max(dim=-1)
        value = self.label_values[label]
        return value * confidence if self.component.scale_by_confidence else value


def check_has_trained_score_head(config, path: str) -> None:
    """A checkpoint saved as a causal LM (or any other head) has no classification head: transformers
    would add one with random weights, and PPO would train on noise without a word."""
    saved = getattr(config, "architectures", None) or []
    if saved and not any(name.endswith("ForSequenceClassification") for name in saved):
        raise RecipeError(
            f"reward model '{path}' is a {saved[0]} checkpoint with no classification head: its score would be random",
            hint="use a sequence-classification reward model (…ForSequenceClassification, e.g. from TRL's RewardTrainer) "
                 "or a Python reward function",
        )


# A reward component's ``type`` -> the class that scores with it, built as cls(component, device, system_prompt).
SCORERS = {"model": ModelScorer, "classifier": ModelScorer, "function": FunctionScorer}


def _component_name(component, index: int, taken: set[str]) -> str:
    if isinstance(component, FunctionReward):
        base = component.function.rpartition(":")[2]
    else:
        base = f"{component.type}:{Path(component.path.rstrip('/')).name}"
    name = base if base not in taken else f"{base}#{index}"
    taken.add(name)
    return name


@dataclass
class ScoreResult:
    scores: list[float]  # (B,) the total reward of each episode
    components: dict[str, list[float]]  # name -> (B,) values before weighting; penalties as negative numbers


class RewardStack:
    """The recipe's reward: components summed with their weights, then the penalties."""

    def __init__(self, config: RewardConfig, device: torch.device, system_prompt: str | None = None):
        """``system_prompt``: the recipe's data.system_prompt, part of the conversation a
        ``text: conversation`` component reads."""
        self.config = config
        taken: set[str] = set()
        self.scorers = []
        for index, component in enumerate(config.components):
            scorer = SCORERS[component.type](component, device, system_prompt)
            self.scorers.append((_component_name(component, index, taken), component.weight, scorer))

    def score(self, prompts: list, responses: list[str], finished: list[bool], response_lengths: list[int],
              known: dict[int, list] | None = None) -> ScoreResult:
        """``known``: component index -> (B,) values already computed (engine/shared_reward.py), None
        for the rows that component still scores."""
        totals = [0.0] * len(responses)
        components: dict[str, list[float]] = {}
        for index, (name, weight, scorer) in enumerate(self.scorers):
            values = _fill_in(scorer, prompts, responses, (known or {}).get(index))
            components[name] = values
            totals = [t + weight * v for t, v in zip(totals, values)]
        if self.config.missing_eos_penalty is not None:
            penalty = [0.0 if done else -self.config.missing_eos_penalty for done in finished]
            components["missing_eos_penalty"] = penalty
            totals = [t + p for t, p in zip(totals, penalty)]
        if self.config.max_response_tokens is not None:
            limit, amount = self.config.max_response_tokens, self.config.overlength_penalty
            penalty = [-amount if n > limit else 0.0 for n in response_lengths]
            components["overlength_penalty"] = penalty
            totals = [t + p for t, p in zip(totals, penalty)]
        return ScoreResult(totals, components)


def _fill_in(scorer, prompts: list, responses: list[str], known: list | None) -> list[float]:
    """The scorer's values, calling it only for the rows ``known`` leaves as None."""
    if known is None:
        return scorer(prompts, responses)
    missing = [i for i, value in enumerate(known) if value is None]
    values = list(known)
    if missing:
        for i, value in zip(missing, scorer([prompts[i] for i in missing], [responses[i] for i in missing])):
            values[i] = value
    return values
