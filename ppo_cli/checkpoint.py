"""Saving trained weights: periodic checkpoints and final/, each written whole or not at all.

A directory is written under a temporary name in the same folder and renamed into place when
complete; its manifest (files, sizes, sha256) is the last file written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ppo_cli.engine.models import POLICY_ADAPTER, VALUE_ADAPTER, ActorCritic, unwrap_causal_lm

MANIFEST = "manifest.json"
INFO = "ppo_cli.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, info: dict) -> None:
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    manifest = {
        **info,
        "files": {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files},
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))


def _save_adapter(ac: ActorCritic, adapter: str, target: Path) -> None:
    """peft writes a non-default adapter into a subfolder named after it; move it to ``target``."""
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        ac.policy.save_pretrained(tmp, selected_adapters=[adapter])
        shutil.move(str(Path(tmp) / adapter), target)


def save_policy_and_value(ac: ActorCritic, tokenizer, directory: Path) -> None:
    """Adapter (peft format) or full weights at the top of ``directory``, the critic beside them."""
    if ac.is_peft:
        _save_adapter(ac, POLICY_ADAPTER, directory / "_policy")
        for item in (directory / "_policy").iterdir():
            shutil.move(str(item), directory / item.name)
        (directory / "_policy").rmdir()
        if ac.value_kind == "adapter":
            _save_adapter(ac, VALUE_ADAPTER, directory / "value_adapter")
    else:
        unwrap_causal_lm(ac.policy).save_pretrained(directory, safe_serialization=True)
    if ac.value_backbone is not None:
        ac.value_backbone.save_pretrained(directory / "value_model", safe_serialization=True)
    head = {name: t.detach().contiguous().cpu() for name, t in ac.value_head.state_dict().items()}
    save_file(head, directory / "value_head.safetensors")
    tokenizer.save_pretrained(directory)


def save_final(ac: ActorCritic, tokenizer, final_dir: Path, info: dict, merge_dtype: torch.dtype | None = None) -> None:
    """Write final/ atomically; with ``merge_dtype`` also final/merged/ (LoRA folded into the base)."""
    tmp = Path(tempfile.mkdtemp(dir=final_dir.parent, prefix=".final-"))
    try:
        save_policy_and_value(ac, tokenizer, tmp)
        (tmp / INFO).write_text(json.dumps(info, indent=2))
        if merge_dtype is not None and ac.is_peft:
            merge_adapter(info["policy_path"], tmp, tmp / "merged", merge_dtype, info.get("trust_remote_code", False))
            tokenizer.save_pretrained(tmp / "merged")
        write_manifest(tmp, {"kind": "final", "step": info.get("step")})
        if final_dir.exists():
            shutil.rmtree(final_dir)
        tmp.rename(final_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def merge_adapter(base_path: str, adapter_dir: Path, out_dir: Path, dtype: torch.dtype, trust_remote_code: bool) -> None:
    """Reload the base unquantized (QLoRA too), apply the adapter, fold it in, save plain weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype, trust_remote_code=trust_remote_code, use_safetensors=True)
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.save_pretrained(out_dir, safe_serialization=True)


def rng_state() -> dict:
    """Every RNG the run draws from, in a form torch.load(weights_only=True) can read back."""
    import random

    import numpy as np

    np_state = np.random.get_state()
    state = {
        "python": list(random.getstate()[1]) + [random.getstate()[2]],
        "python_version": random.getstate()[0],
        "numpy": {"keys": torch.from_numpy(np_state[1].astype("int64")), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save_checkpoint(state, checkpoints_dir: Path, keep: int) -> Path:
    """checkpoints/step-NNNNNN/: weights, optimizer, scheduler, KL controller, data position, RNGs."""
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    final_dir = checkpoints_dir / f"step-{state.step:06d}"
    tmp = Path(tempfile.mkdtemp(dir=checkpoints_dir, prefix=f".step-{state.step:06d}-"))
    try:
        save_policy_and_value(state.engine.actor_critic, state.engine.tokenizer, tmp)
        torch.save(
            {"optimizer": state.optimizer.state_dict(), "scheduler": state.scheduler.state_dict(), "rng": rng_state()},
            tmp / "training_state.pt",
        )
        trainer_state = {
            "step": state.step, "episodes": state.episodes,
            "kl_controller": state.kl_controller.state_dict(), "sampler": state.sampler.state_dict(),
        }
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        write_manifest(tmp, {"kind": "checkpoint", "step": state.step})
        if final_dir.exists():
            shutil.rmtree(final_dir)
        tmp.rename(final_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    complete = sorted(p for p in checkpoints_dir.glob("step-*") if (p / MANIFEST).exists())
    for old in complete[:-keep]:
        shutil.rmtree(old)
    return final_dir
