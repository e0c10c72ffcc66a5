"""Out of memory and out of disk: one line naming the phase and the fix, never 'a bug'."""

import errno
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ppo_cli.cli import app
from ppo_cli.errors import CheckpointError
from ppo_cli.memory_errors import OutOfMemory, disk_space_for, is_out_of_memory, phase
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
    assert str(caught.value) == f"no space left on the device while writing {target}; the last complete checkpoint, step-000002, is intact"
    with pytest.raises(OSError, match="Permission denied"):
        with disk_space_for(target, "..."):
            raise OSError(errno.EACCES, "Permission denied")


def _train(models: Path, out: Path, *extra: str, **sets):
    args = ["train", RECIPE]
    small = {"data.eval_prompts": "null", "ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 4,
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
    assert f"error: no space left on the device while writing {run / 'checkpoints' / 'step-000002'}; " \
           f"the last complete checkpoint, {first}, is intact" in " ".join(result.output.split()), result.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001"]  # no half-written one
    checkpoint.verify_manifest(first)
    monkeypatch.setattr(checkpoint, "save_policy_and_value", real_save)
    resumed = _train(tiny_models, tmp_path, "--resume", "latest", **{"train.total_updates": 2, "train.save_every": 1})
    assert resumed.exit_code == 0, resumed.output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    assert (run / "final" / "manifest.json").exists()
