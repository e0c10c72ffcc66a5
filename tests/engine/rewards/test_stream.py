"""Reward requests sent while the batch is still being sampled (engine/rewards/stream.py), against the
loopback reward server: the same rewards as scoring after sampling, batches and max_concurrency kept,
nothing left running when generation fails. The fast tests hand rows over as generate() would; the
slow one samples with the tiny policy."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.conftest import ROOT
from tests.engine.rewards.test_remote import EXPECTED, RESPONSES, _stack, server  # noqa: F401 - the fixture
from tests.engine.rewards.test_remote import _http as _fast_http

PROMPTS = ["p0", "p1", "p2", "p3"]


def _http(server, **extra) -> dict:
    """Retries off and a 5 s timeout: on a loaded machine a retried request would show up twice at the server."""
    return _fast_http(server, **{"timeout_s": 5.0, "retries": 0, **extra})


def _decode(ids: list[int]) -> str:
    """Row i's response ids are [i]: its text is RESPONSES[i]."""
    return RESPONSES[ids[0]]


def _wait_for(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _collect(stack, stream, responses=RESPONSES):
    pending = stack.start(PROMPTS, list(responses), stream=stream)
    return stack.score(PROMPTS, list(responses), [True] * 4, [3] * 4, pending=pending)


def test_finished_rows_are_sent_in_batches_while_sampling_with_the_same_rewards(server):
    server.delay_s = 0.1
    stack = _stack(_http(server, batch_size=2))
    stream = stack.stream(PROMPTS, _decode)
    stream.finished([3], [[3]])
    assert server.requests == []  # half a batch waits for its second row
    stream.finished([1], [[1]])
    _wait_for(lambda: len(server.requests) == 1)  # sent while the other rows are still sampling
    pending = stack.start(PROMPTS, RESPONSES, stream=stream)
    _wait_for(lambda: len(server.requests) == 2)  # the rest: when sampling ends, before the rollout's forwards
    result = stack.score(PROMPTS, RESPONSES, [True] * 4, [3] * 4, pending=pending)
    assert result.scores == EXPECTED
    assert [r["body"]["responses"] for r in server.requests] == [[RESPONSES[3], RESPONSES[1]], [RESPONSES[0], RESPONSES[2]]]
    assert server.requests[0]["body"]["prompts"] == ["p3", "p1"]
    assert (stream.sent_while_sampling, stream.resent) == (1, 0)


def test_a_row_whose_text_changed_is_sent_again_with_the_rollouts_text(server):
    stack = _stack(_http(server, batch_size=1))
    stream = stack.stream(PROMPTS, lambda ids: "terrible")  # not what the rollout decodes for row 0
    stream.finished([0], [[0]])
    result = _collect(stack, stream)
    assert result.scores == EXPECTED and stream.resent == 1
    assert {r["body"]["responses"][0] for r in server.requests} == set(RESPONSES + ["terrible"])


def test_max_concurrency_holds_across_the_streamed_batches(server):
    server.delay_s = 0.1
    stack = _stack(_http(server, batch_size=1, max_concurrency=2))
    stream = stack.stream(PROMPTS, _decode)
    for row in range(4):
        stream.finished([row], [[row]])
    assert _collect(stack, stream).scores == EXPECTED
    assert server.max_in_flight == 2


def test_close_cancels_requests_in_flight_at_once(server):
    server.delay_s = 3.0  # requests still in flight when close() is called
    stack = _stack(_http(server, batch_size=1))
    stream = stack.stream(PROMPTS, _decode)
    stream.finished([0, 1], [[0], [1]])
    _wait_for(lambda: len(server.requests) == 2)
    started = time.monotonic()
    stream.close()
    assert time.monotonic() - started < 0.5
    assert not any(t.name == "ppo-reward-stream" for t in threading.enumerate())
    stream.close()  # twice is harmless


def test_no_stream_without_a_remote_component(tmp_path):
    path = tmp_path / "fn.py"
    path.write_text("async def reward(prompts, responses):\n    return [1.0] * len(responses)\n")
    assert _stack({"type": "function", "function": f"{path}:reward"}).stream(PROMPTS, _decode) is None


@pytest.mark.slow
def test_a_rollouts_server_rewards_go_out_while_sampling_and_equal_scoring_after_it(tiny_models, tmp_path, server):
    from ppo_cli.engine.engine import load_engine
    from ppo_cli.recipe_loading import load_recipe
    from tests.conftest import tiny_overrides
    from tests.fixtures.reward_servers import _short_positive

    server.delay_s = 0.05
    component = {"type": "http", "url": server.score_url, "batch_size": 1, "timeout_s": 5, "retries": 0}
    sets = {"ppo.rollout_batch_size": 8, "ppo.mini_batch_size": 4, "ppo.micro_batch_size": 4,
            "generation.max_new_tokens": 32, "reward.components": f"[{component}]".replace("'", "")}
    recipe = load_recipe(ROOT / "recipes" / "tiny_sentiment.yaml", tiny_overrides(tiny_models, tmp_path, **sets))
    engine = load_engine(recipe)
    streams, ended = [], []
    make_stream, sample = engine.reward.stream, engine.sample
    engine.reward.stream = lambda *args: streams.append(make_stream(*args)) or streams[-1]
    engine.sample = lambda *args, **kwargs: (sample(*args, **kwargs), ended.append(time.monotonic()))[0]
    prompts = ["The movie was", "I think the book was", "This phone is", "Overall, the product is"] * 2
    # The tiny model decodes the steps after a row's stop in a few ms, and whether its request reaches the
    # server before the last step would be a race the machine's speed (and where in the stream the first
    # row stops) decides: once a request is sent, each decoding step waits for the server to have it
    # (2 s at most). Were requests sent only after sampling, no step would wait and none would arrive in time.
    from ppo_cli.engine.models import unwrap_causal_lm

    def wait_for_a_sent_request(*_):
        deadline = time.monotonic() + 2.0
        while streams and streams[0].sent_while_sampling and not server.requests and time.monotonic() < deadline:
            time.sleep(0.005)

    slow = unwrap_causal_lm(engine.actor_critic.policy).register_forward_hook(wait_for_a_sent_request)
    torch.manual_seed(0)
    rollout = engine.collect_rollout(prompts)
    slow.remove()

    (values,) = [v for name, v in rollout.score_components.items() if name.startswith("http:")]
    assert values == _short_positive()(prompts, rollout.responses)  # what the server computes, row by row
    after = engine.reward.score(prompts, rollout.responses, [True] * 8, [1] * 8)  # no overlap: sent after sampling
    assert list(after.components.values())[0] == values
    finished = rollout.generation.finished.tolist()
    assert 0 < sum(finished) < 8  # some rows stop early, some run to max_new_tokens (seed 0)
    # a stop with decoding steps after it, which wait for its request (row 5 stops at token 24 of 32; at 24
    # of 24, as with max_new_tokens 24, no step follows and the request arrived 38 ms after sampling ended)
    lengths = rollout.generation.response_mask.sum(dim=1)
    assert int(lengths[rollout.generation.finished].min()) < sets["generation.max_new_tokens"]
    assert streams[0].sent_while_sampling >= 1 and streams[0].resent == 0
    assert min(r["at"] for r in server.requests) < ended[0]  # a request reached the server before sampling ended

    # generation fails after a row was handed over: its request is cancelled, nothing is left running
    def failing(*args, on_finished=None, **kwargs):
        on_finished([0], [[1, 2]])
        raise RuntimeError("out of memory")

    server.delay_s = 3.0
    engine.sample = failing
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.collect_rollout(prompts)
    assert time.monotonic() - started < 2.0
    assert not any(t.name == "ppo-reward-stream" for t in threading.enumerate())
