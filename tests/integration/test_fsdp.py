"""FSDP2 through `accelerate launch --config_file recipes/accelerate/fsdp.yaml` with 2 CPU processes
(gloo): the same numbers as DDP, SIGKILL + exact resume, full fine-tuning, final/ in the usual layout."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from tests.conftest import ROOT, model_overrides, is_wall_clock

pytestmark = pytest.mark.slow
FSDP_CONFIG = ROOT / "recipes/accelerate/fsdp.yaml"
SMALL = {
    "data.prompts": ROOT / "recipes/prompts/reviews.txt",
    "ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 2, "ppo.micro_batch_size": 1,
    "generation.max_new_tokens": 10, "train.total_updates": 4, "train.save_every": 2,
}
FULL_FINETUNE = {"policy.lora": "null", "value.kind": "model", "optim.lr": 1e-5}
AGREES_WITH_DDP = 1e-5  # reduce-scatter and all-reduce sum in another order
COMPARED_EXACTLY = 1e-6  # a resumed run against the uninterrupted one


def _cmd(models: Path, out: Path, *extra: str, fsdp: bool = True, **sets) -> list[str]:
    recipe = str(ROOT / "recipes/tiny_sentiment.yaml")
    if fsdp:
        args = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG),
                "--main_process_port", str(_free_port()), "-m", "ppo_cli", "train", recipe]
    else:
        args = [sys.executable, "-m", "ppo_cli", "train", recipe, "--num-processes", "2"]
    for item in model_overrides(models, out, **{**SMALL, **sets}):
        args += ["--set", item]
    return args + list(extra)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def _run(args: list[str]) -> None:
    result = subprocess.run(args, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_same_metrics(got_all: list[dict], want_all: list[dict], tolerance: float) -> None:
    assert [m["step"] for m in got_all] == [m["step"] for m in want_all]
    for got, want in zip(got_all, want_all):
        for key, value in want.items():
            if is_wall_clock(key) or not isinstance(value, (int, float)):
                continue  # wall-clock figures differ from run to run
            assert got[key] == pytest.approx(value, abs=tolerance), (got["step"], key)


def _assert_same_weights(got_file: Path, want_file: Path, tolerance: float) -> None:
    got, want = load_file(got_file), load_file(want_file)
    assert sorted(got) == sorted(want)
    for name in want:
        assert (got[name] - want[name]).abs().max().item() <= tolerance, name


@pytest.fixture(scope="module")
def fsdp_run(tiny_models, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp")
    _run(_cmd(tiny_models, out))
    return out / "tiny-sentiment"


def test_fsdp_lora_trains_like_ddp_and_writes_a_normal_adapter(fsdp_run, tiny_models, tmp_path):
    """Same global batch, same seed: FSDP's numbers and weights are DDP's (2 updates of DDP suffice)."""
    _run(_cmd(tiny_models, tmp_path, fsdp=False, **{"train.total_updates": 2}))
    ddp = tmp_path / "tiny-sentiment"
    fsdp_metrics = _metrics(fsdp_run)
    assert [m["step"] for m in fsdp_metrics] == [1, 2, 3, 4] and fsdp_metrics[-1]["episode"] == 4 * 4 * 2
    _assert_same_metrics(fsdp_metrics[:2], _metrics(ddp), AGREES_WITH_DDP)
    # The gathered adapter, value adapter and head of the FSDP checkpoint are DDP's.
    for name in ("adapter_model.safetensors", "critic/value_adapter/adapter_model.safetensors", "critic/value_head.safetensors"):
        _assert_same_weights(fsdp_run / "checkpoints/step-000002" / name, ddp / "final" / name, AGREES_WITH_DDP)
    # final/ is an ordinary peft adapter: peft loads it onto the base model.
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_models / "policy"), fsdp_run / "final")
    trained = load_file(fsdp_run / "final/adapter_model.safetensors")
    assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k)  # B starts at 0: it was trained
    assert sum(p.numel() for n, p in policy.named_parameters() if "lora_" in n) == sum(v.numel() for v in trained.values())


def test_fsdp_sigkill_after_a_checkpoint_then_resume_gives_the_uninterrupted_metrics(fsdp_run, tiny_models, tmp_path):
    run = tmp_path / "tiny-sentiment"
    proc = subprocess.Popen(_cmd(tiny_models, tmp_path), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not (run / "checkpoints/step-000002/manifest.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    # torchrun starts the training processes in sessions of their own: kill each of them by its id.
    for process in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
        process.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (run / "final").exists()
    _run(_cmd(tiny_models, tmp_path, "--resume"))
    _assert_same_metrics(_metrics(run), _metrics(fsdp_run), COMPARED_EXACTLY)
    _assert_same_weights(run / "final/adapter_model.safetensors", fsdp_run / "final/adapter_model.safetensors", COMPARED_EXACTLY)


def test_fsdp_full_finetune_writes_the_whole_model_once(tiny_models, tmp_path):
    _run(_cmd(tiny_models, tmp_path, **FULL_FINETUNE, **{"train.total_updates": 2, "train.save_every": 0}))
    final = tmp_path / "tiny-sentiment" / "final"
    base = load_file(tiny_models / "policy" / "model.safetensors")
    trained = load_file(final / "model.safetensors")
    assert sorted(trained) == sorted(base)  # tied lm_head.weight is not written twice
    assert max((trained[k] - base[k]).abs().max().item() for k in base) > 0
    assert (final / "critic/value_model/model.safetensors").is_file()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(final)  # a plain transformers model


GRPO = {"ppo.advantage": "grpo", "generation.num_generations": 2, "value.kind": "none",
        "train.total_updates": 2, "train.save_every": 0}


def test_fsdp_grpo_trains_like_ddp_without_a_critic(tiny_models, tmp_path):
    """GRPO under FSDP: the groups are whole per process as in DDP (the prompts are split before they
    are repeated), so its group advantages, metrics and adapter are DDP's; nothing of a critic is sharded or saved."""
    _run(_cmd(tiny_models, tmp_path / "fsdp", **GRPO))
    _run(_cmd(tiny_models, tmp_path / "ddp", fsdp=False, **GRPO))
    fsdp, ddp = tmp_path / "fsdp" / "tiny-sentiment", tmp_path / "ddp" / "tiny-sentiment"
    metrics = _metrics(fsdp)
    assert metrics[-1]["episode"] == 2 * 4 * 2 * 2  # updates x prompts x completions x processes
    assert all(m["reward_std"] > 0 for m in metrics)  # the groups carry signal: the comparison below is not vacuous
    assert not [k for k in metrics[-1] if k.startswith("val/") and k not in ("val/ratio", "val/ratio_first_minibatch")]
    _assert_same_metrics(metrics, _metrics(ddp), AGREES_WITH_DDP)
    _assert_same_weights(fsdp / "final/adapter_model.safetensors", ddp / "final/adapter_model.safetensors", AGREES_WITH_DDP)
    assert not (fsdp / "final" / "critic").exists()


def test_fsdp_update_runs_under_the_rollouts_autocast(tiny_models, tmp_path):
    """bf16 autocast under FSDP2: the update's forward computes as the rollout's did, so the first
    mini-batch's ratio is 1 at every update, as under DDP (accelerate autocasts a DDP model's forward
    itself, not an FSDP2 one's: without the trainer's own autocast it was 0.99976).

    1 to bf16's batching noise, not bit for bit: the update trims each micro-batch (here one episode) to
    its longest response, the rollout's forward pads to the batch's longest, and bf16 attention rounds with
    the sequence length (SDPA at T = 6 against the same rows at T = 16: 0.0039 on one output). With every
    response at max_new_tokens the ratio was exactly 1; a draw in which one stopped early gave 1.0000007."""
    _run(_cmd(tiny_models, tmp_path, **{"train.mixed_precision": "bf16", "train.total_updates": 2, "train.save_every": 0}))
    metrics = _metrics(tmp_path / "tiny-sentiment")
    assert [m["val/ratio_first_minibatch"] for m in metrics] == pytest.approx([1.0, 1.0], abs=1e-5)
