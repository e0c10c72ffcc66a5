"""`ppo train` rewarded by servers on loopback (tests/fixtures/reward_servers.py): learning with failing requests,
a server killed mid-run then --resume, a judge end to end with secrets kept out of every file and line,
and the math-verify example recipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.fixtures.reward_servers import JudgeServer, RewardServer

pytestmark = pytest.mark.slow
FUNCTION_RECIPE = ROOT / "recipes" / "tiny_function_reward.yaml"


def _cmd(recipe: Path, models: Path, out: Path, components: list[dict], *extra: str, **sets) -> list[str]:
    settings = {"policy.path": models / "policy", "output_dir": out, "reward.components": json.dumps(components),
                "data.prompts": ROOT / "recipes/prompts/reviews.txt", **sets}
    args = [sys.executable, "-m", "ppo_cli", "train", str(recipe)]
    for key, value in settings.items():
        args += ["--set", f"{key}={value}"]
    return args + list(extra)


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **extra}


def _metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _http(server: RewardServer, **extra) -> dict:
    return {"type": "http", "url": server.score_url, "timeout_s": 5, "retry_backoff_s": 0.05, **extra}


@pytest.fixture
def server():
    server = RewardServer().start()
    yield server
    server.stop()


def test_http_reward_learns_with_a_fifth_of_the_requests_failing(tiny_models, tmp_path, server):
    """The tiny function-reward recipe with its reward served over HTTP (the same function, in the
    server), every fifth request answering 500 and no retries: those completions leave the update
    (reward/failed_rate about 0.2) and the run still learns as the function reward does."""
    server.fault, server.fail_every, server.probe_ok = "flaky", 5, True
    cmd = _cmd(FUNCTION_RECIPE, tiny_models, tmp_path, [_http(server, batch_size=4, retries=0)],
               **{"data.eval_prompts": ROOT / "recipes/prompts/reviews_eval.txt"})
    result = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    run = tmp_path / "tiny-function-reward"
    metrics = _metrics(run)
    failed = [m["reward/failed_rate"] for m in metrics]
    assert 0.1 <= sum(failed) / len(failed) <= 0.3, failed
    assert "no reward" in result.stdout  # the progress line shows the share without a reward
    summary = json.loads((run / "summary.json").read_text())
    assert summary["after"]["score"] >= summary["before"]["score"] + 5.0, summary
    assert any(w["rule"] == "reward_failures" for w in summary["warnings"]), summary["warnings"]


def test_a_server_killed_mid_run_stops_it_in_one_line_and_resume_continues(tiny_models, tmp_path, server):
    small = {"ppo.rollout_batch_size": 8, "ppo.mini_batch_size": 4, "ppo.micro_batch_size": 4,
             "generation.max_new_tokens": 12, "train.total_updates": 6, "train.save_every": 1}
    cmd = _cmd(FUNCTION_RECIPE, tiny_models, tmp_path, [_http(server, retries=1, timeout_s=2)], **small)
    run = tmp_path / "tiny-function-reward"
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(_metrics(run)) < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)
    server.stop()
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    assert errors[0].startswith("error: update ") and f"no completion got a reward: {server.score_url}: cannot connect" in errors[0]
    stopped_at = len(_metrics(run))
    assert (run / "checkpoints" / f"step-{stopped_at:06d}").is_dir()  # the last finished update's checkpoint

    server.start()
    resumed = subprocess.run(cmd + ["--resume"], env=_env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert [m["step"] for m in _metrics(run)] == [1, 2, 3, 4, 5, 6]


def test_judge_and_http_with_credentials_end_to_end_never_write_the_secrets(tiny_models, tmp_path, server):
    rm_token, judge_key = "rm-Secret-4242", "judge-Secret-9191"
    judge = JudgeServer(api_key=judge_key).start()
    try:
        components = [
            _http(server, headers={"Authorization": "Bearer ${RM_TOKEN}"}),
            {"type": "judge", "base_url": judge.base_url, "model": "judge", "api_key_env": "JUDGE_API_KEY",
             "prompt": str(ROOT / "recipes/judges/helpful.txt"), "scale": [1, 10], "weight": 5.0, "timeout_s": 5},
        ]
        small = {"ppo.rollout_batch_size": 8, "ppo.mini_batch_size": 4, "ppo.micro_batch_size": 4,
                 "generation.max_new_tokens": 12, "train.total_updates": 2,
                 "data.eval_prompts": ROOT / "recipes/prompts/reviews_eval.txt"}
        result = subprocess.run(_cmd(FUNCTION_RECIPE, tiny_models, tmp_path, components, **small), capture_output=True,
                                text=True, timeout=600, env=_env(RM_TOKEN=rm_token, JUDGE_API_KEY=judge_key))
        assert result.returncode == 0, result.stderr
    finally:
        judge.stop()
    run = tmp_path / "tiny-function-reward"
    assert server.requests[-1]["headers"]["Authorization"] == f"Bearer {rm_token}"
    assert len(judge.requests) > 16 and judge.requests[-1]["headers"]["Authorization"] == f"Bearer {judge_key}"
    metrics = _metrics(run)
    assert {"reward/judge:judge", f"reward/http:127.0.0.1:{server.port}"} <= set(metrics[-1])
    assert "${RM_TOKEN}" in (run / "recipe.yaml").read_text()
    texts = [result.stdout, result.stderr] + [p.read_text(errors="replace") for p in run.rglob("*")
                                              if p.is_file() and p.suffix in (".json", ".jsonl", ".yaml", ".md", ".txt")]
    assert len(texts) > 6  # recipe.yaml, summary.json, eval.json, metrics, samples, final/README.md ...
    for text in texts:
        assert rm_token not in text and judge_key not in text


def test_math_recipe_scores_with_the_rows_reference_answers(tiny_models, tmp_path):
    recipe = ROOT / "recipes" / "tiny_math.yaml"
    components = [{"type": "function", "function": str(ROOT / "recipes/rewards/math_answer.py:reward")}]
    cmd = _cmd(recipe, tiny_models, tmp_path, components, **{"data.prompts": ROOT / "recipes/data/tiny_math.jsonl",
                                                              "data.eval_prompts": ROOT / "recipes/data/tiny_math_eval.jsonl",
                                                              "train.total_updates": 2})
    result = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    metrics = _metrics(tmp_path / "tiny-math")
    assert [m["reward/failed_rate"] for m in metrics] == [0.0, 0.0]  # every row has its answer
    assert all(m["reward/reward"] in (0.0, 1.0) or 0 < m["reward/reward"] < 1 for m in metrics)


def test_eval_and_rollout_then_score_give_rewards_the_columns_of_their_prompts_file(tiny_models, tmp_path):
    reward = tmp_path / "answer_reward.py"
    reward.write_text("def reward(prompts, responses, answer):\n    return [float(a) for a in answer]\n")
    other = tmp_path / "other.jsonl"  # not the recipe's data: its rows' answers are what the reward must get
    other.write_text('{"prompt": "The film was", "answer": "1"}\n{"prompt": "The food was", "answer": "5"}\n')
    sets = {"policy.path": tiny_models / "policy", "output_dir": tmp_path, "data.prompts": ROOT / "recipes/data/tiny_math.jsonl",
            "generation.max_new_tokens": 4,
            "reward.components": json.dumps([{"type": "function", "function": f"{reward}:reward"}])}
    common = ["--recipe", str(FUNCTION_RECIPE), *(arg for k, v in sets.items() for arg in ("--set", f"{k}={v}"))]
    model = str(tiny_models / "policy")

    def ppo(*args):
        result = subprocess.run([sys.executable, "-m", "ppo_cli", *args], env=_env(), capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr

    ppo("eval", model, "--prompts", str(other), "--out", str(tmp_path / "eval.json"), *common)
    assert json.loads((tmp_path / "eval.json").read_text())["reward_components"]["reward"] == 3.0
    ppo("rollout", model, "--prompts", str(other), "--out", str(tmp_path / "rollouts.jsonl"), *common)
    rows = [json.loads(line) for line in (tmp_path / "rollouts.jsonl").read_text().splitlines()]
    assert [r["columns"] for r in rows] == [{"answer": "1"}, {"answer": "5"}]
    ppo("score", str(tmp_path / "rollouts.jsonl"), "--out", str(tmp_path / "scored.jsonl"), *common)
    scored = [json.loads(line) for line in (tmp_path / "scored.jsonl").read_text().splitlines()]
    assert [r["reward_components"]["reward"] for r in scored] == [1.0, 5.0]
