"""reward types model and classifier: a sequence-classification model read as a scalar reward, or its
labels mapped to values.

The model loads only when the scorer is built; importing this module imports no torch (its checks
run in `ppo validate`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ppo_cli.engine.chat import check_chat_template, conversation_text
from ppo_cli.engine.data import is_conversation
from ppo_cli.errors import DataError, RecipeError
from ppo_cli.recipe import ClassifierReward, ModelReward

if TYPE_CHECKING:
    import torch


def check(component: ModelReward | ClassifierReward, contact_servers: bool = True, import_functions: bool = False) -> None:
    """The model reference resolves, and a conversation reader's tokenizer has a chat template."""
    from ppo_cli.model_refs import check_model_reference, has_chat_template

    check_model_reference(component.path)
    if component.text == "conversation" and has_chat_template(component.path) is False:
        raise DataError(
            f"reward component '{component.path}' reads text: conversation but its tokenizer has no chat template",
            hint="use a reward model whose tokenizer has a chat template, or text: prompt_and_response / response",
        )


def display_name(component: ModelReward | ClassifierReward) -> str:
    return f"{component.type}:{Path(component.path.rstrip('/')).name}"


class ModelScorer:
    """A sequence-classification model read as a scalar reward or through a label->value map.

    ``mixed_precision``: the run's ('no', 'bf16', 'fp16'; set by RewardStack): the frozen model's
    forward runs under that autocast, as the policy's do, its scores taken in float32 after. Under
    bf16 the tiny classifier's rewards (-0.83..9.97) moved by at most 0.004 and its logits by 0.017
    (tests/engine/rewards/test_reward_precision.py); float32 runs compute as before.
    """

    mixed_precision = "no"

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
        import torch

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

    def __call__(self, prompts: list, responses: list[str]) -> list[float]:
        import torch

        texts = self.texts(prompts, responses)
        values: list[float] = []
        for start in range(0, len(texts), self.component.batch_size):
            enc = self._tokenize(texts[start : start + self.component.batch_size], return_tensors="pt",
                                 padding=True).to(self.device)
            with torch.no_grad(), self.autocast():
                logits = self.model(**enc).logits.float()
            values += self._logits_to_rewards(logits).tolist()
        return values

    def autocast(self):
        """The run's autocast for this model's forwards (a no-op for 'no')."""
        from ppo_cli.engine.precision import autocast_context

        return autocast_context(self.mixed_precision, self.device)

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


Scorer = ModelScorer
