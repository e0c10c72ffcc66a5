"""Two machines of one process each on this host, as docs/distributed.md's "Several machines" runs them:
each `python -m ppo_cli train ... --num-machines 2 --machine-rank I --main-address 127.0.0.1:PORT` started
on its own (gloo over 127.0.0.1, torchrun's static rendezvous). A SIGKILL of one machine's launcher
(its `ppo train`), during the run or after its last update, ends the other machine's processes and
launcher with one line within train.collective_timeout_s. Three launches in all (CI has 2 cores): the
run killed after its last update is the reference that trains and writes once; the run killed during
training resumes on both machines to the reference's metrics."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT, model_overrides
from tests.integration.test_readme_multiprocess import _free_port, _workers
from tests.integration.test_reliability import _assert_same_metrics, _metrics

pytestmark = pytest.mark.slow
RECIPE = str(ROOT / "recipes" / "tiny_sentiment.yaml")
TIMEOUT_S = 20  # train.collective_timeout_s: also how long the launchers wait for each other
MARGIN_S = 30  # a process polls its launcher each second; the survivor may be inside a computation
# The kill "during the run" lands at update 1's checkpoint: the updates left must outlast the second in
# which a process notices its launcher is gone (with 2, both processes once wrote final/ first).
UPDATES = 4
SMALL = {"ppo.rollout_batch_size": 4, "ppo.mini_batch_size": 2,
         "ppo.micro_batch_size": 2, "ppo.ppo_epochs": 1, "generation.max_new_tokens": 8,
         "train.total_updates": UPDATES, "train.save_every": 1, "train.collective_timeout_s": TIMEOUT_S}


def _start(models: Path, out: Path, *extra: str) -> list[subprocess.Popen]:
    """Machine 0 and machine 1, each its own `ppo train`; their stderr in out/machine{I}.err."""
    address = f"127.0.0.1:{_free_port()}"
    machines = []
    for rank in (0, 1):
        command = [sys.executable, "-m", "ppo_cli", "train", RECIPE,
                   "--num-machines", "2", "--machine-rank", str(rank), "--main-address", address, *extra]
        for item in model_overrides(models, out, **SMALL):
            command += ["--set", item]
        with open(out / f"machine{rank}.err", "w") as stderr:
            machines.append(subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr,
                                             env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}))
    return machines


def _wait_for(predicate, machines: list[subprocess.Popen], out: Path, timeout: float = 400) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert all(m.poll() is None for m in machines) and time.monotonic() < deadline, _stderr(out, 0) + _stderr(out, 1)
        time.sleep(0.05)


def _stderr(out: Path, rank: int) -> str:
    return (out / f"machine{rank}.err").read_text()


def _kill_everything(machines: list[subprocess.Popen]) -> None:
    """Whatever still runs of the machines' launchers and their processes, by id."""
    for machine in machines:
        try:
            for process in [*psutil.Process(machine.pid).children(recursive=True), psutil.Process(machine.pid)]:
                process.kill()
        except psutil.NoSuchProcess:
            pass
        machine.wait()


def _ended(processes) -> bool:
    return not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("error:", "warning:"))]


