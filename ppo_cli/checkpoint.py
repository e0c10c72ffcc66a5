"""Saving trained weights: periodic checkpoints and final/, each written whole or not at all.

A directory is written under a temporary name in the same folder and renamed into place when
complete; its manifest (files, sizes, sha256) is the last file written.

Layout of final/ and of checkpoints/step-N/: the policy at the top, as the hub expects a model
repository (peft adapter files, or full transformers weights), with the tokenizer; the critic in
critic/ (value_head.safetensors, and value_adapter/ or value_model/). Directories written before
critic/ existed kept the critic files at the top; they still load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from ppo_cli.engine.actor_critic import ActorCritic
from ppo_cli.engine.models import POLICY_ADAPTER, save_adapter, unwrap_causal_lm
from ppo_cli.engine.weights import load_safetensors_into, part_of
from ppo_cli.resource_errors import disk_space_for
from ppo_cli.runs import apply_default_modes, replace_directory, restore_replaced_directory

MANIFEST = "manifest.json"
INFO = "ppo_cli.json"
CRITIC = "critic"
VALUE_HEAD = "value_head.safetensors"
MODEL_CARD = "README.md"
DEEPSPEED = "deepspeed"  # checkpoints under DeepSpeed: its engine's files, one optimizer shard per process
DEEPSPEED_TAG = "shards"


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


def save_policy_and_value(ac: ActorCritic, tokenizer, directory: Path, full_state: dict | None = None) -> None:
    """Adapter (peft format) or full weights at the top of ``directory``, the critic in critic/.

    ``full_state``: the ActorCritic's whole state dict gathered from sharded processes (FSDP,
    Distributed.full_model_state); None reads the modules themselves.
    """
    policy_state = part_of(full_state, "policy.")
    if ac.is_peft:
        save_adapter(ac.policy, POLICY_ADAPTER, directory / "_policy", state_dict=policy_state)
        for item in (directory / "_policy").iterdir():
            shutil.move(str(item), directory / item.name)
        (directory / "_policy").rmdir()
    else:
        model = unwrap_causal_lm(ac.policy)
        model.save_pretrained(directory, safe_serialization=True, state_dict=without_tied_copies(model, policy_state))
    if ac.critic.trains:  # value.kind none (NoCritic): no critic/ at all
        critic = directory / CRITIC
        critic.mkdir()
        ac.critic.save(ac, critic, full_state)
        head = part_of(full_state, "value_head.") or ac.value_head.state_dict()
        save_file({name: t.detach().contiguous().cpu() for name, t in head.items()}, critic / VALUE_HEAD)
    tokenizer.save_pretrained(directory)


def without_tied_copies(model: torch.nn.Module, state: dict | None) -> dict | None:
    """``state`` without the second names of tied parameters (lm_head.weight of a model with tied
    embeddings): gathered copies no longer share storage, so save_pretrained would write both."""
    if state is None:
        return None
    kept = {name for name, _ in model.named_parameters()}
    tied = {name for name, _ in model.named_parameters(remove_duplicate=False)} - kept
    return {name: tensor for name, tensor in state.items() if name not in tied}


def critic_dir(directory: Path) -> Path:
    """Where a checkpoint or final/ keeps its critic: critic/, or the top for directories written before it."""
    return directory / CRITIC if (directory / CRITIC).is_dir() else directory


def temporary_beside(target: Path) -> Path:
    """A new empty directory beside ``target``, to be renamed into its place by atomic_directory."""
    target.parent.mkdir(parents=True, exist_ok=True)
    restore_replaced_directory(target)
    return Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))


@contextlib.contextmanager
def atomic_directory(target: Path, manifest_info: dict, tmp: Path | None = None):
    """Yield a temporary directory beside ``target``; when the block succeeds, write the manifest
    last and swap it into place. A crash at any moment leaves a complete ``target``: the old one or
    the new one (replace_directory). ``tmp``: one made already by temporary_beside (DeepSpeed: every
    process has written its shard into it)."""
    tmp = tmp or temporary_beside(target)
    try:
        yield tmp
        write_manifest(tmp, manifest_info)
        apply_default_modes(tmp)  # mkdtemp's 0700 (and any library's private files) would hide the run
        replace_directory(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_final(ac: ActorCritic, tokenizer, final_dir: Path, info: dict, merge_dtype: torch.dtype | None = None,
               model_card: str | None = None, full_state: dict | None = None) -> None:
    """Write final/ atomically, with ``model_card`` as its README.md; with ``merge_dtype`` also
    final/merged/ (the policy's base + info's policy_adapter + the trained LoRA, folded into plain weights).
    ``full_state``: as for save_policy_and_value."""
    keeps = "the previous final/ (if any) and every checkpoint are intact"
    # disk_space_for inside too: it reads the free space while the partial files still fill the disk.
    with disk_space_for(final_dir, keeps), atomic_directory(final_dir, {"kind": "final", "step": info.get("step")}) as tmp, \
            disk_space_for(final_dir, keeps):
        save_policy_and_value(ac, tokenizer, tmp, full_state)
        (tmp / INFO).write_text(json.dumps(info, indent=2))
        if model_card is not None:
            (tmp / MODEL_CARD).write_text(model_card, encoding="utf-8")
        if merge_dtype is not None and ac.is_peft:
            merge_adapter(info["policy_path"], tmp, tmp / "merged", merge_dtype, info.get("trust_remote_code", False),
                          base_adapter=info.get("policy_adapter"))
            tokenizer.save_pretrained(tmp / "merged")


def merge_adapter(base_path: str, adapter_dir: Path, out_dir: Path, dtype: torch.dtype, trust_remote_code: bool,
                  base_adapter: str | None = None) -> None:
    """Reload the base unquantized (QLoRA too), merge ``base_adapter`` (the run's starting adapter) and
    then the trained adapter into it, save plain weights."""
    from peft import PeftModel

    from ppo_cli.engine.models import load_causal_lm

    base = load_causal_lm(base_path, base_adapter, dtype=dtype, device=torch.device("cpu"), trust_remote_code=trust_remote_code)
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
    """checkpoints/step-NNNNNN/: weights, optimizer, scheduler, KL controller, data position, RNGs.

    Called by every process (each one's RNG state is saved; with FSDP each one's shards are
    gathered); only the main process writes. The layout is the same with or without sharding.
    """
    final_dir = checkpoints_dir / f"step-{state.step:06d}"
    rng_states = state.dist.gather_objects(rng_state())
    if state.dist.uses_deepspeed:
        _save_deepspeed_checkpoint(state, checkpoints_dir, final_dir, rng_states, keep)
        state.dist.wait()
        return final_dir
    full_state = gathered_model_state(state)
    optimizer_state = state.dist.full_optimizer_state(state.model, state.optimizer)
    if state.dist.is_main:
        _write_checkpoint(state, checkpoints_dir, final_dir, rng_states, keep, full_state,
                          optimizer_state if optimizer_state is not None else state.optimizer.state_dict())
    state.dist.wait()
    return final_dir


def recorded_mixed_precision(directory: Path | None) -> str | None:
    """The precision a checkpoint's run computed in ('no', 'bf16', 'fp16'), None without a checkpoint or
    for one written before it was recorded."""
    if directory is None:
        return None
    try:
        return json.loads((Path(directory) / "trainer_state.json").read_text()).get("mixed_precision")
    except (OSError, ValueError):
        return None


def gathered_model_state(state) -> dict | None:
    """With FSDP, the ActorCritic's full state dict (main process; collective), else None."""
    full = state.dist.full_model_state(state.model, trained_only=state.engine.actor_critic.is_peft)
    return part_of(full, "actor_critic.")  # the prepared module is PolicyAndValue(actor_critic)


def _save_deepspeed_checkpoint(state, checkpoints_dir: Path, final_dir: Path, rng_states: list, keep: int) -> None:
    """Under DeepSpeed each process holds one shard of the optimizer states (and of the fp32 master
    weights): every process writes its own with DeepSpeed's save_checkpoint into deepspeed/ of one
    temporary directory; then the main process writes the usual files and the manifest, and renames
    it into place. Collective."""
    dist = state.dist
    tmp = temporary_beside(final_dir) if dist.is_main else None
    tmp = Path(dist.gather_objects(tmp)[0])
    # The weights are in ppo_cli's own files (the frozen base is not saved again).
    deepspeed_engine(state).save_checkpoint(str(tmp / DEEPSPEED), tag=DEEPSPEED_TAG, save_latest=False,
                                            exclude_frozen_parameters=True)
    with dist.full_parameters(state.model):  # ZeRO-3: the trained weights whole, for the main process to write
        if dist.is_main:
            _write_checkpoint(state, checkpoints_dir, final_dir, rng_states, keep, None, None, tmp=tmp)


def deepspeed_engine(state):
    return state.dist.accelerator.deepspeed_engine_wrapped.engine


def _write_checkpoint(state, checkpoints_dir: Path, final_dir: Path, rng_states: list, keep: int,
                      full_state: dict | None, optimizer_state: dict | None, tmp: Path | None = None) -> None:
    """``optimizer_state``: None under DeepSpeed (its shards are in deepspeed/, written in ``tmp``)."""
    previous = latest_checkpoint(checkpoints_dir) if checkpoints_dir.exists() else None
    keeps = f"the last complete checkpoint, {previous}, is intact" if previous else "no checkpoint was written"
    info = {"kind": "checkpoint", "step": state.step}
    with disk_space_for(final_dir, keeps), atomic_directory(final_dir, info, tmp) as tmp, \
            disk_space_for(final_dir, keeps):  # inside too, as in save_final
        save_policy_and_value(state.engine.actor_critic, state.engine.tokenizer, tmp, full_state)
        training = {"optimizer": optimizer_state, "scheduler": state.scheduler.state_dict(), "rng": rng_states}
        scaler = state.dist.accelerator.scaler  # fp16 mixed precision: the loss scale it has settled on
        if scaler is not None:
            training["grad_scaler"] = scaler.state_dict()
        torch.save(training, tmp / "training_state.pt")
        trainer_state = {
            "step": state.step, "episodes": state.episodes, "consecutive_skips": state.consecutive_skips,
            "kl_controller": state.kl_controller.state_dict(), "sampler": state.sampler.state_dict(),
            "mixed_precision": state.dist.mixed_precision,  # train.mixed_precision as resolved: a resume keeps it
        }
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
    complete = sorted(p for p in checkpoints_dir.glob("step-*") if (p / MANIFEST).exists())
    for old in complete[:-keep]:
        shutil.rmtree(old)


# --- resume --------------------------------------------------------------------------------------


def verify_manifest(directory: Path) -> dict:
    """The manifest, after checking every file it lists has its size and checksum; else CheckpointError."""
    from ppo_cli.errors import CheckpointError

    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{directory}: no {MANIFEST}, so the checkpoint is incomplete", hint="resume from an earlier checkpoint")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError):
        raise CheckpointError(f"{manifest_path}: not a valid manifest") from None
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{directory}: {name} is listed in the manifest but missing")
        if path.stat().st_size != expected["size"] or _sha256(path) != expected["sha256"]:
            raise CheckpointError(
                f"{directory}: {name} does not match its manifest (size or checksum differs)",
                hint="the checkpoint was changed or damaged; resume from another one (--resume PATH)",
            )
    return manifest


def check_same_launcher(directory: Path, deepspeed: bool) -> None:
    """A checkpoint saved under DeepSpeed holds its optimizer shards in DeepSpeed's files, others one
    torch optimizer state: each resumes only under the launcher that wrote it."""
    from ppo_cli.errors import CheckpointError

    saved = (directory / DEEPSPEED).is_dir()
    if saved and not deepspeed:
        raise CheckpointError(f"{directory} was saved under DeepSpeed; this run is not launched with DeepSpeed",
                              hint="resume with the --accelerate-config the run was started with")
    if deepspeed and not saved:
        raise CheckpointError(f"{directory} was saved without DeepSpeed; this run is launched with DeepSpeed",
                              hint="resume without --accelerate-config (or with the one the run was started with)")


def latest_checkpoint(checkpoints_dir: Path) -> Path | None:
    """The newest step-N directory with a manifest (an interrupted write has none)."""
    complete = sorted(p for p in checkpoints_dir.glob("step-*") if (p / MANIFEST).is_file())
    return complete[-1] if complete else None


def load_policy_and_value(ac: ActorCritic, directory: Path) -> None:
    """Inverse of save_policy_and_value, into already-built models."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    critic = critic_dir(directory)
    if ac.is_peft:
        set_peft_model_state_dict(ac.policy, load_file(directory / "adapter_model.safetensors"), adapter_name=POLICY_ADAPTER)
    else:
        weights = sorted(p for p in directory.glob("*.safetensors") if p.name != VALUE_HEAD)
        load_safetensors_into(unwrap_causal_lm(ac.policy), weights)
    if ac.critic.trains:
        ac.critic.load(ac, critic)
        ac.value_head.load_state_dict(load_file(critic / VALUE_HEAD))


def keyed_by_parameter_name(optimizer_state: dict) -> bool:
    """torch's optimizer.state_dict() numbers the parameters; the full state FSDP gathers names them."""
    return any(isinstance(key, str) for key in optimizer_state.get("state", {})) or any(
        isinstance(p, str) for group in optimizer_state.get("param_groups", []) for p in group.get("params", []))


def restore_rng_state(state: dict) -> None:
    import random

    import numpy as np

    random.setstate((state["python_version"], tuple(state["python"][:-1]), state["python"][-1]))
    numpy = state["numpy"]
    np.random.set_state(("MT19937", numpy["keys"].numpy().astype("uint32"), numpy["pos"], numpy["has_gauss"], numpy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_checkpoint(state, directory: Path) -> None:
    """Put a TrainState back exactly as it was when ``directory`` was saved (one process or DDP:
    with FSDP the weights go in before sharding, see load_training_state)."""
    verify_manifest(directory)
    load_policy_and_value(state.engine.actor_critic, directory)
    load_training_state(state, directory)


def load_training_state(state, directory: Path) -> None:
    """Everything of a checkpoint but the weights: optimizer, scheduler, KL controller, data, RNGs.

    The weights are loaded first (load_policy_and_value), into the models before accelerate prepares
    them: FSDP then shards the loaded weights like any others.
    """
    # weights_only: a checkpoint is data, never code.
    # map_location="cpu": accelerate names the CPU "cpu:0" with several processes, which torch.load cannot
    # restore; optimizer.load_state_dict moves each state to its parameter's device anyway.
    training = torch.load(directory / "training_state.pt", map_location="cpu", weights_only=True)
    if state.dist.uses_deepspeed:
        # The weights went in before prepare(); DeepSpeed restores each process's optimizer shard and
        # fp32 master weights (custom_load_fn: leave the module as it is).
        deepspeed_engine(state).load_checkpoint(str(directory / DEEPSPEED), tag=DEEPSPEED_TAG, load_lr_scheduler_states=False,
                                                custom_load_fn=lambda src, dst: None)
    elif keyed_by_parameter_name(training["optimizer"]):  # written from FSDP's gathered state
        state.dist.load_full_optimizer_state(state.model, state.optimizer, training["optimizer"])
    else:
        state.optimizer.load_state_dict(training["optimizer"])
    state.scheduler.load_state_dict(training["scheduler"])
    scaler = state.dist.accelerator.scaler
    if scaler is not None and "grad_scaler" in training:
        scaler.load_state_dict(training["grad_scaler"])
    trainer_state = json.loads((directory / "trainer_state.json").read_text())
    state.step, state.episodes = trainer_state["step"], trainer_state["episodes"]
    state.consecutive_skips = trainer_state.get("consecutive_skips", 0)
    state.kl_controller.load_state_dict(trainer_state["kl_controller"])
    state.sampler.load_state_dict(trainer_state["sampler"])
    rng_states = training["rng"]
    if len(rng_states) != state.dist.world_size:
        from ppo_cli.errors import CheckpointError

        raise CheckpointError(
            f"{directory} was saved by {len(rng_states)} process(es); this run has {state.dist.world_size}",
            hint=f"resume with --num-processes {len(rng_states)} for an exact continuation",
        )
    restore_rng_state(rng_states[state.dist.rank])
