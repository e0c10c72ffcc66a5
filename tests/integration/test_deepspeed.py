"""DeepSpeed ZeRO-2 and ZeRO-3 through `ppo train --accelerate-config recipes/accelerate/deepspeed_zero*.yaml`,
two CPU processes over gloo (DeepSpeed's CPU accelerator). Skipped where deepspeed is not installed:
scripts/deepspeed_test.sh makes a venv with it and runs these."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, tiny_overrides

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


def _train(models: Path, out: Path, config: str, **sets) -> subprocess.CompletedProcess:
    settings = {
        "data.prompts": ROOT / "recipes/prompts/reviews.txt",
        "ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 2, "ppo.micro_batch_size": 1, "ppo.ppo_epochs": 1,
        "ppo.max_kl": "null", "generation.max_new_tokens": 8, "train.total_updates": 2, "optim.max_grad_norm": 0.5,
        **sets,
    }
    args = [sys.executable, "-m", "ppo_cli", "train", str(ROOT / "recipes/tiny_sentiment.yaml"),
            "--accelerate-config", str(ROOT / "recipes/accelerate" / config if config.startswith("deepspeed_")
                                       else _every_parameter_partitioned(out)), "--num-processes", "2"]
    for item in tiny_overrides(models, out, **settings):
        args += ["--set", item]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "DS_ACCELERATOR": "cpu"}
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)


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


def test_deepspeed_refuses_checkpoints_in_one_line(tiny_models, tmp_path):
    result = _train(tiny_models, tmp_path, "deepspeed_zero2.yaml", **{"train.save_every": 1})
    assert result.returncode == 2  # refused by the launcher, before any process starts
    assert ("error: train.save_every (1) is not supported with DeepSpeed: its optimizer states are sharded "
            "across processes and a checkpoint would hold one shard") in result.stderr
    assert "Traceback" not in result.stderr
