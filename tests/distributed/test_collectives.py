"""Collectives that never complete: the phase-named one line, the error mapping, the watchdog, and the
share of the held-out prompts each process evaluates."""

import threading
import time

import pytest

from ppo_cli import collectives
from ppo_cli.evaluation import share_of
from ppo_cli.errors import EXIT_RUNTIME


@pytest.fixture(autouse=True)
def _loading_again():
    yield
    collectives.enter("loading")


@pytest.mark.parametrize("message, peer_gone", [
    ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation "
     "to complete", False),
    ("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 600012 "
     "milliseconds before timing out.", False),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:41507", True),
])
def test_a_timed_out_or_broken_collective_becomes_one_line_naming_the_phase(message, peer_gone):
    collectives.enter("rollout")
    err = collectives.as_collective_error(RuntimeError(message), 20)
    assert err.exit_code == EXIT_RUNTIME == 1
    if peer_gone:
        assert err.message == "another process ended during the rollout; the last checkpoint is intact"
    else:
        assert err.message == ("the processes stopped answering each other for 20 s during the rollout "
                               "(a collective timed out); the last checkpoint is intact")
    assert "--resume" in err.hint and "train.collective_timeout_s" in err.hint
    assert "\n" not in err.message + err.hint


def test_other_errors_are_left_alone():
    assert collectives.as_collective_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), 20) is None
    assert collectives.as_collective_error(ValueError("timed out"), 20) is None  # not from torch.distributed


def test_phases_are_the_documented_ones():
    for phase in ("loading", "rollout", "update", "evaluation", "checkpoint"):
        collectives.enter(phase)
        assert collectives.current_phase() == phase
    with pytest.raises(ValueError):
        collectives.enter("lunch")


def _sit_in(event: threading.Event, seconds: float) -> None:
    event.wait(seconds)


def _short_calls(stop: threading.Event) -> None:
    while not stop.is_set():
        _sit_in(threading.Event(), 0.01)


def _watch(target, args, limit_s: float, wait_s: float) -> list[str]:
    """Run ``target`` in a thread watched as if _sit_in were a torch.distributed call; the phases the
    watchdog reported as stuck."""
    stuck: list[str] = []
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    watchdog = collectives.Watchdog(limit_s, 20, thread_id=thread.ident, poll_s=0.02, on_stuck=stuck.append,
                                    find_frame=_frames_of(_sit_in)).start()
    time.sleep(wait_s)
    watchdog.stop()
    return stuck


def _frames_of(function):
    def find(frame):
        while frame is not None:
            if frame.f_code is function.__code__:
                return frame
            frame = frame.f_back
        return None
    return find


def test_the_watchdog_reports_one_call_that_outlasts_the_limit_with_the_phase():
    collectives.enter("update")
    release = threading.Event()
    assert _watch(_sit_in, (release, 5.0), limit_s=0.3, wait_s=1.0) == ["update"]
    release.set()


def test_the_watchdog_leaves_many_short_calls_alone():
    stop = threading.Event()
    assert _watch(_short_calls, (stop,), limit_s=0.3, wait_s=1.0) == []
    stop.set()


@pytest.mark.parametrize("n, world_size", [(10, 1), (10, 2), (10, 3), (7, 4), (2, 3), (0, 2)])
def test_the_shares_cover_the_prompts_once_in_order(n, world_size):
    items = list(range(n))
    shares = [share_of(items, rank, world_size) for rank in range(world_size)]
    assert [x for share in shares for x in share] == items
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    assert share_of(items, 0, 1) == items  # one process evaluates exactly what it always did
