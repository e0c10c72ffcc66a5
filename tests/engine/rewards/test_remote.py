"""type http and type judge against real servers on loopback (tests/fixtures/reward_servers.py), and the faults.

No model is loaded: the RewardStack is built with http/judge/function components only, so these
run in the fast suite; every request has a timeout of at most a second.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from ppo_cli.engine.data import PromptColumns, PromptSet
from ppo_cli.engine.rewards.judge import fill_template, parse_score
from ppo_cli.engine.rewards.stack import RewardStack, combine_components
from ppo_cli.errors import RewardServerError, RewardServerUnreachable
from ppo_cli.recipe import RewardConfig
from ppo_cli.engine.rewards.checks import check_reward_components
from tests.conftest import ROOT
from tests.fixtures.reward_servers import JudgeServer, RewardServer

FAST = {"timeout_s": 1.0, "retries": 2, "retry_backoff_s": 0.01}
RESPONSES = ["great and wonderful", "terrible and boring", "a chair", "loved it, excellent"]
EXPECTED = [10.0, -1.0, 0.1, 10.0]  # recipes/rewards/short_positive.py


@pytest.fixture
def server():
    server = RewardServer().start()
    yield server
    server.stop()


@pytest.fixture
def judge():
    judge = JudgeServer().start()
    yield judge
    judge.stop()


def _stack(*components, columns=None) -> RewardStack:
    return RewardStack(RewardConfig(components=list(components)), torch.device("cpu"), columns=columns)


def _http(server, **extra) -> dict:
    return {"type": "http", "url": server.score_url, **FAST, **extra}


def _judge(judge, **extra) -> dict:
    return {"type": "judge", "base_url": judge.base_url, "model": "judge", "prompt": str(ROOT / "recipes/judges/helpful.txt"),
            "scale": [1, 10], **FAST, **extra}


def _score(stack, responses=RESPONSES):
    n = len(responses)
    return stack.score(["p"] * n, list(responses), [True] * n, [3] * n)


def test_http_reward_matches_the_function_batched_and_concurrent(server):
    server.delay_s = 0.2
    result = _score(_stack(_http(server, batch_size=1, max_concurrency=2)))
    assert result.scores == EXPECTED
    assert result.components == {f"http:127.0.0.1:{server.port}": EXPECTED}
    assert [len(r["body"]["responses"]) for r in server.requests] == [1, 1, 1, 1]
    assert server.max_in_flight == 2  # four requests, two at a time


def test_http_reward_sends_prompts_responses_and_the_rows_columns(server):
    columns = PromptColumns([PromptSet(["q1", "q2"], columns=[{"answer": "4"}, {"answer": "9"}])])
    result = _stack(_http(server, batch_size=2), columns=columns).score(["q2", "q1", "q2"], RESPONSES[:3], [True] * 3, [1] * 3)
    assert result.scores == EXPECTED[:3]
    # the two requests go out concurrently, so they may arrive in either order
    first, second = sorted((r["body"] for r in server.requests), key=lambda body: -len(body["prompts"]))
    assert first == {"prompts": ["q2", "q1"], "responses": RESPONSES[:2], "columns": {"answer": ["9", "4"]}}
    assert second == {"prompts": ["q2"], "responses": RESPONSES[2:3], "columns": {"answer": ["9"]}}


@pytest.mark.parametrize("fault, attempts, said", [
    ("500", 3, "HTTP 500 '{\"error\": \"internal error\"}' (3 attempts)"),
    ("slow", 3, "no answer within 1 s (3 attempts)"),
    ("malformed", 1, "answered with something that is not JSON: \"{'rewards': [1.0,\""),
    ("wrong_length", 1, "answered 3 rewards for 4 responses"),
])
def test_a_failed_request_leaves_its_completions_without_a_reward_and_says_why(server, fault, attempts, said):
    server.fault, server.slow_s = fault, 1.5
    started = time.monotonic()
    result = _score(_stack(_http(server)))
    assert time.monotonic() - started < 8  # bounded: 3 attempts of at most 1 s, and short waits
    assert result.scores == [None] * 4
    name = f"http:127.0.0.1:{server.port}"
    assert result.components[name] == [None] * 4
    assert result.failures[name].startswith(server.score_url) and result.failures[name].endswith(said)
    assert len(server.requests) == attempts


def test_a_null_reward_fails_only_its_completion(server):
    server.fault = "null_first"
    result = _score(_stack(_http(server)))
    assert result.scores == [None] + EXPECTED[1:]
    assert result.scored == [False, True, True, True]


def test_retries_recover_from_one_500(server):
    server.fault, server.fail_every = "flaky", 2  # the 2nd request fails, its retry (3rd) succeeds
    result = _score(_stack(_http(server, batch_size=2, max_concurrency=1)))
    assert result.scores == EXPECTED and not result.failures
    assert len(server.requests) == 3


def test_on_failure_error_stops_at_the_first_failure_in_one_line(server):
    server.fault = "500"
    with pytest.raises(RewardServerError) as info:
        _score(_stack(_http(server, on_failure="error", retries=0)))
    assert str(info.value) == f"reward server failed: {server.score_url}: HTTP 500 '{{\"error\": \"internal error\"}}'"


def test_headers_are_resolved_from_the_environment_and_never_quoted(server, monkeypatch):
    monkeypatch.setenv("RM_TOKEN", "s3cret-token")
    result = _score(_stack(_http(server, headers={"Authorization": "Bearer ${RM_TOKEN}"})))
    assert server.requests[0]["headers"]["Authorization"] == "Bearer s3cret-token"
    assert result.scores == EXPECTED
    server.fault = "echo_auth"  # the server quotes the token back in its error
    result = _score(_stack(_http(server, headers={"Authorization": "Bearer ${RM_TOKEN}"}, retries=0)))
    failure = next(iter(result.failures.values()))
    assert "s3cret-token" not in failure and "Bearer ***" in failure


def test_a_missing_environment_variable_is_one_line(server, monkeypatch):
    monkeypatch.delenv("RM_TOKEN", raising=False)
    config = RewardConfig(components=[_http(server, headers={"Authorization": "Bearer ${RM_TOKEN}"})])
    with pytest.raises(RewardServerUnreachable) as info:
        check_reward_components(config)
    assert str(info.value) == (f"reward server {server.score_url} header 'Authorization' needs the environment variable "
                               "RM_TOKEN, which is not set")


def test_preflight_names_a_server_that_does_not_answer(server):
    url = server.score_url
    server.stop()
    with pytest.raises(RewardServerUnreachable) as info:
        check_reward_components(RewardConfig(components=[{"type": "http", "url": url, "timeout_s": 1}]))
    assert str(info.value).startswith(f"http reward {url} cannot be reached (")


def test_preflight_names_a_server_that_answers_500(server):
    server.fault = "500"
    with pytest.raises(RewardServerUnreachable) as info:
        check_reward_components(RewardConfig(components=[_http(server)]))
    assert str(info.value) == f"http reward {server.score_url} answered HTTP 500 (server error) '{{\"error\": \"internal error\"}}'"


def test_judge_scores_are_the_answer_mapped_to_0_1(judge, monkeypatch):
    monkeypatch.setenv("JUDGE_API_KEY", "judge-key-123")
    judge.api_key = "judge-key-123"
    stack = _stack(_judge(judge, api_key_env="JUDGE_API_KEY"))
    check_reward_components(stack.config)  # GET /v1/models with the key
    result = _score(stack)
    assert result.scores == [1.0, 0.0, 0.0, 1.0]  # 'Score: 10' -> 1, 'Score: 1' -> 0
    sent = [r["body"] for r in judge.requests[1:]]  # after the GET /v1/models
    assert all(body["model"] == "judge" and body["temperature"] == 0 for body in sent)
    assert sorted(body["messages"][0]["content"].rpartition("Response:")[2].strip() for body in sent) == sorted(RESPONSES)


def test_an_unparseable_judge_answer_fails_that_completion(judge):
    judge.fault = "unparseable"
    result = _score(_stack(_judge(judge)))
    assert result.scores == [None] * 4
    assert result.failures["judge:judge"] == (f"judge {judge.base_url}/chat/completions answered 'I cannot rate this.', "
                                              "which has no number in [1, 10]")


def test_judge_with_a_wrong_key_is_refused_before_training(judge, monkeypatch):
    monkeypatch.setenv("JUDGE_API_KEY", "wrong")
    judge.api_key = "right"
    with pytest.raises(RewardServerUnreachable) as info:
        check_reward_components(RewardConfig(components=[_judge(judge, api_key_env="JUDGE_API_KEY")]))
    assert str(info.value) == (f"judge reward {judge.base_url}/models answered HTTP 401 (unauthorized: check the "
                               "credentials) '{\"error\": \"unauthorized\"}'")


@pytest.mark.parametrize("answer, value", [("7", 6 / 9), ("Score: 10/10", 1.0), ("1", 0.0), ("I'd say 11", None),
                                           ("no idea", None), ("-2", None), ("5.5 out of 10", 0.5)])
def test_parse_score_maps_the_first_number_in_range(answer, value):
    assert parse_score(answer, 1, 10) == (pytest.approx(value) if value is not None else None)


def test_template_fills_prompt_and_response_and_leaves_other_braces():
    conversation = [{"role": "user", "content": "hi"}]
    assert fill_template('{prompt} -> {response} {"json": 1}', conversation, "ok") == 'user: hi -> ok {"json": 1}'


def test_function_reward_gets_columns_async_and_its_none_means_does_not_apply(tmp_path):
    path = tmp_path / "fn.py"
    path.write_text(
        "import asyncio\n"
        "async def reward(prompts, responses, answer):\n"
        "    await asyncio.sleep(0.01)\n"
        "    return [None if a is None else float(r == a) for r, a in zip(responses, answer)]\n"
        "def plain(prompts, responses):\n"
        "    return [1.0] * len(responses)\n"
    )
    columns = PromptColumns([PromptSet(["a", "b", "c"], columns=[{"answer": "4", "id": 1}, {"answer": "5", "id": 2}, {"id": 3}])])
    stack = _stack({"type": "function", "function": f"{path}:reward"}, {"type": "function", "function": f"{path}:plain"},
                   columns=columns)
    result = stack.score(["a", "b", "c"], ["4", "6", "x"], [True] * 3, [1] * 3)
    assert result.components == {"reward": [1.0, 0.0, None], "plain": [1.0, 1.0, 1.0]}
    # TRL's nansum over reward functions: the third row has no answer, so only `plain` scores it
    assert result.scores == [2.0, 1.0, 1.0] and result.failures == {}
    alone = _stack({"type": "function", "function": f"{path}:reward"}, columns=columns)
    result = alone.score(["a", "b", "c"], ["4", "6", "x"], [True] * 3, [1] * 3)
    assert result.scores == [1.0, 0.0, None]  # nothing scored it: it leaves the update, counted
    assert result.failures == {"reward": f"reward function '{path}:reward' returned None for 1 of 3 responses"}


def test_combine_components_sums_what_scored_and_a_server_failure_leaves_no_total():
    function, server = SimpleNamespace(skips_none=True, failure="fn: None"), SimpleNamespace(failure="http: 503")
    scorers = [("fn", 2.0, function), ("fn2", 1.0, SimpleNamespace(skips_none=True, failure=None)), ("http", 0.5, server)]
    totals, components, failures = combine_components(scorers, [[1.0, None, None, 3.0], [None, 1.0, None, 1.0],
                                                                [2.0, 2.0, 2.0, None]], 4)
    assert totals == [2.0 + 1.0, 1.0 + 1.0, 1.0, None]  # row 2: only the server scored it; row 3: the server failed
    assert components["http"] == [2.0, 2.0, 2.0, None]
    assert failures == {"http": "http: 503"}
    totals, _, failures = combine_components(scorers[:2], [[None, 4.0], [None, None]], 2)
    assert totals == [None, 8.0] and failures == {"fn": "fn: None", "fn2": "fn2 gave no reward"}


def test_a_prompt_in_two_rows_with_different_columns_is_refused_when_asked():
    from ppo_cli.errors import DataError

    columns = PromptColumns([PromptSet(["q", "q"], columns=[{"answer": "1"}, {"answer": "2"}])])
    with pytest.raises(DataError, match='appears in two rows with different columns'):
        columns.columns_for(["q"])


@pytest.mark.parametrize("component, message", [
    ({"type": "http", "url": "http://10.0.0.5:8000/score", "headers": {"Authorization": "Bearer ${T}"}},
     "would send credentials over plain http to 10.0.0.5"),
    ({"type": "http", "url": "http://127.0.0.1:8000/score", "headers": {"Authorization": "Bearer abc"}},
     "header 'Authorization' holds a literal credential"),
    ({"type": "judge", "base_url": "http://judge.example.com/v1", "model": "m", "prompt": "t.txt", "api_key_env": "K"},
     "would send credentials over plain http to judge.example.com"),
    ({"type": "judge", "base_url": "https://x/v1", "model": "m", "prompt": "t.txt", "scale": [10, 1]},
     "must be [low, high] with low < high, got [10.0, 1.0]"),
])
def test_unsafe_or_wrong_remote_components_are_refused_by_the_schema(component, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RewardConfig(components=[component])


def test_insecure_http_with_credentials_is_allowed_when_the_recipe_says_so():
    config = RewardConfig(components=[{"type": "http", "url": "http://10.0.0.5:8000/score", "allow_insecure_http": True,
                                       "headers": {"Authorization": "Bearer ${T}"}}])
    assert config.components[0].allow_insecure_http



def test_start_sends_the_requests_before_score_collects_them(server):
    server.delay_s = 0.3
    stack = _stack(_http(server, batch_size=2))
    pending = stack.start(["p"] * 4, RESPONSES)
    deadline = time.monotonic() + 5
    while len(server.requests) < 2:  # both batches are at the server while the caller does other work
        assert time.monotonic() < deadline
        time.sleep(0.01)
    result = stack.score(["p"] * 4, RESPONSES, [True] * 4, [3] * 4, pending=pending)
    assert result.scores == EXPECTED and len(server.requests) == 2


def test_a_nan_from_a_function_fails_only_its_completion(tmp_path):
    path = tmp_path / "fn.py"
    path.write_text("def reward(prompts, responses):\n"
                    "    return [float('nan'), 1.0, None, float('inf')][:len(responses)]\n")
    stack = _stack({"type": "function", "function": f"{path}:reward", "weight": 2.0})
    result = stack.score(["a"] * 4, ["w", "x", "y", "z"], [True] * 4, [1] * 4)
    assert result.scores == [None, 2.0, None, None] and result.scored == [False, True, False, False]
    assert stack.failable == ["reward"]
    assert result.failures == {"reward": f"reward function '{path}:reward' returned None for 1 and NaN or inf for 2 of 4 responses"}
