"""A collective that never completes, said as one line naming the phase, and a process that exits.

With several processes every collective (all-reduce, all-gather, barrier) waits for all of them; if
one process stalls or dies, the others would wait forever. The process group gets
train.collective_timeout_s (distributed.py): gloo then raises in the waiting process, which becomes
CollectiveTimeout naming the phase the run was in (``enter``). The Watchdog covers a wait that does
not raise: a process whose main thread has sat in one torch.distributed call past the timeout plus a
grace prints the same line and exits; the launcher (torchrun) then stops the other processes.
A process whose launcher has ended (SIGKILLed: torchrun starts each process in a session of its own,
so nothing else stops it) ends too, as it would with its machine: the processes of the other machines
then see a peer gone at their next collective (end_with_launcher).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from ppo_cli.errors import RESUME, PpoError, print_error
from ppo_cli.launch import LAUNCHER_PID_ENV

PHASES = ("loading", "rollout", "update", "evaluation", "checkpoint")
_current = {"phase": "loading"}

# gloo: "Timed out waiting 20000ms for recv operation to complete"; NCCL with TORCH_NCCL_BLOCKING_WAIT:
# "... ran for 600012 milliseconds before timing out"; a peer that already exited: "Connection closed by peer".
_TIMEOUT_WORDS = ("timed out", "timeout", "timing out")
_PEER_GONE_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe")


def enter(phase: str) -> None:
    """Record the phase the run is in now (phases follow one another; none nests)."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}")
    _current["phase"] = phase


def current_phase() -> str:
    return _current["phase"]


class CollectiveTimeout(PpoError):
    """A collective did not complete within train.collective_timeout_s (or its peer had ended)."""

    def __init__(self, phase: str, timeout_s: float | None, peer_gone: bool = False):
        self.phase = phase
        if peer_gone:
            what = f"another process ended during the {phase}"
        else:
            waited = f" for {timeout_s:g} s" if timeout_s else ""
            what = f"the processes stopped answering each other{waited} during the {phase} (a collective timed out)"
        super().__init__(
            f"{what}; the last checkpoint is intact",
            hint="look for the process that stalled or died (killed for memory, a stuck device, a slow disk), then "
                 f"`{RESUME}`; if that phase legitimately takes longer, raise train.collective_timeout_s",
        )


def is_collective_failure(err: BaseException) -> tuple[bool, bool]:
    """(is a collective's timeout or a lost peer, is a lost peer) for an exception from torch.distributed."""
    if not isinstance(err, RuntimeError):  # torch's DistBackendError and DistNetworkError are RuntimeErrors
        return False, False
    text = str(err).lower()
    if any(word in text for word in _PEER_GONE_WORDS):
        return True, True
    return any(word in text for word in _TIMEOUT_WORDS), False


def as_collective_error(err: BaseException, timeout_s: float | None) -> PpoError | None:
    """CollectiveTimeout for ``err`` in the current phase, or None when ``err`` is something else."""
    failed, peer_gone = is_collective_failure(err)
    return CollectiveTimeout(current_phase(), timeout_s, peer_gone) if failed else None


def exit_soon(grace_s: float, code: int = 1) -> None:
    """Make sure this process ends within ``grace_s`` even if its shutdown waits on a broken process
    group (atexit handlers, non-daemon threads)."""
    timer = threading.Timer(grace_s, os._exit, args=(code,))
    timer.daemon = True
    timer.start()


def launcher_pid() -> int:
    """The pid of the launcher that started this process: ppo_cli.launch's (it names itself, read only in a
    process torchrun's agent started, which ppo_cli.launch runs in its own process; DeepSpeed's multi-node
    launcher starts processes elsewhere), else the parent's (a plain `accelerate launch`, torchrun, DeepSpeed)."""
    named = os.environ.get(LAUNCHER_PID_ENV) if "TORCHELASTIC_RUN_ID" in os.environ else None
    return int(named or os.getppid())


def end_with_launcher(launcher: int, poll_s: float = 1.0, on_gone=None) -> threading.Event:
    """A daemon thread that ends this process (one line, exit 1) once ``launcher`` is no longer its
    parent, polled every ``poll_s`` as PyTorch's DataLoader workers watch theirs. ``on_gone`` replaces
    the exit (tests). Returns an Event that stops the thread when set."""
    stop = threading.Event()

    def leave() -> None:
        print_error(f"this machine's launcher (pid {launcher}) ended, so its process {os.environ.get('RANK', '?')} "
                    "stops too", hint="the other machines' processes stop at their next collective; "
                    f"`{RESUME}` on every machine continues from the last checkpoint")
        sys.stderr.flush()
        os._exit(1)

    def watch() -> None:
        while not stop.wait(poll_s) and os.getppid() == launcher:
            pass
        if not stop.is_set():
            (on_gone or leave)()

    if os.getppid() != launcher:  # gone already, before this process got here
        (on_gone or leave)()
    else:
        threading.Thread(target=watch, name="ppo-launcher-watch", daemon=True).start()
    return stop


def _in_torch_distributed(frame) -> object | None:
    """The innermost frame of ``frame``'s stack that runs torch.distributed code, or None."""
    while frame is not None:
        if str(frame.f_globals.get("__name__", "")).startswith("torch.distributed"):
            return frame
        frame = frame.f_back
    return None


class Watchdog:
    """A daemon thread: when ``thread_id``'s thread has been inside the same torch.distributed call
    (the same frame object) for ``limit_s``, ``on_stuck(phase)`` runs (by default: print the one line
    and exit 1). Polls every ``poll_s``; holds the frame it watches only until the next poll."""

    def __init__(self, limit_s: float, timeout_s: float | None, thread_id: int | None = None, poll_s: float = 1.0,
                 on_stuck=None, find_frame=_in_torch_distributed):
        self.limit_s, self.timeout_s, self.poll_s = limit_s, timeout_s, poll_s
        self.thread_id = thread_id if thread_id is not None else threading.main_thread().ident
        self.on_stuck = on_stuck or self._exit
        self.find_frame = find_frame
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ppo-collective-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop and join the thread: a daemon thread still alive while the interpreter shuts down
        aborted a DeepSpeed process at exit ("terminate called without an active exception")."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        watched, since = None, 0.0
        while not self._stop.wait(self.poll_s):
            frame = sys._current_frames().get(self.thread_id)
            found = self.find_frame(frame) if frame is not None else None
            del frame
            if found is None or found is not watched:
                watched, since = found, time.monotonic()
                continue
            if time.monotonic() - since >= self.limit_s:
                watched = found = None
                self.on_stuck(current_phase())
                return

    def _exit(self, phase: str) -> None:
        err = CollectiveTimeout(phase, self.timeout_s)
        print_error(err.message, err.hint)
        sys.stderr.flush()
        os._exit(err.exit_code)
