"""DeepSpeed ZeRO-2 and ZeRO-3 through `ppo train --accelerate-config recipes/accelerate/deepspeed_zero*.yaml`,
two CPU processes over gloo (DeepSpeed's CPU accelerator): training, and checkpoints with exact resume
(SIGKILL, Ctrl-C). Skipped where deepspeed is not installed: scripts/deepspeed_test.sh makes a venv with
it and runs these."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from safetensors.torch import load_file

from tests.conftest import ROOT, tiny_overrides, is_wall_clock

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="deepspeed is not installed (scripts/deepspeed_test.sh runs these)"),
]


def _every_parameter_partitioned(out: Path) -> Path:
    """ZeRO-3 as recipes/accelerate/deepspeed_zero3.yaml, but DeepSpeed's default keeps parameters under
    1e5 elements whole on every process, which is all of the tiny policy's: threshold 0 shards them all."""
    ds = out / "ds_zero3.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                              "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                              "gradient_accumulation_steps": 1}))
    config = out / "zero3_all.yaml"
    config.write_text(yaml.safe_dump({
        "compute_environment": "LOCAL_MACHINE", "distributed_type": "DEEPSPEED", "num_machines": 1, "num_processes": 2,
        "machine_rank": 0, "rdzv_backend": "static", "same_network": True, "use_cpu": False,
        "deepspeed_config": {"deepspeed_config_file": str(ds), "zero3_init_flag": False},
    }))
    return config


def _command(models: Path, out: Path, config: str, *extra: str, recipe: str = "tiny_sentiment.yaml", **sets) -> list[str]:
    settings = {
        "data.prompts": ROOT / "recipes/prompts/reviews.txt",
        "ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 2, "ppo.micro_batch_size": 1, "ppo.ppo_epochs": 1,
        "ppo.max_kl": "null", "generation.max_new_tokens": 8, "train.total_updates": 2, "optim.max_grad_norm": 0.5,
        **sets,
    }
    args = [sys.executable, "-m", "ppo_cli", "train", str(ROOT / "recipes" / recipe),
            "--accelerate-config", str(ROOT / "recipes/accelerate" / config if config.startswith("deepspeed_")
                                       else _every_parameter_partitioned(out)), "--num-processes", "2"]
    for item in tiny_overrides(models, out, **settings):
        args += ["--set", item]
    return args + list(extra)


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}


def _train(models: Path, out: Path, config: str, *extra: str, **sets) -> subprocess.CompletedProcess:
    return subprocess.run(_command(models, out, config, *extra, **sets), env=_env(), capture_output=True, text=True,
                          timeout=600)


