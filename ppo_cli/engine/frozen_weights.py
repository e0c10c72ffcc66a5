"""A LoRA policy's frozen Linear weights stored in the autocast dtype (train.mixed_precision bf16/fp16).

Under autocast every Linear casts its float32 weight to bf16 at every call, and autocast caches only the
casts of weights that require grad: a frozen base is cast again at each decode step, at each forward, and
the backward keeps each cast copy alive until it has used it (about half the policy's float32 size at
once). Storing those weights in bf16 once computes exactly the same (autocast's cast and ``.to`` round
alike, and a bf16 weight is not cast again), costs half their memory, and skips the casts. Norms,
embeddings and the trained LoRA matrices stay float32, as autocast leaves them.

On CPU the float32 weights are views of the memory-mapped checkpoint, read (and made resident) as the
conversion reads them, and they leave the process only once the last of them is replaced: until then the
whole float32 model and its bf16 copy are resident at once (2.58 GB at the 0.5B bench shape, whose run
then peaked at 1.7). So each source's pages are dropped as soon as it is replaced (MADV_DONTNEED on a
mapping nothing has written to: a page read again comes back from the file).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import mmap
import sys
from pathlib import Path

import torch
from torch import nn

MADV_DONTNEED = 4  # Linux


def store_frozen_linears_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Store every frozen ``nn.Linear``'s weight and bias in ``dtype`` (not one tied to an embedding: the
    embedding's lookup is not autocast) and give every other floating tensor its own memory, so that no
    tensor points into the memory-mapped checkpoint any more and its float32 pages leave the process,
    each as soon as its tensor is replaced (drop_checkpoint_pages). Returns the number of Linear layers
    stored in ``dtype``."""
    clean = unwritten_checkpoint_mappings()
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    converted, changed = 0, set()
    for name, module in model.named_modules():
        # peft's own matrices (lora_A, lora_B, another adapter's) are trained, whatever requires_grad says
        # now: set_adapter turns it off on every adapter but the active one.
        adapter = any(part.startswith("lora_") or part == "modules_to_save" for part in name.split("."))
        if (type(module) is nn.Linear and not adapter and not module.weight.requires_grad
                and id(module.weight) not in embedded):
            for param in (module.weight, module.bias):
                if param is not None and id(param) not in changed:
                    source = param.data
                    param.data = source.to(dtype)
                    drop_checkpoint_pages(source, clean)
                    changed.add(id(param))
            converted += 1
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) not in changed and param.dtype.is_floating_point:
                source = param.data
                param.data = source.clone()
                drop_checkpoint_pages(source, clean)
                changed.add(id(param))
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.dtype.is_floating_point:
                module._buffers[name] = buffer.clone()
                drop_checkpoint_pages(buffer, clean)
    gc.collect()
    return converted


def unwritten_checkpoint_mappings() -> list[tuple[int, int]]:
    """(start, end) of each memory-mapped ``.safetensors`` file in this process in which no page has been
    written (smaps: no Anonymous kB, which is where a private mapping's written pages go; safetensors maps
    files private and writable): there, a dropped page reads back the file's bytes, so dropping it loses
    nothing. (Private_Dirty counts the page cache's unwritten-back pages too: a file just saved.) [] off Linux."""
    if not sys.platform.startswith("linux"):
        return []
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return []
    found, current = [], None
    for line in lines:
        fields = line.split()
        if not fields:
            continue
        if not fields[0].endswith(":"):  # a mapping's header: start-end perms offset dev inode [path]
            current = None
            if len(fields) >= 6 and fields[-1].endswith(".safetensors"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                current = [start, end, True]
                found.append(current)
        elif current is not None and fields[0] == "Anonymous:" and int(fields[1]) > 0:
            current[2] = False
    return [(start, end) for start, end, unwritten in found if unwritten]


def drop_checkpoint_pages(tensor: torch.Tensor, mappings: list[tuple[int, int]]) -> None:
    """Drop the resident pages wholly inside ``tensor``'s bytes if they lie in one of ``mappings``
    (unwritten_checkpoint_mappings): the tensor has just been replaced by a copy. Pages it shares with a
    neighbour stay."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or not any(low <= start and end <= high for low, high in mappings):
        return
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED)


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
