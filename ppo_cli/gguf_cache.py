"""A GGUF file's config and tokenizer, read once per process.

transformers reads either by parsing the file's whole metadata, the tokenizer's vocabulary and merges
included, in Python: about 7 s for SmolLM2-135M's 49,152 tokens on a 2-core AMD EPYC. One `ppo train`
needs the config four times (the precision probe's widths, the plan, the model load) and the tokenizer
twice (the plan's prompt lengths, the engine), which cost about 40 s before the run began. Each caller
gets its own deep copy, as if it had read the file itself; a file changed since (its size or
modification time) is read again.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path


def _stamp(path: str) -> tuple[str, int, int]:
    local = Path(path).expanduser().resolve()
    stat = local.stat()
    return str(local), stat.st_mtime_ns, stat.st_size


def gguf_config(path: str):
    """The transformers config in the file's metadata, without the GGUF quantization_config (every
    model here loads dequantized: plain weights, engine/models._gguf_kwargs)."""
    return copy.deepcopy(_read_config(*_stamp(path)))


def gguf_tokenizer(path: str):
    """The tokenizer and chat template in the file's metadata, as AutoTokenizer builds them."""
    return copy.deepcopy(_read_tokenizer(*_stamp(path)))


@functools.lru_cache(maxsize=4)
def _read_config(path: str, mtime_ns: int, size: int):
    from transformers import AutoConfig

    local = Path(path)
    config = AutoConfig.from_pretrained(str(local.parent), gguf_file=local.name)
    vars(config).pop("quantization_config", None)
    return config


@functools.lru_cache(maxsize=4)
def _read_tokenizer(path: str, mtime_ns: int, size: int):
    from transformers import AutoTokenizer

    local = Path(path)
    return AutoTokenizer.from_pretrained(str(local.parent), gguf_file=local.name)
