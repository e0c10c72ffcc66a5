"""Prompts: reading them from files and datasets, and sampling batches in a reproducible order.

A prompt is either plain text (a string) or a conversation in TRL's format: a list of
``{"role": ..., "content": ...}`` messages. Templating and tokenising them is ``engine/chat.py``.

Imports the standard library only; ``datasets`` is imported when a dataset (parquet, csv, json, a
saved dataset directory or a hub id) is read, so ``ppo --help`` and .txt/.jsonl prompts stay light.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Union

from ppo_cli.errors import DataError, first_line
from ppo_cli.model_refs import hub_offline

Message = dict  # {"role": str, "content": str}
Prompt = Union[str, list]  # plain text, or a conversation: a list of Message

DEFAULT_COLUMNS = ("prompt", "messages")  # looked for in this order when data.field is not set
DATASET_FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_FIELD_HINT = "name the prompt column with data.field in the recipe (or --field)"


@dataclass(frozen=True)
class PromptSet:
    prompts: list[Prompt]
    skipped_blank: int = 0  # blank lines skipped in a .txt file, reported to the user
    columns: list[dict] = field(default_factory=list)  # per prompt, its row's other fields ([] for .txt)
    column: str | None = None  # the rows' prompt column (None for .txt)

    @property
    def column_names(self) -> set[str]:
        """Every other column some row has: what a reward function can be given by name."""
        return {name for row in self.columns for name in row}


def is_conversation(prompt: Prompt) -> bool:
    return isinstance(prompt, list)


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


JSONL_HINT = "each line of a .jsonl file must be one JSON object"


def read_jsonl_objects(path: Path, what: str = "prompts file", hint: str = JSONL_HINT,
                       missing_hint: str | None = None) -> list[tuple[int, dict]]:
    """(line number, object) for every non-blank line; a line that is not a JSON object is an error
    (``hint``: how the file's lines should be; ``missing_hint``: where the file comes from)."""
    rows = []
    for lineno, line in enumerate(read_text(path, what, missing_hint).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg})", hint=hint) from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}", hint=hint)
        rows.append((lineno, row))
    return rows


# --- one row -> one prompt -----------------------------------------------------------------------


def prompt_from_value(value, column: str, where: str) -> Prompt:
    """A row's prompt: a string as is, or a checked conversation.

    A conversation outside the ``prompt`` column (TRL's ``messages``) may end with the assistant's
    answer, as SFT data does; that turn is dropped: an RL prompt is what the policy answers. In a
    ``prompt`` column a final assistant turn is an error, since dropping it would change the prompt.
    """
    if isinstance(value, str):
        if column == "messages":  # TRL's conversational column: a string there is a mislabelled prompt
            raise DataError(f"{where}: 'messages' must be a list of {{role, content}} messages, got a string",
                            hint="put a plain-text prompt in a 'prompt' column, or write "
                            '[{"role": "user", "content": ...}]')
        return value
    if not isinstance(value, list):
        raise DataError(
            f"{where}: '{column}' must be a string or a list of {{role, content}} messages, got {type(value).__name__}"
        )
    messages = [_checked_message(m, j, column, where) for j, m in enumerate(value)]
    if messages and messages[-1]["role"] == "assistant":
        if column == "prompt":
            raise DataError(
                f"{where}: '{column}' ends with an assistant message; a prompt ends with the turn the policy answers",
                hint="remove the final assistant message, or put the conversation in a 'messages' column "
                "(its final assistant answer is dropped)",
            )
        messages = messages[:-1]
    if not any(m["role"] == "user" for m in messages):
        raise DataError(f"{where}: '{column}' has no user message", hint="a prompt conversation needs a user turn")
    return messages


def _checked_message(message, index: int, column: str, where: str) -> Message:
    """Role and content of one message; other keys (tool calls, names) are not passed on."""
    at = f"{where}: '{column}' message {index}"
    if not isinstance(message, dict):
        raise DataError(f"{at}: expected a {{role, content}} object, got {type(message).__name__}")
    for key in ("role", "content"):
        if message.get(key) is None:  # parquet gives every message each key of the column, null where absent
            keys = sorted(str(k) for k, v in message.items() if v is not None)
            raise DataError(f"{at}: no '{key}' (keys: {', '.join(keys) or 'none'})")
        if not isinstance(message[key], str):
            hint = "content parts (lists of {type, text}) are not supported: join them into one string" if key == "content" else None
            raise DataError(f"{at}: '{key}' must be a string, got {type(message[key]).__name__}", hint=hint)
    return {"role": message["role"], "content": message["content"]}


