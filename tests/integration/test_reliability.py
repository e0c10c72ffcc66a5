"""Runs that survive SIGKILL, Ctrl-C and NaNs: checkpoints, exact resume, numerical guards."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, tiny_overrides, is_wall_clock

pytestmark = pytest.mark.slow
RECIPE = str(ROOT / "recipes" / "tiny_sentiment.yaml")
SMALL = {
    "data.prompts": ROOT / "recipes/prompts/reviews.txt", "data.eval_prompts": ROOT / "recipes/prompts/reviews_eval.txt",
    "ppo.rollout_batch_size": 8, "ppo.mini_batch_size": 4, "ppo.micro_batch_size": 4,
    "generation.max_new_tokens": 12, "train.total_updates": 6, "train.save_every": 2,
}
COMPARED_EXACTLY = 1e-6  # resumed metrics equal the uninterrupted run's to 1e-6


def _cmd(models: Path, out: Path, *extra: str, **sets) -> list[str]:
    args = [sys.executable, "-m", "ppo_cli", "train", RECIPE]
    for item in tiny_overrides(models, out, **{**SMALL, **sets}):
        args += ["--set", item]
    return args + list(extra)


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _assert_same_metrics(resumed: list[dict], reference: list[dict]) -> None:
    assert [m["step"] for m in resumed] == [m["step"] for m in reference]
    for got, want in zip(resumed, reference):
        for key, value in want.items():
            if is_wall_clock(key) or not isinstance(value, (int, float)):
                continue  # wall-clock figures differ from run to run
            assert got[key] == pytest.approx(value, abs=COMPARED_EXACTLY), (got["step"], key)


def _assert_same_held_out(run: Path, reference: Path) -> None:
    """The held-out evaluation before and after (eval.json) equals the reference run's: a resumed run
    reports the 'before' it saved at its start, and evaluates the same policy after."""
    got, want = (json.loads((r / "eval.json").read_text()) for r in (run, reference))
    for when in ("before", "after"):
        assert [s["response"] for s in got[when]["samples"]] == [s["response"] for s in want[when]["samples"]], when
        for key in ("score", "kl", "response_length"):
            assert got[when][key] == pytest.approx(want[when][key], abs=COMPARED_EXACTLY), (when, key)


@pytest.fixture(scope="module")
def uninterrupted_run(tiny_models, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    subprocess.run(_cmd(tiny_models, out), check=True, env=_env(), capture_output=True)
    return out / "tiny-sentiment"


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run) -> list[dict]:
    return _metrics(uninterrupted_run)


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_sigkill_after_a_checkpoint_then_resume_gives_the_uninterrupted_metrics(tiny_models, tmp_path, uninterrupted,
                                                                                uninterrupted_run):
    run = tmp_path / "tiny-sentiment"
    proc = subprocess.Popen(_cmd(tiny_models, tmp_path), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _wait_for(lambda: (run / "checkpoints" / "step-000002" / "manifest.json").exists(), proc)
    proc.kill()  # SIGKILL: no handler runs, whatever was being written is cut off
    proc.wait()
    assert not (run / "final").exists()
    resumed = subprocess.run(_cmd(tiny_models, tmp_path, "--resume"), env=_env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    _assert_same_metrics(_metrics(run), uninterrupted)
    _assert_same_held_out(run, uninterrupted_run)
    assert (run / "final" / "manifest.json").exists()
    # no temporary directory survives a kill and a resume
    assert not [p for p in run.rglob(".*") if p.name.startswith((".step-", ".final-"))]


def test_sigint_finishes_the_update_checkpoints_and_resumes(tiny_models, tmp_path, uninterrupted, uninterrupted_run):
    run = tmp_path / "tiny-sentiment"
    proc = subprocess.Popen(_cmd(tiny_models, tmp_path, **{"train.save_every": 0}), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 1, proc)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    # The run was started with --set overrides: the hint resumes it from its saved recipe, which holds them.
    assert stderr.splitlines()[-1] == f"hint: resume with: ppo train {run / 'recipe.yaml'} --resume"
    assert stderr.splitlines()[-2].startswith("stopped: interrupted after update ") and "checkpoint saved" in stderr
    saved = sorted((run / "checkpoints").glob("step-*"))
    assert len(saved) == 1 and (saved[0] / "manifest.json").exists()
    ppo, *hinted = shlex.split(stderr.splitlines()[-1].removeprefix("hint: resume with: "))
    resumed = subprocess.run([sys.executable, "-m", "ppo_cli", *hinted], env=_env(), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    _assert_same_metrics(_metrics(run), uninterrupted)
    _assert_same_held_out(run, uninterrupted_run)


def test_a_finished_run_says_so_on_resume_and_extends_exactly(tiny_models, tmp_path, uninterrupted):
    """--resume on a finished run changes nothing; with more total_updates it continues after the last
    update (checkpointed too) and matches a run that was given the larger number from the start."""
    run = tmp_path / "tiny-sentiment"
    first = subprocess.run(_cmd(tiny_models, tmp_path, **{"train.total_updates": 4}), env=_env(), capture_output=True, text=True)
    assert first.returncode == 0, first.stderr
    assert (run / "checkpoints" / "step-000004" / "manifest.json").exists()
    final_before = (run / "final" / "ppo_cli.json").read_bytes()

    again = subprocess.run(_cmd(tiny_models, tmp_path, "--resume", **{"train.total_updates": 4}),
                           env=_env(), capture_output=True, text=True)
    assert again.returncode == 2
    assert again.stderr.splitlines()[0] == f"error: run {run} is already complete (4/4 updates)"
    assert (run / "final" / "ppo_cli.json").read_bytes() == final_before and len(_metrics(run)) == 4

    extended = subprocess.run(_cmd(tiny_models, tmp_path, "--resume"), env=_env(), capture_output=True, text=True)
    assert extended.returncode == 0, extended.stderr
    assert "step-000004 at update 4" in extended.stdout
    assert "with recipe changes: train.total_updates: 4 -> 6" in extended.stdout
    # the run's own recipe now says what it ran with last, so it resumes and reports the run as it is
    assert yaml.safe_load((run / "recipe.yaml").read_text())["train"]["total_updates"] == 6
    _assert_same_metrics(_metrics(run), uninterrupted)


def test_nan_rewards_leave_their_completions_then_the_run_stops_with_a_diagnostic(tiny_models, tmp_path):
    reward = tmp_path / "nan_after_two.py"
    reward.write_text(
        "calls = 0\n"
        "def reward(prompts, responses):\n"
        "    global calls\n"
        "    calls += 1  # call 1: the held-out evaluation before the first update (its 16 prompts in one call)\n"
        "    if calls == 4:  # update 3: one NaN: that completion leaves the update, the others train\n"
        "        return [float('nan')] + [1.0] * (len(responses) - 1)\n"
        "    return [float('nan') if calls > 4 else 1.0 for _ in responses]\n"
    )
    run = tmp_path / "tiny-sentiment"
    result = subprocess.run(
        _cmd(tiny_models, tmp_path, **{
            "reward.components": "[{type: function, function: '%s:reward'}]" % reward,
            "train.save_every": 1, "train.total_updates": 10,
        }),
        env=_env(), capture_output=True, text=True,
    )
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    n = SMALL["ppo.rollout_batch_size"]
    assert lines[-2] == (f"error: update 4: no completion got a reward: reward function '{reward}:reward' returned "
                         f"NaN or inf for {n} of {n} responses")
    assert lines[-1].startswith("hint: the checkpoints written so far are intact")
    assert "Traceback" not in result.stderr
    metrics = _metrics(run)
    assert [m["skipped"] for m in metrics] == [0, 0, 0]
    assert [m["reward/failed_rate"] for m in metrics] == [0.0, 0.0, pytest.approx(1 / n)]
    # The last good checkpoint is intact and loadable; the stopped update wrote none.
    from ppo_cli.checkpoint import latest_checkpoint, verify_manifest

    latest = latest_checkpoint(run / "checkpoints")
    assert latest.name == "step-000003"
    verify_manifest(latest)
    assert not (run / "final").exists()
