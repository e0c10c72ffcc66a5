"""Out of memory and out of disk: one line naming the phase and the fix, never 'a bug'."""

import errno
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ppo_cli.cli import app
from ppo_cli.errors import CheckpointError
from ppo_cli.resource_errors import OutOfMemory, disk_space_for, is_out_of_memory, phase
from tests.conftest import ROOT, tiny_overrides

RECIPE = str(ROOT / "recipes" / "tiny_sentiment.yaml")


def _cpu_allocation_failure() -> RuntimeError:
    """What the CPU allocator raises for a request it cannot meet (a real one, not a message we made)."""
    with pytest.raises(RuntimeError) as caught:
        torch.empty(2**62, dtype=torch.uint8)
    return caught.value


def test_allocation_failures_are_recognised_and_other_errors_are_not():
    assert is_out_of_memory(_cpu_allocation_failure())
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only allocator error types


def test_phase_names_where_memory_ran_out_and_lets_other_errors_through():
    with pytest.raises(OutOfMemory, match=r"^out of memory while updating: .*allocate"):
        with phase("updating"):
            torch.empty(2**62, dtype=torch.uint8)
    with pytest.raises(KeyError):
        with phase("updating"):
            raise KeyError("x")


def test_disk_full_says_what_is_intact(tmp_path: Path):
    target = tmp_path / "checkpoints" / "step-000004"
    with pytest.raises(CheckpointError) as caught:
        with disk_space_for(target, "the last complete checkpoint, step-000002, is intact"):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert re.fullmatch(rf"disk full while writing {re.escape(str(target))} \(\d+\.\d MB free\); "
                        "the last complete checkpoint, step-000002, is intact", str(caught.value))
    with pytest.raises(OSError, match="Permission denied"):
        with disk_space_for(target, "..."):
            raise OSError(errno.EACCES, "Permission denied")


def _train(models: Path, out: Path, *extra: str, **sets):
    args = ["train", RECIPE]
    small = {"data.eval_prompts": ROOT / "recipes/prompts/reviews_eval.txt", "ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 4,
             "ppo.micro_batch_size": 4, "generation.max_new_tokens": 6, **sets}
    for item in tiny_overrides(models, out, **small):
        args += ["--set", item]
    return CliRunner().invoke(app, args + list(extra))


@pytest.mark.slow
def test_out_of_memory_in_the_update_is_one_line_with_the_plans_peak(tiny_models, tmp_path, monkeypatch):
    from ppo_cli import trainer

    def optimise_that_runs_out(*args, **kwargs):
        return torch.empty(2**62, dtype=torch.uint8)  # a real allocator failure

    monkeypatch.setattr(trainer, "optimise", optimise_that_runs_out)
    result = _train(tiny_models, tmp_path, **{"train.total_updates": 2})
    assert result.exit_code == 1, result.output
    lines = [line for line in result.output.splitlines() if line.startswith(("error:", "hint:"))]
    assert lines[0].startswith("error: out of memory while updating the policy and critic: "), result.output
    assert "ppo plan expects a peak of " in lines[0] and "bug" not in result.output
    assert lines[1].startswith("hint: ") and "ppo " in lines[1]
    assert not (tmp_path / "tiny-sentiment").exists()  # no update finished: nothing left behind


@pytest.mark.slow
def test_disk_full_at_a_checkpoint_keeps_the_previous_one_and_resume_works(tiny_models, tmp_path, monkeypatch):
    from ppo_cli import checkpoint

    real_save, calls = checkpoint.save_policy_and_value, []

    def save_until_the_disk_fills(ac, tokenizer, directory, *args, **kwargs):
        calls.append(directory)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(ac, tokenizer, directory, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "save_policy_and_value", save_until_the_disk_fills)
    result = _train(tiny_models, tmp_path, **{"train.total_updates": 2, "train.save_every": 1})
    assert result.exit_code == 1, result.output
    run = tmp_path / "tiny-sentiment"
    first = run / "checkpoints" / "step-000001"
    assert f"error: disk full while writing {run / 'checkpoints' / 'step-000002'} (" in result.output, result.output
    assert f"; the last complete checkpoint, {first}, is intact" in result.output, result.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001"]  # no half-written one
    checkpoint.verify_manifest(first)
    monkeypatch.setattr(checkpoint, "save_policy_and_value", real_save)
    resumed = _train(tiny_models, tmp_path, "--resume", "latest", **{"train.total_updates": 2, "train.save_every": 1})
    assert resumed.exit_code == 0, resumed.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    assert (run / "final" / "manifest.json").exists()


