"""`ppo validate` and `ppo score` with an http reward and a judge on loopback: one line for a server that
does not answer (exit 2, before anything loads), the same components scoring rows, secrets never shown.
No model is loaded (a config.json stands in for the policy; score loads only the reward)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ppo_cli.cli import app
from ppo_cli.errors import EXIT_RUNTIME, EXIT_USAGE
from tests.conftest import ROOT
from tests.fixtures.reward_servers import JudgeServer, RewardServer

runner = CliRunner()
FAST = {"timeout_s": 1.0, "retries": 1, "retry_backoff_s": 0.01}


@pytest.fixture
def server():
    server = RewardServer().start()
    yield server
    server.stop()


def _recipe(tmp_path: Path, components: list[dict]) -> Path:
    (tmp_path / "policy").mkdir(exist_ok=True)
    (tmp_path / "policy" / "config.json").write_text("{}")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "The movie was", "answer": "good"}\n')
    recipe = {"name": "remote", "policy": {"path": str(tmp_path / "policy")}, "reward": {"components": components},
              "data": {"prompts": str(tmp_path / "prompts.jsonl")}, "output_dir": str(tmp_path / "runs"),
              "ppo": {"rollout_batch_size": 4, "mini_batch_size": 4, "micro_batch_size": 4}, "train": {"total_updates": 1}}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _rollouts(tmp_path: Path) -> Path:
    path = tmp_path / "rollouts.jsonl"
    rows = [{"prompt": "The movie was", "response": r} for r in ("great fun", "awful", "a chair")]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def test_validate_says_in_one_line_that_a_reward_server_does_not_answer(tmp_path, server):
    recipe = _recipe(tmp_path, [{"type": "http", "url": server.score_url, **FAST}])
    assert runner.invoke(app, ["validate", str(recipe)]).exit_code == 0
    assert server.requests[-1]["body"] == {"prompts": [], "responses": [], "columns": {}}
    server.stop()
    result = runner.invoke(app, ["validate", str(recipe)])
    assert result.exit_code == EXIT_USAGE
    (line,) = _error_lines(result)
    assert line.startswith(f"error: http reward {server.score_url} cannot be reached (")
    assert "Traceback" not in result.output


def test_score_uses_the_http_reward_and_the_judge(tmp_path, server):
    judge = JudgeServer().start()
    try:
        recipe = _recipe(tmp_path, [
            {"type": "http", "url": server.score_url, **FAST},
            {"type": "judge", "base_url": judge.base_url, "model": "judge", "prompt": str(ROOT / "recipes/judges/helpful.txt"),
             "weight": 2.0, **FAST},
        ])
        out = tmp_path / "scored.jsonl"
        result = runner.invoke(app, ["score", str(_rollouts(tmp_path)), "--recipe", str(recipe), "--out", str(out)])
        assert result.exit_code == 0, result.output
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        http, judged = f"http:127.0.0.1:{server.port}", "judge:judge"
        # short_positive: 10 / -1 / 0.1; the judge: 'Score: 10' -> 1, 'Score: 1' -> 0, times weight 2
        assert [r["reward_components"] for r in rows] == [{http: 10.0, judged: 1.0}, {http: -1.0, judged: 0.0},
                                                          {http: 0.1, judged: 0.0}]
        assert [r["reward"] for r in rows] == [12.0, -1.0, 0.1]
        assert server.requests[-1]["body"]["columns"] == {"answer": ["good", "good", "good"]}
    finally:
        judge.stop()


def test_score_with_every_reward_failed_stops_in_one_line_without_the_secret(tmp_path, server, monkeypatch):
    monkeypatch.setenv("RM_TOKEN", "tok-XYZ-123")
    recipe = _recipe(tmp_path, [{"type": "http", "url": server.score_url, "headers": {"Authorization": "Bearer ${RM_TOKEN}"},
                                 **FAST}])
    server.fault, server.probe_ok = "echo_auth", True  # answers 500 to real work, quoting the Authorization header back
    result = runner.invoke(app, ["score", str(_rollouts(tmp_path)), "--recipe", str(recipe),
                                 "--out", str(tmp_path / "out.jsonl")])
    assert result.exit_code == EXIT_RUNTIME
    (line,) = _error_lines(result)
    assert line == (f"error: no row got a reward: {server.score_url}: HTTP 500 '{{\"error\": \"bad token Bearer ***\"}}' "
                    "(2 attempts)")
    assert "tok-XYZ-123" not in result.output
    assert server.requests[-1]["headers"]["Authorization"] == "Bearer tok-XYZ-123"


def test_validate_refuses_credentials_over_plain_http_to_another_host(tmp_path):
    recipe = _recipe(tmp_path, [{"type": "http", "url": "http://192.0.2.7:8000/score",
                                 "headers": {"Authorization": "Bearer ${RM_TOKEN}"}}])
    result = runner.invoke(app, ["validate", str(recipe)])
    assert result.exit_code == EXIT_USAGE
    (line,) = _error_lines(result)
    assert line.endswith("would send credentials over plain http to 192.0.2.7")


def _answer_reward(tmp_path: Path) -> dict:
    path = tmp_path / "answer_reward.py"
    path.write_text("def reward(prompts, responses, answer):\n    return [float(a) for a in answer]\n")
    return {"type": "function", "function": f"{path}:reward"}


def test_score_gives_rewards_the_columns_each_rollout_row_kept(tmp_path, server):
    recipe = _recipe(tmp_path, [_answer_reward(tmp_path), {"type": "http", "url": server.score_url, **FAST}])
    rollouts = tmp_path / "rollouts.jsonl"  # as `ppo rollout --prompts other.jsonl` writes them: not the recipe's rows
    rows = [{"prompt": "What is 3+4?", "response": "great", "columns": {"answer": "7"}},
            {"prompt": "What is 1+1?", "response": "awful", "columns": {"answer": "2"}}]
    rollouts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "scored.jsonl"
    result = runner.invoke(app, ["score", str(rollouts), "--recipe", str(recipe), "--out", str(out)])
    assert result.exit_code == 0, result.output
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["reward_components"]["reward"] for r in scored] == [7.0, 2.0]
    assert server.requests[-1]["body"]["columns"] == {"answer": ["7", "2"]}


def test_eval_refuses_a_reward_needing_a_column_its_prompts_file_lacks_before_loading(tmp_path):
    recipe = _recipe(tmp_path, [_answer_reward(tmp_path)])
    other = tmp_path / "other.jsonl"
    other.write_text('{"prompt": "What is 3+4?", "id": 1}\n')
    # the policy is a bare config.json: loading it would fail, so the refusal comes first
    result = runner.invoke(app, ["eval", str(tmp_path / "policy"), "--recipe", str(recipe), "--prompts", str(other),
                                 "--out", str(tmp_path / "eval.json")])
    assert result.exit_code != 0
    (line,) = _error_lines(result)
    assert line == (f"error: reward function '{tmp_path}/answer_reward.py:reward' takes the column(s) answer, which the "
                    f"rows of {other} do not have (they have: id, prompt)")
    assert "Traceback" not in result.output