def _one_machine_killed(models: Path, out: Path, when) -> tuple[int, float, list]:
    """Start both machines, SIGKILL machine 1's launcher (its `ppo train`) once ``when(machines)`` returns;
    (machine 0's exit code, seconds it took to end after the kill, every training process seen)."""
    machines = _start(models, out)
    try:
        _wait_for(lambda: all(_workers(psutil.Process(m.pid)) for m in machines), machines, out)
        processes = [w for m in machines for w in _workers(psutil.Process(m.pid)).values()]
        when(machines)
        machines[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        code = machines[0].wait(timeout=TIMEOUT_S + MARGIN_S + 60)
        return code, time.monotonic() - killed, processes
    finally:
        _kill_everything(machines)


@pytest.fixture(scope="module")
def killed_after_the_last_update(tiny_models, tmp_path_factory) -> tuple[Path, int, float, list]:
    """Machine 1's launcher stops (SIGSTOP) before it reaches torchrun's exit barrier and is SIGKILLed once
    machine 0's processes have finished; the processes themselves train as in any run.
    (output_dir, machine 0's exit code, seconds it took to end after the kill, the training processes)."""
    out = tmp_path_factory.mktemp("two-machines")

    def stop_then_wait_for_machine_0(machines):
        psutil.Process(machines[1].pid).suspend()
        _wait_for(lambda: not psutil.Process(machines[0].pid).children(), [machines[0]], out)

    return (out, *_one_machine_killed(tiny_models, out, stop_then_wait_for_machine_0))


def test_two_machines_train_and_only_machine_0s_first_process_writes(killed_after_the_last_update):
    run = killed_after_the_last_update[0] / "tiny-sentiment"
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, UPDATES + 1))  # one metrics file, one line per update
    assert metrics[-1]["episode"] == UPDATES * 4 * 2  # updates x rollout_batch_size x processes
    summary = json.loads((run / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["updates"] == UPDATES
    evaluation = json.loads((run / "eval.json").read_text())  # both machines evaluated their shares, machine 0 wrote
    assert len(evaluation["before"]["samples"]) == len(evaluation["after"]["samples"]) == 16
    assert (run / "final/manifest.json").is_file() and (run / "final/adapter_model.safetensors").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [f"step-{i:06d}" for i in (UPDATES - 1, UPDATES)]  # keep_checkpoints 2


def test_sigkill_of_one_machines_launcher_after_the_last_update_ends_the_other_with_one_line(killed_after_the_last_update):
    """Machine 0's launcher waits for the killed one train.collective_timeout_s (torchrun alone: 300 s)
    and says so; its processes had finished, so its exit code is 0."""
    out, code, seconds, processes = killed_after_the_last_update
    print(f"machine 0's launcher ended {seconds:.1f} s after machine 1's launcher was killed")
    stderr = _stderr(out, 0)
    assert code == 0 and seconds <= TIMEOUT_S + MARGIN_S, stderr
    assert _ended(processes)
    assert _errors(stderr) == [f"warning: this machine's processes finished, but another machine's launcher did not "
                               f"report its end within {TIMEOUT_S} s (killed, or its machine went down)"], stderr


def test_sigkill_of_one_machines_launcher_during_the_run_ends_the_other_with_one_line_then_both_resume_exactly(
        killed_after_the_last_update, tiny_models, tmp_path):
    """Then both machines are down (one killed, one ended): `--resume` on both gives the reference's metrics."""
    run = tmp_path / "tiny-sentiment"
    code, seconds, processes = _one_machine_killed(
        tiny_models, tmp_path, lambda machines: _wait_for(
            lambda: (run / "checkpoints/step-000001/manifest.json").exists(), machines, tmp_path))
    print(f"machine 0 ended {seconds:.1f} s after machine 1's launcher was killed")
    stderr = _stderr(tmp_path, 0)
    assert code == 1 and seconds <= TIMEOUT_S + MARGIN_S, stderr
    assert _ended(processes)  # machine 1's process too: it ends with its launcher
    assert len(_errors(stderr)) == 1 and _errors(stderr)[0].startswith("error: another process ended during the "), stderr
    assert "Traceback" not in stderr
    assert "error: this machine's launcher (pid " in _stderr(tmp_path, 1)
    assert not (run / "final").exists()

    resumed = _start(tiny_models, tmp_path, "--resume")
    try:
        codes = [m.wait(timeout=600) for m in resumed]
    finally:
        _kill_everything(resumed)
    assert codes == [0, 0], _stderr(tmp_path, 0) + _stderr(tmp_path, 1)
    assert _errors(_stderr(tmp_path, 0)) == _errors(_stderr(tmp_path, 1)) == []
    _assert_same_metrics(_metrics(run), _metrics(killed_after_the_last_update[0] / "tiny-sentiment"))
    assert (run / "final/manifest.json").exists()
