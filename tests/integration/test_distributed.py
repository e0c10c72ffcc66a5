"""Two CPU processes (gloo) through `ppo train --num-processes 2`: training, disjoint prompts, resume."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, model_overrides, is_wall_clock

pytestmark = pytest.mark.slow

PROMPT_LOG = """
import json, os
def reward(prompts, responses):
    rank = os.environ.get("RANK", "0")
    with open(os.environ["PROMPT_LOG_DIR"] + f"/rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(prompts) + "\\n")
    return [10.0 if " great" in r or " good" in r else 0.0 for r in responses]
"""


def _train(models: Path, out: Path, *extra: str, **sets) -> subprocess.CompletedProcess:
    reward = out / "prompt_log.py"
    reward.write_text(PROMPT_LOG)
    settings = {
        "data.prompts": ROOT / "recipes/prompts/reviews.txt",
        "reward.components": "[{type: function, function: '%s:reward'}]" % reward,
        "ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 2, "ppo.micro_batch_size": 1,
        "generation.max_new_tokens": 10, "train.total_updates": 4, "train.save_every": 2, **sets,
    }
    args = [sys.executable, "-m", "ppo_cli", "train", str(ROOT / "recipes/tiny_sentiment.yaml"), "--num-processes", "2"]
    for item in model_overrides(models, out, **settings):
        args += ["--set", item]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PROMPT_LOG_DIR": str(out)}
    return subprocess.run(args + list(extra), env=env, capture_output=True, text=True, timeout=600)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def two_process_run(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    result = _train(tiny_models, out)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_two_processes_train_and_only_the_main_one_writes(two_process_run):
    run = two_process_run / "tiny-sentiment"
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # one line per update, not one per process
    assert metrics[-1]["episode"] == 4 * 4 * 2  # updates x rollout_batch_size x processes
    assert (run / "final" / "adapter_model.safetensors").exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000002", "step-000004"]


EVAL_PROMPTS = (ROOT / "recipes/prompts/reviews_eval.txt").read_text().splitlines()


def _reward_calls(out: Path, rank: int) -> tuple[list, list]:
    """(training calls, held-out evaluation calls) of one process's reward function, in order."""
    calls = [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]
    evaluation = [c for c in calls if set(c) <= set(EVAL_PROMPTS)]
    return [c for c in calls if c not in evaluation], evaluation


def test_each_process_sees_different_prompts_in_every_update(two_process_run):
    calls = {rank: _reward_calls(two_process_run, rank)[0] for rank in (0, 1)}
    assert len(calls[0]) == len(calls[1]) == 4
    for update, (mine, theirs) in enumerate(zip(calls[0], calls[1])):
        assert len(mine) == len(theirs) == 4
        assert not set(mine) & set(theirs), f"update {update + 1} shared prompts"


def test_every_process_evaluates_its_half_and_eval_json_has_every_prompt_in_order(two_process_run):
    """Before and after training, each process scores its contiguous half of the held-out prompts (so
    a sharded model is used by all processes at once); eval.json holds all of them in file order."""
    assert len(EVAL_PROMPTS) == 16
    for rank in (0, 1):
        assert _reward_calls(two_process_run, rank)[1] == [EVAL_PROMPTS[8 * rank:8 * rank + 8]] * 2  # before, after
    run = two_process_run / "tiny-sentiment"
    evaluation = json.loads((run / "eval.json").read_text())
    for when in ("before", "after"):
        samples = evaluation[when]["samples"]
        assert [s["prompt"] for s in samples] == EVAL_PROMPTS
        assert evaluation[when]["score"] == pytest.approx(sum(s["score"] for s in samples) / 16)
        assert evaluation[when]["eos_rate"] == pytest.approx(sum(s["finished"] for s in samples) / 16)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["after"]["score"] == pytest.approx(evaluation["after"]["score"])


def test_resume_with_two_processes_continues_exactly(two_process_run, tiny_models):
    run = two_process_run / "tiny-sentiment"
    uninterrupted = _metrics(run)
    result = _train(tiny_models, two_process_run, "--resume", str(run / "checkpoints" / "step-000002"))
    assert result.returncode == 0, result.stderr[-3000:]
    resumed = _metrics(run)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for got, want in zip(resumed, uninterrupted):
        for key, value in want.items():
            if isinstance(value, (int, float)) and not is_wall_clock(key):
                assert got[key] == pytest.approx(value, abs=1e-6), (got["step"], key)



def test_grpo_with_two_processes_keeps_each_group_whole_on_one_process(tiny_models, tmp_path):
    result = _train(tiny_models, tmp_path, **{"ppo.advantage": "grpo", "generation.num_generations": 2,
                                              "value.kind": "none", "train.total_updates": 2, "train.save_every": 0})
    assert result.returncode == 0, result.stderr[-3000:]
    calls = {rank: _reward_calls(tmp_path, rank)[0] for rank in (0, 1)}
    assert len(calls[0]) == len(calls[1]) == 2
    for mine, theirs in zip(calls[0], calls[1]):
        assert len(mine) == len(theirs) == 8  # 4 prompts x 2 completions on each process
        for episodes in (mine, theirs):
            assert episodes[0::2] == episodes[1::2]  # each prompt twice in a row: its group
        assert not set(mine) & set(theirs)
    metrics = _metrics(tmp_path / "tiny-sentiment")
    assert metrics[-1]["episode"] == 2 * 8 * 2  # updates x episodes per process x processes
    assert 0.0 <= metrics[-1]["frac_reward_zero_std"] <= 1.0
    assert not (tmp_path / "tiny-sentiment" / "final" / "critic").exists()