def _pick_column(columns: Iterable[str], field_name: str | None, where: str, kind: str = "column") -> str:
    """data.field if set, else the first of 'prompt', 'messages' that exists."""
    columns = list(columns)
    wanted = (field_name,) if field_name else DEFAULT_COLUMNS
    column = next((c for c in wanted if c in columns), None)
    if column is None:
        named = f"'{field_name}'" if field_name else "'prompt' or 'messages'"
        raise DataError(f"{where}: no {named} {kind} ({kind}s: {', '.join(columns) or 'none'})",
                        hint=_field_hint(field_name, columns))
    return column


def _field_hint(field_name: str | None, columns: list[str]) -> str:
    """The hint for a prompt column not found: the close column name when data.field is misspelt."""
    import difflib

    close = difflib.get_close_matches(field_name, columns, n=1) if field_name else []
    return f"did you mean data.field: {close[0]} (or --field {close[0]})?" if close else _FIELD_HINT


# --- sources -------------------------------------------------------------------------------------


def _read_txt(path: Path) -> PromptSet:
    lines = read_text(path).splitlines()
    prompts = [line for line in lines if line.strip()]
    return PromptSet(prompts, skipped_blank=len(lines) - len(prompts))


def _read_jsonl(path: Path, field_name: str | None) -> PromptSet:
    """Line-numbered errors: every row needs the column the first row has (data.field, else
    'prompt', else 'messages')."""
    prompts: list[Prompt] = []
    others: list[dict] = []
    column = None
    for lineno, row in read_jsonl_objects(path):
        where = f"{path}:{lineno}"
        if column is None:
            column = _pick_column(sorted(row), field_name, where, kind="field")
        if column not in row:
            keys = ", ".join(sorted(row)) or "none"
            raise DataError(f"{where}: no '{column}' field (fields: {keys})", hint=_FIELD_HINT)
        prompts.append(prompt_from_value(row[column], column, where))
        others.append({k: v for k, v in row.items() if k != column})
    return PromptSet(prompts, columns=others, column=column)


def _read_dataset(dataset, field_name: str | None, source: str) -> PromptSet:
    """Prompts of a ``datasets.Dataset``; errors name the row by its index."""
    column = _pick_column(dataset.column_names, field_name, source)
    values = dataset[column]
    other_names = [c for c in dataset.column_names if c != column]
    other_values = {c: dataset[c] for c in other_names}
    others = [{c: other_values[c][i] for c in other_names} for i in range(len(values))]
    return PromptSet([prompt_from_value(v, column, f"{source}: row {i}") for i, v in enumerate(values)], columns=others,
                     column=column)


def _read_dataset_file(path: Path, field_name: str | None) -> PromptSet:
    datasets = _import_datasets(str(path))
    fmt = DATASET_FORMATS[path.suffix]
    try:
        dataset = datasets.load_dataset(fmt, data_files=str(path), split="train")
    except Exception as err:  # noqa: BLE001 - pyarrow/pandas raise many kinds for a malformed file
        raise DataError(f"{path}: cannot read as {fmt} ({first_line(err)})", hint=f"check that the file is valid {fmt}") from None
    return _read_dataset(dataset, field_name, str(path))


def _read_dataset_dir(path: Path, field_name: str | None, split: str) -> PromptSet:
    files = sorted(p for p in path.iterdir() if p.suffix in (".jsonl", ".txt"))
    if files:
        sets = [_read_jsonl(p, field_name) if p.suffix == ".jsonl" else _read_txt(p) for p in files]
        columns = [c for s in sets for c in (s.columns or [{}] * len(s.prompts))]
        column = next((s.column for s in sets if s.column), None)
        return PromptSet([p for s in sets for p in s.prompts], sum(s.skipped_blank for s in sets), columns, column)
    datasets = _import_datasets(str(path))
    try:
        dataset = datasets.load_from_disk(str(path))
    except FileNotFoundError:
        raise DataError(
            f"{path}: neither .jsonl/.txt files nor a dataset saved with save_to_disk",
            hint="put the prompts in a .jsonl/.txt file, or save a dataset with Dataset.save_to_disk",
        ) from None
    if isinstance(dataset, datasets.DatasetDict):
        dataset = _pick_split(dataset, split, str(path))
    return _read_dataset(dataset, field_name, str(path))


