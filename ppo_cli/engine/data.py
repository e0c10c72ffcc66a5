"""Prompts: reading them from files, sampling batches in a reproducible order, tokenising them."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from ppo_cli.errors import DataError


@dataclass(frozen=True)
class PromptSet:
    prompts: list[str]
    skipped_blank: int = 0  # blank lines skipped in a .txt file, reported to the user


def read_text(path: Path, what: str = "prompts file", hint: str | None = None) -> str:
    """A UTF-8 file's text, or one DataError line saying why it cannot be had."""
    if not path.exists():
        raise DataError(f"{what} not found: {path}", hint=hint)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not UTF-8 text (byte {err.start})", hint="save the file as UTF-8") from None
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err.strerror})") from None


def read_jsonl_objects(path: Path, what: str = "prompts file", hint: str | None = None) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line; a line that is not a JSON object is an error."""
    rows = []
    for lineno, line in enumerate(read_text(path, what).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}", hint=hint)
        rows.append((lineno, row))
    return rows


def _read_txt(path: Path) -> PromptSet:
    lines = read_text(path).splitlines()
    prompts = [line for line in lines if line.strip()]
    return PromptSet(prompts, skipped_blank=len(lines) - len(prompts))


def _read_jsonl(path: Path, field_name: str) -> PromptSet:
    prompts: list[str] = []
    for lineno, row in read_jsonl_objects(path):
        if field_name not in row:
            keys = ", ".join(sorted(row)) or "none"
            raise DataError(
                f"{path}:{lineno}: no '{field_name}' field (fields: {keys})",
                hint="name the prompt field with data.field in the recipe (or --field)",
            )
        value = row[field_name]
        if not isinstance(value, str):
            raise DataError(f"{path}:{lineno}: '{field_name}' must be a string, got {type(value).__name__}")
        prompts.append(value)
    return PromptSet(prompts)


def _read_dataset_dir(path: Path, field_name: str) -> PromptSet:
    files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".txt"))
    if files:
        sets = [_read_jsonl(p, field_name) if p.suffix == ".jsonl" else _read_txt(p) for p in files]
        return PromptSet([p for s in sets for p in s.prompts], sum(s.skipped_blank for s in sets))
    try:
        import datasets  # optional: a directory written by Dataset.save_to_disk
    except ImportError:
        raise DataError(
            f"{path}: no .jsonl or .txt files in this directory",
            hint="put the prompts in a .jsonl/.txt file, or `pip install datasets` to read a saved dataset",
        ) from None
    ds = datasets.load_from_disk(str(path))
    if field_name not in ds.column_names:
        raise DataError(f"{path}: dataset has no '{field_name}' column (columns: {', '.join(ds.column_names)})")
    return PromptSet([str(x) for x in ds[field_name]])


def read_prompts(path: str | Path, field_name: str = "prompt") -> PromptSet:
    """Read prompts from a .txt (one per line), a .jsonl (``field_name``) file or a dataset directory."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"prompts file not found: {path}", hint="check data.prompts in the recipe (paths are relative to the current directory)")
    if path.is_dir():
        prompt_set = _read_dataset_dir(path, field_name)
    elif path.suffix == ".jsonl":
        prompt_set = _read_jsonl(path, field_name)
    else:
        prompt_set = _read_txt(path)
    if not prompt_set.prompts:
        raise DataError(f"{path}: no prompts in this file", hint="add at least one non-empty prompt")
    return prompt_set


@dataclass
class PromptSampler:
    """Cycles over the prompts in seeded shuffled epochs; its position is part of a checkpoint."""

    prompts: list[str]
    seed: int
    shuffle: bool = True
    epoch: int = 0
    position: int = 0
    _order: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        if self.shuffle:
            random.Random(self.seed * 100_003 + epoch).shuffle(order)
        return order

    def next_batch(self, size: int) -> list[str]:
        batch = []
        while len(batch) < size:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
            batch.append(self.prompts[self._order[self.position]])
            self.position += 1
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._epoch_order(self.epoch)


def format_prompts(prompts: list[str], tokenizer, chat_template: bool) -> list[str]:
    """Apply the tokenizer's chat template (a single user turn) when the recipe asks for it."""
    if not chat_template:
        return prompts
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "data.chat_template is true but the tokenizer has no chat template",
            hint="set data.chat_template: false for a base model",
        )
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]


def tokenize_prompts(prompts: list[str], tokenizer, max_prompt_tokens: int, device):
    """Left-padded prompt ids and bool mask, each (B, P); long prompts keep their last tokens."""
    tokenizer.padding_side = "left"
    tokenizer.truncation_side = "left"
    enc = tokenizer(
        prompts,
        return_tensors="pt",
        padding=True,
        truncation=True,
        max_length=max_prompt_tokens,
        add_special_tokens=True,
    )
    return enc["input_ids"].to(device), enc["attention_mask"].to(device).bool()