def test_errno_less_failures_of_torch_save_and_safetensors_are_recognised(tmp_path):
    """What torch.save (no errno) and safetensors (errno in the text) raise on a full disk, as seen on a 3 MB tmpfs."""
    from ppo_cli.resource_errors import write_failure

    torch_writer = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    torch_writer.__context__ = RuntimeError("basic_ios::clear: iostream error")
    safetensors = Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    assert write_failure(safetensors, tmp_path) == "disk full"
    assert write_failure(OSError(errno.EFBIG, "File too large"), tmp_path) == "file too large"
    assert write_failure(RuntimeError("shape mismatch"), tmp_path) is None
    # torch's writer without an errno: decided by the free space left (plenty here, and no file size limit).
    assert write_failure(torch_writer, tmp_path) is None


def _mount_tmpfs(path: Path, size: int) -> bool:
    path.mkdir(exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _resize_tmpfs(path: Path, size: int) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True, capture_output=True)


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of its own (needs root and mount; skipped elsewhere), resized by the test."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, 256 * 2**20):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield disk
    finally:
        # lazy: a file the run left open (an event file, a log) would keep the mount busy
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.mark.slow
def test_a_really_full_disk_at_a_checkpoint_is_one_line_and_resume_finishes_once_there_is_room(tiny_models, small_disk):
    """torch.save's zip writer raises a RuntimeError without errno on a full disk ('unexpected pos'):
    it must read as a full disk, not as a bug, and leave the complete checkpoints resumable."""
    sets = {"train.save_every": 1, "train.keep_checkpoints": 2}
    assert _train(tiny_models, small_disk, **sets, **{"train.total_updates": 1}).exit_code == 0
    run = small_disk / "tiny-sentiment"
    first = run / "checkpoints" / "step-000001"
    training_state = (first / "training_state.pt").stat().st_size
    # Room for update 2's metrics and every checkpoint file but half of training_state.pt: torch.save fails.
    used = shutil.disk_usage(small_disk).used
    room = _bytes(first) - training_state // 2 + 256 * 1024
    _resize_tmpfs(small_disk, used + room)

    result = _train(tiny_models, small_disk, "--resume", "latest", **sets, **{"train.total_updates": 3})
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output and "bug" not in result.output, result.output
    assert re.fullmatch(rf"error: disk full while writing {re.escape(str(run / 'checkpoints' / 'step-000002'))} "
                        rf"\(\d+\.\d MB free\); the last complete checkpoint, {re.escape(str(first))}, is intact",
                        errors[0]), result.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001"]  # no half-written one
    checkpoint_module = __import__("ppo_cli.checkpoint", fromlist=["verify_manifest"])
    checkpoint_module.verify_manifest(first)

    _resize_tmpfs(small_disk, 256 * 2**20)
    resumed = _train(tiny_models, small_disk, "--resume", "latest", **sets, **{"train.total_updates": 3})
    assert resumed.exit_code == 0, resumed.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000003"]
    assert json.loads((run / "final" / "ppo_cli.json").read_text())["step"] == 3


def test_a_full_disk_outside_checkpoints_is_not_called_a_bug(capsys):
    from ppo_cli.cli import report_error

    assert report_error(OSError(errno.ENOSPC, "No space left on device")) == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: disk full: [Errno 28] No space left on device",
        "hint: free space on the output directory's disk, then resume (ppo train RECIPE --resume)",
    ]


def test_the_out_of_memory_hint_keeps_the_users_overrides_before_the_change_that_fits(monkeypatch):
    import types

    from ppo_cli import plan_memory, resource_errors
    from ppo_cli.commands import plan
    from ppo_cli.commands.train import advice_from_plan

    monkeypatch.setattr(plan, "run", lambda recipe, device: types.SimpleNamespace(
        estimate=types.SimpleNamespace(total_gb=30.0), settings=None))
    monkeypatch.setattr(plan_memory, "model_shapes", lambda recipe: {})
    monkeypatch.setattr(plan_memory, "suggestions", lambda settings, shapes, budget: [
        plan_memory.Suggestion("micro-batch 2", ["ppo.micro_batch_size=2"], 9.0, True)])
    monkeypatch.setattr(resource_errors, "machine_memory_gb", lambda device: 24.0)
    err = OutOfMemory("update", "CUDA out of memory")
    advice = advice_from_plan(err, None, Path("recipes/x.yaml"), torch.device("cpu"),
                              ["name=mine", "ppo.micro_batch_size=8"])
    assert advice.hint == ("micro-batch 2: ppo train recipes/x.yaml --set name=mine --set ppo.micro_batch_size=8 "
                           "--set ppo.micro_batch_size=2")
    assert advice.detail == "CUDA out of memory; ppo plan expects a peak of 30.0 GB on 24.0 GB"
