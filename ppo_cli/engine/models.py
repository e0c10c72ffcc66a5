"""Loading the four roles: policy, reference, value and (in rewards/) reward.

With LoRA the policy is a peft model with an adapter named ``policy``; the reference is the same
base with adapters disabled (no second copy), and the critic can be a second adapter ``value`` on
that base with a scalar head. Without LoRA the reference is a frozen copy and the critic a separate
model. Frozen models can be 4-bit/8-bit through bitsandbytes.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from ppo_cli.auto import weights_dtype
from ppo_cli.errors import ModelLoadError, ModelReferenceError, first_line
from ppo_cli.model_refs import check_adapter_reference, check_model_reference, gguf_location, hub_offline, is_gguf
from ppo_cli.recipe import LoraConfig

POLICY_ADAPTER = "policy"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("train.device is 'cuda' but no CUDA device is available", hint="set train.device: auto or cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """A dtype setting as a torch dtype on ``device`` (auto.weights_dtype: the rule, with this GPU's bf16 support)."""
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return _DTYPES[weights_dtype(name, device.type, cuda_bf16)]


def _quantization_config(quantization: str, compute_dtype: torch.dtype):
    if quantization == "none":
        return None
    from transformers import BitsAndBytesConfig

    if quantization == "4bit":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def disable_dropout(model: nn.Module) -> None:
    """PPO needs the rollout and update forwards to agree, so no dropout anywhere (TRL does the same).

    Besides dropout modules, many transformers layers keep the rate as a float attribute and call
    ``nn.functional.dropout`` in train mode (OPT's ``dropout`` 0.1 and ``layerdrop``, the attention
    layers' ``attention_dropout``): those are zeroed too. The policy stays in train mode (see freeze),
    so a missed one would make every forward random.
    """
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in vars(module).items():
            if "drop" in name and isinstance(value, float) and value > 0.0:
                setattr(module, name, 0.0)


def load_pretrained(
    auto_class,
    path: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
    trust_remote_code: bool = False,
    revision: str | None = None,
    **kwargs,
):
    """``auto_class.from_pretrained`` with our safety defaults: safetensors only, no remote code unless asked.
    ``attn_implementation`` 'auto' (or None) leaves the choice to transformers."""
    check_model_reference(path)
    quant_config = _quantization_config(quantization, dtype)
    load_kwargs = dict(dtype=dtype, trust_remote_code=trust_remote_code, revision=revision, use_safetensors=True, **kwargs)
    if load_kwargs.get("attn_implementation") in (None, "auto"):
        load_kwargs.pop("attn_implementation", None)
    elif load_kwargs["attn_implementation"] == "flash_attention_2" and device.type != "cuda":
        raise ModelLoadError(f"policy.attn_implementation flash_attention_2 needs a CUDA GPU, and this run is on {device.type}",
                             hint="set policy.attn_implementation: auto (or sdpa)")
    if quant_config is not None:
        load_kwargs.update(quantization_config=quant_config, device_map={"": device})
    location = path
    if is_gguf(path):
        location, load_kwargs = _gguf_kwargs(path, load_kwargs)
    try:
        model = auto_class.from_pretrained(location, **load_kwargs)
    except SafetensorError as err:
        raise ModelLoadError(f"cannot load model '{path}': its safetensors weights are damaged ({err})",
                             hint="copy or download the model again; an interrupted copy leaves a file cut short") from err
    except (OSError, ValueError, RuntimeError, ImportError) as err:
        hint = _hub_hint(path) if isinstance(err, OSError) else None  # not for e.g. out of memory
        raise ModelLoadError(f"cannot load model '{path}': {first_line(err)}", hint=hint) from err
    if quant_config is None and device.type != "cpu":
        # On CPU the weights stay where from_pretrained put them: views of the memory-mapped checkpoint,
        # read as they are used. Moving them to accelerate's device (cpu:0, "another" CPU device to
        # torch) would copy every tensor while the file's pages are resident: twice the model at once.
        model.to(device)
    disable_dropout(model)
    return model


def _gguf_kwargs(path: str, load_kwargs: dict) -> tuple[str, dict]:
    """from_pretrained's location and arguments for a GGUF file: every weight dequantized to ``dtype``.

    ``dequantize=True`` also makes transformers drop its GGUF quantizer after loading, so the model is
    plain weights that train and save (with the quantizer attached, save_pretrained refuses), and
    never the packed GGUF layers transformers would otherwise pick when a GGUF kernel is installed.
    """
    from transformers import GgufConfig

    from ppo_cli.gguf_cache import gguf_config

    if "quantization_config" in load_kwargs:
        raise ModelLoadError(f"cannot load the GGUF file '{path}' in 4/8 bit directly",
                             hint="load it dequantized (quantization: none)")  # load_causal_lm goes through a saved copy
    directory, name = gguf_location(path)
    kwargs = {k: v for k, v in load_kwargs.items() if k not in ("use_safetensors", "revision")}
    return directory, dict(kwargs, gguf_file=name, config=gguf_config(path), quantization_config=GgufConfig(dequantize=True))


def load_causal_lm(path: str, adapter: str | None, *, dtype: torch.dtype, device: torch.device,
                   quantization: str = "none", **kwargs):
    """A causal LM from ``path`` with the peft LoRA ``adapter`` (e.g. an SFT result) merged into its weights.

    Merging into 4/8-bit weights would add the LoRA delta to already-rounded weights (peft warns of
    rounding errors), so a quantized model is loaded in ``dtype``, merged, saved to a temporary
    directory and loaded again quantized: the weights are those of quantizing base + adapter, as if
    the merged model had been saved and loaded quantized. This needs the full-precision model in
    memory and on disk once, while loading. A GGUF file (dequantized) asked for in 4/8 bit takes the
    same way, with no adapter to merge.
    """
    from transformers import AutoModelForCausalLM

    if adapter is None and (quantization == "none" or not is_gguf(path)):
        return load_pretrained(AutoModelForCausalLM, path, dtype=dtype, device=device, quantization=quantization, **kwargs)
    base = load_pretrained(AutoModelForCausalLM, path, dtype=dtype, device=device, **kwargs)
    merged = merge_adapter_into(base, adapter, path) if adapter is not None else base
    if quantization == "none":
        return merged
    with tempfile.TemporaryDirectory(prefix="ppo-merged-") as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        del merged, base
        kwargs.pop("revision", None)  # the revision named the base on the hub, not this directory
        model = load_pretrained(AutoModelForCausalLM, tmp, dtype=dtype, device=device, quantization=quantization, **kwargs)
    model.config._name_or_path = path  # not the deleted temporary directory
    return model


def merge_adapter_into(model: nn.Module, adapter: str, base_path: str) -> nn.Module:
    """``model`` with the peft adapter at ``adapter`` folded into its weights (a plain transformers model again)."""
    from peft import PeftModel

    check_adapter_reference(adapter)
    _check_adapter_base_class(adapter, model, base_path)
    try:
        merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    except (OSError, ValueError, RuntimeError, KeyError) as err:
        hint = _hub_hint(adapter) if isinstance(err, OSError) else \
            "the adapter must have been trained on this base model (policy.path)"
        raise ModelLoadError(f"cannot apply adapter '{adapter}' (policy.adapter) to '{base_path}': {first_line(err)}",
                             hint=hint) from err
    disable_dropout(merged)
    return merged


def _check_adapter_base_class(adapter: str, model: nn.Module, base_path: str) -> None:
    """An adapter trained on another architecture can load without an error when its shapes happen to fit
    (and then merges garbage): peft records the base's class, so compare it with the model's."""
    import json

    config_file = Path(adapter).expanduser() / "adapter_config.json"
    if not config_file.is_file():
        return  # a hub id: peft reads its config while loading
    try:
        trained_on = json.loads(config_file.read_text(encoding="utf-8")).get("auto_mapping", {}).get("base_model_class")
    except (OSError, ValueError, AttributeError):
        return
    loaded = type(unwrap_causal_lm(model)).__name__
    if trained_on and trained_on != loaded:
        raise ModelLoadError(f"adapter '{adapter}' (policy.adapter) was trained on a {trained_on}, but '{base_path}' is a {loaded}",
                             hint="use the adapter with the base model it was trained on (its adapter_config.json names it)")


def freeze(model: nn.Module) -> nn.Module:
    """A frozen model for inference: no gradients, and eval mode unless it is quantized.

    bitsandbytes repacks a 4-bit layer's weights for its CPU kernel on the first no-grad forward in
    eval mode; that repack breaks the next backward (an in-place error on a leaf that requires grad) and fails outright on layers narrower
    than its block size. Dropout is already off everywhere (disable_dropout), so train mode computes
    the same thing without the repack.
    """
    model.requires_grad_(False)
    return model.train() if is_quantized(model) else model.eval()


def is_quantized(model: nn.Module) -> bool:
    """Loaded in 4 or 8 bit by bitsandbytes (looking through a peft wrapper)."""
    lm = unwrap_causal_lm(model)
    return any(getattr(lm, flag, False) for flag in ("is_quantized", "is_loaded_in_4bit", "is_loaded_in_8bit"))


def _hub_hint(path: str) -> str | None:
    """A name that is not a local directory was read as a hub id; say so, since a typo'd local path
    ('mymodel') fails the same way as an unreachable hub."""
    if Path(path).expanduser().exists():
        return None
    offline = "" if hub_offline() else ", or set HF_HUB_OFFLINE=1 to use local models only"
    return f"'{path}' is not a directory under {Path.cwd()}, so it was read as a hub id: check the spelling and the network{offline}"


def load_tokenizer(path: str, *, trust_remote_code: bool = False, revision: str | None = None):
    from transformers import AutoTokenizer

    from ppo_cli.gguf_cache import gguf_tokenizer

    check_model_reference(path)
    try:
        if is_gguf(path):  # the tokenizer and chat template are in the file's metadata
            tokenizer = gguf_tokenizer(path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code, revision=revision)
    except (OSError, ValueError) as err:
        hint = _hub_hint(path) if isinstance(err, OSError) else None
        raise ModelLoadError(f"cannot load tokenizer from '{path}': {first_line(err)}", hint=hint) from err
    if tokenizer.pad_token_id is None:
        # Masks come from positions, never from comparing ids with pad, so EOS as pad is safe here.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def peft_lora_config(lora: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def save_adapter(policy: nn.Module, adapter: str, target: Path, state_dict: dict | None = None) -> None:
    """One peft adapter of ``policy`` in peft's format at ``target`` (peft writes an adapter not named
    "default" into a subfolder of its name: it is moved up). ``state_dict``: the policy's weights when
    its modules do not hold them whole (FSDP), else None."""
    import shutil

    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        policy.save_pretrained(tmp, selected_adapters=[adapter], state_dict=state_dict)
        shutil.move(str(Path(tmp) / adapter), target)


def adapter_tensors(policy: nn.Module, adapter: str) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of one peft adapter of ``policy``, what save_adapter writes."""
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(policy, adapter_name=adapter).items())


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (its LoRA layers are injected in place)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def hidden_size_of(model: nn.Module) -> int:
    config = unwrap_causal_lm(model).config
    return getattr(config, "hidden_size", None) or config.get_text_config().hidden_size
