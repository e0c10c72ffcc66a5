"""A LoRA policy's frozen Linear weights stored in the autocast dtype (train.mixed_precision bf16/fp16).

Under autocast every Linear casts its float32 weight to bf16 at every call, and autocast caches only the
casts of weights that require grad: a frozen base is cast again at each decode step, at each forward, and
the backward keeps each cast copy alive until it has used it (about half the policy's float32 size at
once). Storing those weights in bf16 once computes exactly the same (autocast's cast and ``.to`` round
alike, and a bf16 weight is not cast again), costs half their memory, and skips the casts. Norms,
embeddings and the trained LoRA matrices stay float32, as autocast leaves them.
"""

from __future__ import annotations

import gc

import torch
from torch import nn


def store_frozen_linears_in(model: nn.Module, dtype: torch.dtype) -> int:
    """Store every frozen ``nn.Linear``'s weight and bias in ``dtype`` (not one tied to an embedding: the
    embedding's lookup is not autocast) and give every other floating tensor its own memory, so that no
    tensor points into the memory-mapped checkpoint any more and its float32 pages leave the process.
    Returns the number of Linear layers stored in ``dtype``."""
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
                    param.data = param.data.to(dtype)
                    changed.add(id(param))
            converted += 1
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) not in changed and param.dtype.is_floating_point:
                param.data = param.data.clone()
                changed.add(id(param))
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.dtype.is_floating_point:
                module._buffers[name] = buffer.clone()
    gc.collect()
    return converted
