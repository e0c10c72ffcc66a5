"""type http on a loopback server: recipes/envs/guess_server.py (GuessNumber over POST /reset /step /close)."""

from __future__ import annotations

import importlib.util
import random
import threading
from pathlib import Path

import pytest

from tests.engine.envs.test_multi_turn import run
from tests.fixtures.reward_servers import free_port

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture()
def guess_server():
    spec = importlib.util.spec_from_file_location("guess_server_for_tests", ROOT / "recipes/envs/guess_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    server = module.make_server(free_port())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("overlap", [True, False])
def test_http_episodes_reset_step_and_close_on_the_server(chatml, guess_server, overlap):
    seed = 11
    number = random.Random(seed).randint(1, 10)
    wrong = "1" if number != 1 else "2"
    url = f"http://127.0.0.1:{guess_server.server_address[1]}"
    # overlap: two waves of one episode each, sampled in turn; off: one batch per turn.
    turns = [[str(number)], [wrong], [wrong]] if overlap else [[str(number), wrong], [wrong]]
    result, inner, _ = run(chatml, {"type": "http", "url": url, "timeout_s": 5, "max_turns": 2, "overlap": overlap},
                           turns, ["Guess.", "Guess."], seeds=[seed, seed])
    assert [len(rows) for rows, _ in inner.calls] == [len(texts) for texts in turns]
    first, second = result.episodes
    assert (first.ended_by, first.turns, first.step_reward) == ("done", 1, 1.0)
    assert [m["content"] for m in first.messages][-2:] == [str(number), "Correct!"]
    assert (second.ended_by, second.turns, second.step_reward) == ("max_turns", 2, 0.0)
    assert [m["content"] for m in second.messages][2] == ("Higher." if int(wrong) < number else "Lower.")
    assert guess_server.episodes == {}  # both episodes were closed


def test_an_http_environment_that_does_not_answer_fails_its_episodes(chatml):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result, _, _ = run(chatml, {"type": "http", "url": url, "timeout_s": 2, "retries": 0}, [["5"]], ["Guess."])
    record = result.episodes[0]
    assert record.ended_by == "failed"
    assert record.failure.startswith(f"environment server {url}/reset: cannot connect (ConnectError")