def _pick_split(dataset_dict, split: str, source: str):
    if split not in dataset_dict:
        raise DataError(
            f"{source}: no split '{split}' (splits: {', '.join(dataset_dict)})",
            hint="set data.split (data.eval_split for eval_prompts)",
        )
    return dataset_dict[split]


def looks_like_hub_id(source: str) -> bool:
    """'org/name' that is not a local path and has no file suffix we read."""
    return bool(_HUB_ID.match(source)) and not Path(source).exists() and Path(source).suffix not in (*DATASET_FORMATS, ".jsonl", ".txt")


def _read_hub_dataset(name: str, field_name: str | None, split: str, subset: str | None) -> PromptSet:
    """A hub dataset through ``datasets`` (its local cache works offline)."""
    datasets = _import_datasets(name)
    offline = hub_offline()
    try:
        dataset = datasets.load_dataset(name, subset, split=split)
    except ConnectionError:
        if offline:
            raise DataError(
                f"dataset '{name}' is not a local file and the hub is offline (HF_HUB_OFFLINE=1), and it is not in the datasets cache",
                hint="download it once with the hub online (unset HF_HUB_OFFLINE), or point data.prompts at a local file",
            ) from None
        raise DataError(f"dataset '{name}': cannot reach the hub", hint="check the network, or use a local file") from None
    except ValueError as err:  # unknown split or subset
        raise DataError(f"dataset '{name}': {first_line(err)}", hint="check data.split and data.subset") from None
    except Exception as err:  # noqa: BLE001 - DatasetNotFoundError, gated repos, bad builder configs
        raise DataError(f"dataset '{name}': cannot load ({first_line(err)})", hint="check the dataset id, or use a local file") from None
    source = f"{name}[{split}]" if subset is None else f"{name}:{subset}[{split}]"
    return _read_dataset(dataset, field_name, source)


def _import_datasets(source: str):
    try:
        import datasets
    except ImportError:
        raise DataError(f"{source}: reading it needs the `datasets` package", hint="pip install datasets") from None
    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return datasets


def read_prompts(
    source: str | Path, field_name: str | None = None, *, split: str = "train", subset: str | None = None,
    key: str = "data.prompts",
) -> PromptSet:
    """Prompts from a .txt (one per line), .jsonl, .parquet, .csv or .json file, a directory (of
    .jsonl/.txt files, or saved with ``save_to_disk``) or a hub dataset id ('org/name'; ``split``
    and ``subset`` apply to it and to a saved DatasetDict). ``key`` names the source in hints."""
    path = Path(source)
    if not path.exists() and looks_like_hub_id(str(source)):
        prompt_set = _read_hub_dataset(str(source), field_name, split, subset)
    elif not path.exists():
        where = f"{key} (relative" if key.startswith("--") else f"{key} in the recipe (paths are relative"
        raise DataError(f"prompts file not found: {path}", hint=f"check {where} to the current directory)")
    elif path.is_dir():
        prompt_set = _read_dataset_dir(path, field_name, split)
    elif path.suffix == ".jsonl":
        prompt_set = _read_jsonl(path, field_name)
    elif path.suffix in DATASET_FORMATS:
        prompt_set = _read_dataset_file(path, field_name)
    else:
        prompt_set = _read_txt(path)
    if not prompt_set.prompts:
        raise DataError(f"{path}: no prompts in this file", hint="add at least one non-empty prompt")
    return prompt_set


def read_recipe_prompts(data, which: str = "prompts", source: str | Path | None = None, field_name: str | None = None) -> PromptSet:
    """The recipe's ``data.prompts`` or ``data.eval_prompts`` (or ``source`` in their place, e.g.
    --prompts), with the recipe's column, split and subset."""
    split = data.split if which == "prompts" else data.eval_split
    key = f"data.{which}" if source is None else "--prompts"
    return read_prompts(source or getattr(data, which), field_name or data.field, split=split, subset=data.subset, key=key)


