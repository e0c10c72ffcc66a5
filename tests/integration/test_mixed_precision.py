"""`ppo train` with train.mixed_precision on the tiny models: the first PPO ratio stays 1 under bf16
autocast (rollout and update compute alike), QLoRA still trains, and two runs with different
precisions in one process each get theirs (accelerate keeps its precision in a process singleton)."""

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ppo_cli.cli import app
from tests.conftest import ROOT, tiny_overrides

pytestmark = pytest.mark.slow
runner = CliRunner()

SHORT = {
    "data.prompts": ROOT / "recipes/prompts/reviews.txt",
    "train.total_updates": 2, "ppo.rollout_batch_size": 8, "ppo.mini_batch_size": 4, "ppo.micro_batch_size": 4,
    "generation.max_new_tokens": 12,
}


def _train(recipe: str, models: Path, out: Path, name: str, precision: str, **extra) -> tuple[list[dict], dict, str]:
    args = ["train", str(ROOT / "recipes" / recipe)]
    sets = {**SHORT, "name": name, "train.mixed_precision": precision, **extra}
    for item in tiny_overrides(models, out, **sets):
        args += ["--set", item]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    run = out / name
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return metrics, json.loads((run / "summary.json").read_text()), result.output


def _assert_finite_with_first_ratio_near_1(metrics: list[dict]) -> None:
    for row in metrics:
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float))}
        assert all(math.isfinite(v) for v in numbers.values()), numbers
        assert row["skipped"] == 0, row
        # Rollout and update run the same bf16 kernels: measured exactly 1. A rollout outside the
        # update's autocast put it 0.9995-1.0013 here (tiny_sentiment, 3 updates; QLoRA 1.0003-1.0006),
        # so the bound is far tighter than the 1e-2 asked of mixed precision, to catch that.
        assert abs(row["val/ratio_first_minibatch"] - 1.0) <= 1e-4, row["val/ratio_first_minibatch"]


def test_bf16_then_fp32_in_one_process_each_run_in_the_precision_asked(tiny_models, tmp_path):
    bf16, bf16_summary, output = _train("tiny_sentiment.yaml", tiny_models, tmp_path, "bf16", "bf16")
    assert bf16_summary["mixed_precision"] == "bf16"
    assert "mixed precision bf16 (probe: fp32 " in output
    _assert_finite_with_first_ratio_near_1(bf16)

    fp32, fp32_summary, output = _train("tiny_sentiment.yaml", tiny_models, tmp_path, "fp32", "no")
    assert fp32_summary["mixed_precision"] == "no"
    assert "mixed precision no (probe: fp32 " in output
    _assert_finite_with_first_ratio_near_1(fp32)
    # Same seed and prompts (the tiny model samples the same first responses in both): the old
    # log-probs (objective/entropy sums them) differ by bf16's rounding. Were the second run silently
    # still in bf16 (accelerate's singleton), they would be equal.
    first_bf16, first_fp32 = bf16[0]["objective/entropy"], fp32[0]["objective/entropy"]
    assert first_bf16 == pytest.approx(first_fp32, rel=0.05) and first_bf16 != first_fp32


def test_qlora_trains_under_bf16_autocast(tiny_models, tmp_path):
    metrics, summary, _ = _train("tiny_qlora.yaml", tiny_models, tmp_path, "qlora-bf16", "bf16")
    assert summary["mixed_precision"] == "bf16"
    _assert_finite_with_first_ratio_near_1(metrics)


def seed_probe(models: Path, fp32_ms: float, bf16_ms: float) -> None:
    """Write the probe's answer for the tiny policy's widths into the cache, at the recipe's one thread."""
    import torch

    from ppo_cli.engine.precision import model_widths
    from ppo_cli.engine.precision_probe import ProbeResult, cached_probe

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny_sentiment.yaml's train.num_threads: part of the cache key
    try:
        seeded = ProbeResult(fp32_ms, bf16_ms, 0.0, 0.0, update_flops=1e9, cpu="Seeded CPU")
        cached_probe(*model_widths(str(models / "policy")), probe=lambda *_: seeded)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fp32_ms, bf16_ms, expected", [(8.8, 14.5, "no"), (14.5, 8.8, "bf16")])
def test_auto_takes_what_the_probe_measured_and_says_so(tiny_models, tmp_path, monkeypatch, fp32_ms, bf16_ms, expected):
    monkeypatch.setenv("PPO_CLI_CACHE_DIR", str(tmp_path / "cache"))
    seed_probe(tiny_models, fp32_ms, bf16_ms)
    metrics, summary, output = _train("tiny_sentiment.yaml", tiny_models, tmp_path, f"auto-{expected}", "auto")
    line = f"mixed precision auto -> {expected} (probe: fp32 {fp32_ms} ms, bf16 {bf16_ms} ms per step on Seeded CPU)"
    first = " ".join(output.split("...")[0].split())  # rich wraps the first line at the test terminal's width
    # The start-up line goes on with the other choices auto made (gradient checkpointing, the heap tuning).
    assert first.startswith(f"loading models for auto-{expected} ({line}; gradient checkpointing auto -> off ")
    assert summary["mixed_precision"] == expected
    assert summary["mixed_precision_choice"] == {
        "setting": "auto", "value": expected, "reason": "probe", "probe_fp32_ms": fp32_ms, "probe_bf16_ms": bf16_ms,
        "cpu": "Seeded CPU", "described": line,
    }
    _assert_finite_with_first_ratio_near_1(metrics)
    # MFU against the seeded peak (1e9 FLOPs in the chosen precision's update-shaped ms), decode bandwidth
    assert all(row["perf/mfu_rollout"] > 0 and row["perf/mfu_update"] > 0 and row["perf/decode_gbps"] > 0 for row in metrics)


def test_a_resumed_run_keeps_the_precision_its_checkpoint_ran_in(tiny_models, tmp_path, monkeypatch):
    """`auto` resolved to bf16 by the probe; the probe answers fp32 by the time the run is resumed (another
    load, another probe version): the resumed updates still compute in bf16, as the first ones did."""
    monkeypatch.setenv("PPO_CLI_CACHE_DIR", str(tmp_path / "cache"))
    seed_probe(tiny_models, 14.5, 8.8)  # bf16 faster
    with_eval = {"data.eval_prompts": ROOT / "recipes/prompts/reviews_eval.txt"}  # the recipe's default, kept on
    _, first, _ = _train("tiny_sentiment.yaml", tiny_models, tmp_path, "resumed", "auto", **{"train.save_every": 2}, **with_eval)
    assert first["mixed_precision"] == "bf16"
    checkpoint = tmp_path / "resumed" / "checkpoints" / "step-000002"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["mixed_precision"] == "bf16"

    monkeypatch.setenv("PPO_CLI_CACHE_DIR", str(tmp_path / "cache-later"))
    seed_probe(tiny_models, 8.8, 14.5)  # now fp32 faster: a fresh run would take 'no'
    args = ["train", str(ROOT / "recipes" / "tiny_sentiment.yaml")]
    for item in tiny_overrides(tiny_models, tmp_path, **{**SHORT, "name": "resumed", "train.mixed_precision": "auto",
                                                          "train.total_updates": 3, "train.save_every": 2, **with_eval}):
        args += ["--set", item]
    result = runner.invoke(app, args + ["--resume", "latest"])  # what a bare --resume becomes in main()
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["updates"] == 3 and summary["mixed_precision"] == "bf16"
    assert summary["mixed_precision_choice"]["reason"] == "as the run being resumed chose it"
