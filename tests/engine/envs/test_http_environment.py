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


def test_the_check_before_loading_resets_and_closes_one_episode_on_the_server(guess_server):
    from ppo_cli.engine.envs.environments import check_server
    from ppo_cli.recipe import EnvironmentConfig

    url = f"http://127.0.0.1:{guess_server.server_address[1]}"
    opened = []
    original = guess_server.RequestHandlerClass.do_POST

    def recording(handler):
        opened.append(handler.path)
        original(handler)

    guess_server.RequestHandlerClass.do_POST = recording
    check_server(EnvironmentConfig.model_validate({"type": "http", "url": url}), {"answer": "4"})
    assert opened == ["/reset", "/close"]
    assert guess_server.episodes == {}  # closed again


def test_an_http_environment_that_is_down_or_answers_reset_wrongly_is_one_line_before_loading(guess_server):
    from ppo_cli.engine.envs.environments import check_server
    from ppo_cli.errors import EnvironmentSetupError
    from ppo_cli.recipe import EnvironmentConfig

    down = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EnvironmentSetupError) as info:
        check_server(EnvironmentConfig.model_validate({"type": "http", "url": down, "timeout_s": 2}), {})
    assert info.value.message.startswith(f"environment server {down}/reset cannot be reached (")
    assert info.value.hint.startswith("start the server (or fix the URL) and run again")

    url = f"http://127.0.0.1:{guess_server.server_address[1]}"
    with pytest.raises(EnvironmentSetupError) as info:  # the server serves /reset, not /game/reset
        check_server(EnvironmentConfig.model_validate({"type": "http", "url": url + "/game"}), {})
    assert info.value.message.startswith(f"environment server {url}/game/reset answered HTTP 404 (not found: check the path)")

    guess_server.RequestHandlerClass.do_POST = _answering(b"[1, 2]")
    with pytest.raises(EnvironmentSetupError) as info:
        check_server(EnvironmentConfig.model_validate({"type": "http", "url": url}), {})
    assert info.value.message == f"environment server {url}/reset answered list, not an object"
    for body, said in ((b'{"obs": "hi"}', "'obs', not observation (and info, not read)"),
                       (b'{"observation": "hi", "reward": 0.5}', "'reward', not observation (and info, not read); "
                                                                  "a reward comes with a step, not with reset")):
        guess_server.RequestHandlerClass.do_POST = _answering(body)  # refused as step refuses unknown keys
        with pytest.raises(EnvironmentSetupError) as info:
            check_server(EnvironmentConfig.model_validate({"type": "http", "url": url}), {})
        assert info.value.message == f"environment server {url}/reset answered {said}"


def _answering(body: bytes):
    def do_POST(handler):
        handler.rfile.read(int(handler.headers.get("Content-Length") or 0))
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    return do_POST


@pytest.mark.slow
def test_validate_and_train_stop_in_one_line_before_loading_when_the_environment_server_is_down(tiny_tools_model, guess_server,
                                                                                                 tmp_path):
    from typer.testing import CliRunner

    from ppo_cli.cli import app

    def validate(url, command="validate"):
        return CliRunner().invoke(app, [command, str(ROOT / "recipes" / "tiny_tools.yaml"),
                                        "--set", f"policy.path={tiny_tools_model / 'policy'}",
                                        "--set", "environment.type=http", "--set", "environment.tools=[]",
                                        "--set", f"environment.url={url}", "--set", "environment.timeout_s=2",
                                        "--set", f"output_dir={tmp_path}"])

    down = f"http://127.0.0.1:{free_port()}"
    result = validate(down)
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[0].startswith(f"error: environment server {down}/reset cannot be reached (")
    assert "Traceback" not in result.output
    result = validate(down, "train")
    assert result.exit_code == 2 and result.stderr.splitlines()[0].startswith(f"error: environment server {down}/reset")
    assert not any(tmp_path.iterdir())  # stopped before the run directory was made
    result = validate(f"http://127.0.0.1:{guess_server.server_address[1]}")
    assert result.exit_code == 0, result.output
    assert guess_server.episodes == {}  # the check's episode was closed