def test_deepspeed_zero2_trains_grpo_without_a_critic(tiny_models, tmp_path):
    """value.kind none under ZeRO-2: one parameter group (the policy's), groups whole on each process,
    and the old log-probs from the update's first epoch across two accumulated micro-batches."""
    result = _train(tiny_models, tmp_path, "deepspeed_zero2.yaml", recipe="tiny_grpo.yaml", **{
        "generation.num_generations": 2, "ppo.rollout_batch_size": 2,
        "ppo.mini_batch_size": 4, "ppo.micro_batch_size": 2, "train.total_updates": 1})
    assert result.returncode == 0, result.stderr[-4000:]
    run = tmp_path / "tiny-grpo"
    (m,) = _metrics(run)
    assert m["episode"] == 2 * 2 * 2  # prompts x completions x processes
    assert m["val/ratio_first_minibatch"] == 1.0  # the first epoch's own log-probs, before DeepSpeed's one step
    assert m["policy/grad_norm"] > 0 and m["loss/kl_avg"] >= 0.0 and 0.0 <= m["frac_reward_zero_std"] <= 1.0
    assert "loss/value_avg" not in m and "value_lr" not in m
    assert (run / "final" / "adapter_model.safetensors").exists() and not (run / "final" / "critic").exists()
    evaluation = json.loads((run / "eval.json").read_text())  # the recipe's held-out prompts, on both processes
    assert len(evaluation["before"]["samples"]) == len(evaluation["after"]["samples"]) == 16


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("config", ["deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "zero3, every parameter partitioned"])
def test_deepspeed_trains_with_two_cpu_processes(tiny_models, tmp_path, config):
    result = _train(tiny_models, tmp_path, config)
    assert result.returncode == 0, result.stderr[-4000:]
    run = tmp_path / "tiny-sentiment"
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    assert metrics[-1]["episode"] == 2 * 4 * 2  # updates x rollout_batch_size x processes
    for m in metrics:
        # Two micro-batches per mini-batch: had DeepSpeed stepped after the first, the second's ratio
        # (still "before any step") would be off 1.
        assert m["val/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-5)
        assert m["policy/grad_norm"] > 0
    # Saved whole: under ZeRO-3 each process holds a slice of every LoRA matrix, the save gathers them.
    from safetensors.torch import load_file

    adapter = load_file(run / "final" / "adapter_model.safetensors")
    assert adapter and all(t.shape[0 if ".lora_A." in name else 1] == 16 for name, t in adapter.items())
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())


# --- checkpoints and exact resume -----------------------------------------------------------------

RESUMABLE = {"train.total_updates": 4, "train.save_every": 2}
COMPARED_EXACTLY = 1e-6  # a resumed run against the uninterrupted one
STAGES = ["deepspeed_zero2.yaml", "zero3, every parameter partitioned"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """config -> the run directory of 4 uninterrupted updates (checkpoints at 2 and 4), made on first use."""
    runs = {}

    def get(config: str) -> Path:
        if config not in runs:
            out = tmp_path_factory.mktemp("uninterrupted")
            result = _train(tiny_models, out, config, **RESUMABLE)
            assert result.returncode == 0, result.stderr[-4000:]
            runs[config] = out / "tiny-sentiment"
        return runs[config]
    return get


def _training_processes(launcher: subprocess.Popen) -> list[psutil.Process]:
    """The launched `ppo train` processes (the leaves under the launcher; torchrun starts them in
    sessions of their own, so a signal to the launcher's group does not reach them)."""
    tree = psutil.Process(launcher.pid).children(recursive=True)
    return [p for p in tree if "ppo_cli" in " ".join(p.cmdline()) and not p.children()]


def _wait_for(condition, proc: subprocess.Popen, seconds: float = 400) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, "the run ended early"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _assert_resumed_equals(run: Path, want: Path) -> None:
    got_metrics, want_metrics = _metrics(run), _metrics(want)
    assert [m["step"] for m in got_metrics] == [1, 2, 3, 4] == [m["step"] for m in want_metrics]
    for got, expected in zip(got_metrics, want_metrics):
        for key, value in expected.items():
            if is_wall_clock(key) or not isinstance(value, (int, float)):
                continue  # wall-clock figures differ from run to run
            assert got[key] == pytest.approx(value, abs=COMPARED_EXACTLY), (got["step"], key)
    for name in ("adapter_model.safetensors", "critic/value_head.safetensors"):
        got, expected = load_file(run / "final" / name), load_file(want / "final" / name)
        assert sorted(got) == sorted(expected)
        assert max((got[k] - expected[k]).abs().max().item() for k in expected) <= COMPARED_EXACTLY, name
    # The held-out evaluation after training samples the same responses from the same weights.
    got_eval, want_eval = (json.loads((r / "eval.json").read_text())["after"] for r in (run, want))
    assert [s["response"] for s in got_eval["samples"]] == [s["response"] for s in want_eval["samples"]]
    assert got_eval["score"] == pytest.approx(want_eval["score"], abs=COMPARED_EXACTLY)
    assert not [p for p in run.rglob(".*") if p.name.startswith((".step-", ".final-"))]


@pytest.mark.parametrize("config", STAGES)
def test_deepspeed_sigkill_after_a_checkpoint_then_resume_gives_the_uninterrupted_metrics(
        tiny_models, tmp_path, uninterrupted, config):
    run = tmp_path / "tiny-sentiment"
    proc = subprocess.Popen(_command(tiny_models, tmp_path, config, **RESUMABLE), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(lambda: (run / "checkpoints/step-000002/manifest.json").exists(), proc)
    for process in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        process.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run / "final").exists()
    # One optimizer shard per process, written by each into the checkpoint, and listed in its manifest.
    manifest = json.loads((run / "checkpoints/step-000002/manifest.json").read_text())
    assert len([name for name in manifest["files"] if name.startswith("deepspeed/") and "optim_states" in name]) == 2
    resumed = _train(tiny_models, tmp_path, config, "--resume", **RESUMABLE)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resumed from" in resumed.stdout
    _assert_resumed_equals(run, uninterrupted(config))


def test_deepspeed_ctrl_c_finishes_the_update_checkpoints_and_resumes(tiny_models, tmp_path, uninterrupted):
    config = "zero3, every parameter partitioned"
    run = tmp_path / "tiny-sentiment"
    sets = {**RESUMABLE, "train.save_every": 0}
    proc = subprocess.Popen(_command(tiny_models, tmp_path, config, **sets), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 1, proc)
    for process in _training_processes(proc):  # Ctrl-C in a terminal reaches every process
        process.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=400)
    assert proc.returncode != 0
    assert "checkpoint saved" in stderr and "--resume" in stderr, stderr[-3000:]
    assert stderr.count("stopped: interrupted after update") == 2  # one line from each process
    # accelerate's launcher prints its own traceback (ChildFailedError) when a process exits non-zero;
    # none comes from ppo_cli's code.
    assert f'File "{ROOT / "ppo_cli"}' not in stderr, stderr[-3000:]
    saved = sorted((run / "checkpoints").glob("step-*"))
    assert len(saved) == 1 and (saved[0] / "manifest.json").exists() and not (run / "final").exists()
    resumed = _train(tiny_models, tmp_path, config, "--resume", **sets)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    _assert_resumed_equals(run, uninterrupted(config))