def check_reward_reads_conversations(reward, prompts: list[Prompt]) -> None:
    """A model/classifier component reading 'prompt_and_response' cannot read a conversation: there is
    no one text for it. Said before any model is loaded."""
    if not any(is_conversation(p) for p in prompts):
        return
    for index, component in enumerate(reward.components):
        if getattr(component, "text", None) == "prompt_and_response":
            raise DataError(
                f"reward.components.{index} ({component.type}) reads text: prompt_and_response, but the prompts are conversations",
                hint="set `text: conversation` (the reward model's chat template is applied to prompt + response) "
                "or `text: response`",
            )


def prompt_key(prompt: Prompt) -> str:
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False)


def ambiguous_prompt(sources: list[tuple[str, PromptSet]]) -> DataError | None:
    """The line for the first prompt that two rows (of one source or two) give with different columns:
    PromptColumns finds a row's columns by its prompt, so such a prompt cannot be given its own row's."""
    seen: dict[str, tuple[str, int, dict]] = {}
    for source, prompt_set in sources:
        for index, (prompt, row) in enumerate(zip(prompt_set.prompts, prompt_set.columns), start=1):
            key = prompt_key(prompt)
            first = seen.setdefault(key, (source, index, row))
            if first[2] != row:
                where = (f"rows {first[1]} and {index} of {source}" if first[0] == source
                         else f"row {first[1]} of {first[0]} and row {index} of {source}")
                shown = key if len(key) <= 60 else key[:60] + "..."
                return DataError(f"prompt {shown} is in {where} with different columns, so a reward function "
                                 "cannot be given its row's columns",
                                 hint="make the prompts unique (or their columns equal): a row's columns are found by its prompt")
    return None


class PromptColumns:
    """The dataset's other columns of each prompt (e.g. a reference ``answer``), found by the prompt
    itself: a rollout's prompts are the data's rows, repeated and reordered, so the prompt names its row.
    A prompt that appears in two rows with different columns cannot be told apart: refused, but only
    when a reward asks for the columns."""

    def __init__(self, sources: list[PromptSet] = ()):
        self._rows: dict[str, dict] = {}
        self._ambiguous: set[str] = set()
        self._prompt_columns: set[str] = set()
        for prompt_set in sources:
            self.add(prompt_set)

    def add(self, prompt_set: PromptSet) -> None:
        self._prompt_columns |= {prompt_set.column} if prompt_set.column else set()
        for prompt, row in zip(prompt_set.prompts, prompt_set.columns):
            key = prompt_key(prompt)
            if key in self._rows and self._rows[key] != row:
                self._ambiguous.add(key)
            self._rows.setdefault(key, row)

    @property
    def names(self) -> set[str]:
        """Every column some row has."""
        return {name for row in self._rows.values() for name in row}

    @property
    def fields(self) -> set[str]:
        """The rows' fields as their file shows them: the columns and the prompt column."""
        return self.names | self._prompt_columns

    def columns_for(self, prompts: list[Prompt]) -> dict[str, list]:
        """Column name -> (B,) values for ``prompts`` (None where a row lacks the column)."""
        rows = []
        for prompt in prompts:
            key = prompt_key(prompt)
            if key in self._ambiguous:
                shown = key if len(key) <= 60 else key[:60] + "..."
                raise DataError(f"prompt {shown} appears in two rows with different columns, so a reward cannot "
                                "be given its row's columns", hint="make the prompts unique (or their columns equal)")
            rows.append(self._rows.get(key, {}))
        names = list(dict.fromkeys(name for row in rows for name in row))
        return {name: [row.get(name) for row in rows] for name in names}


def recipe_prompt_columns(data) -> PromptColumns:
    """The columns of the recipe's data.prompts and data.eval_prompts."""
    sets = [read_recipe_prompts(data)] + ([read_recipe_prompts(data, "eval_prompts")] if data.eval_prompts else [])
    return PromptColumns(sets)


@dataclass
class PromptSampler:
    """Cycles over the prompts in seeded shuffled epochs; its position is part of a checkpoint."""

    prompts: list[Prompt]
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

    def next_batch(self, size: int) -> list[Prompt]:
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
