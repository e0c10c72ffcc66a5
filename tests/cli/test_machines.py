"""`ppo train --num-machines M --machine-rank I --main-address HOST:PORT`: what reaches `accelerate launch`,
each bad value as one line, the launcher's settings for machines that wait on each other, and the
SLURM example's command lines. Fast: nothing is launched (but the sbatch script, with srun stood in for)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ppo_cli.launch
from ppo_cli.cli import app
from ppo_cli.errors import EXIT_USAGE, UsageError
from ppo_cli.launch import Machines, launch_command, machines_for, parse_main_address, rendezvous_timeout
from tests.conftest import ROOT

RECIPE = str(ROOT / "recipes" / "tiny_sentiment.yaml")
MULTI_NODE = ROOT / "recipes" / "accelerate" / "multi_node.yaml"
SBATCH = ROOT / "recipes" / "slurm" / "train_multi_node.sbatch"


@pytest.fixture
def launched(monkeypatch) -> dict:
    """What `ppo train` would launch: the accelerate command and the process count (nothing runs)."""
    seen: dict = {}

    def fake_launch(num_processes, argv, config_file=None, machines=Machines(), timeout_s=None, resume=None):
        seen.update(num_processes=num_processes, machines=machines, command=launch_command(
            num_processes, ppo_cli.launch.forwarded_args(argv), config_file, machines, timeout_s))
        return 0

    monkeypatch.setattr(ppo_cli.launch, "launch_train", fake_launch)
    return seen


def _train(*args: str):
    return CliRunner().invoke(app, ["train", RECIPE, *args])


def _after(command: list[str], option: str) -> str:
    return command[command.index(option) + 1]


def test_each_machine_launches_its_share_of_the_total_with_a_static_rendezvous(launched):
    result = _train("--num-machines", "2", "--machine-rank", "1", "--main-address", "node001:29500",
                    "--num-processes", "16", "--set", "seed=3")
    assert result.exit_code == 0, result.output
    command = launched["command"]
    launcher = command[:command.index("ppo_cli", 3)]
    assert launcher[3:] == ["--multi_gpu", "--num_processes", "16", "--mixed_precision", "no", "--dynamo_backend", "no",
                            "--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "node001",
                            "--main_process_port", "29500", "--rdzv_backend", "static", "--rdzv_conf", "timeout=600", "-m"]
    # The launched processes get the command line less the launcher's options.
    assert command[command.index("ppo_cli", 3) + 1:] == ["train", RECIPE, "--set", "seed=3"]


def test_without_num_processes_each_machine_runs_one(launched):
    result = _train("--num-machines", "2", "--main-address", "127.0.0.1:29500", "--set", "train.collective_timeout_s=30")
    assert result.exit_code == 0, result.output
    assert launched["num_processes"] == 2 and launched["machines"] == Machines(2, 0, ("127.0.0.1", 29500))
    assert _after(launched["command"], "--rdzv_conf") == "timeout=30"  # train.collective_timeout_s


def test_an_accelerate_config_gives_the_machines_and_the_options_override_it(launched):
    result = _train("--accelerate-config", str(MULTI_NODE), "--machine-rank", "1")
    assert result.exit_code == 0, result.output
    assert launched["machines"] == Machines(2, 1, ("10.0.0.1", 29500))
    command = launched["command"]
    assert _after(command, "--config_file") == str(MULTI_NODE)
    assert "--num_processes" not in command  # the file's 16 stand
    assert machines_for(None, None, None, None, MULTI_NODE) == Machines(2, 0, ("10.0.0.1", 29500))
    assert machines_for(4, 4, 3, "head:1234", MULTI_NODE) == Machines(4, 3, ("head", 1234))


def test_num_processes_is_the_total_over_all_machines_in_help():
    import typer

    train = typer.main.get_command(app).commands["train"]
    [option] = [p for p in train.params if "--num-processes" in p.opts]
    assert "the total over the M machines" in option.help


@pytest.mark.parametrize("args, lines", [
    (["--num-machines", "2", "--machine-rank", "2", "--main-address", "node001:29500"],
     ["error: --machine-rank 2 is out of range for --num-machines 2",
      "hint: number the machines 0 to 1; the one at --main-address is 0"]),
    (["--machine-rank", "1"],
     ["error: --machine-rank 1 is out of range for --num-machines 1",
      "hint: number the machines 0 to 0; the one at --main-address is 0"]),
    (["--num-machines", "2"],
     ["error: --num-machines 2 needs --main-address HOST:PORT",
      "hint: give every machine the address of machine 0 and a free port on it, e.g. node001:29500"]),
    (["--num-machines", "2", "--main-address", "node001"],
     ["error: --main-address 'node001' is not HOST:PORT",
      "hint: write the first machine's address and a free port on it, e.g. --main-address node001:29500"]),
    (["--num-machines", "2", "--main-address", ":29500"],
     ["error: --main-address ':29500' is not HOST:PORT",
      "hint: write the first machine's address and a free port on it, e.g. --main-address node001:29500"]),
    (["--num-machines", "2", "--main-address", "node001:70000"],
     ["error: --main-address 'node001:70000': the port must be a number from 1 to 65535",
      "hint: write the first machine's address and a free port on it, e.g. --main-address node001:29500"]),
    (["--num-machines", "2", "--main-address", "node001:29500", "--num-processes", "3"],
     ["error: --num-processes 3 cannot be split evenly over --num-machines 2",
      "hint: --num-processes is the total over all machines (accelerate's --num_processes): give a multiple of 2, e.g. 2"]),
])
def test_bad_machine_options_are_one_line_and_nothing_is_launched(launched, args, lines):
    result = _train(*args)
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.splitlines() == lines
    assert launched == {}


def test_a_config_that_is_not_yaml_is_one_line(launched, tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text("num_machines: [2\n")
    result = _train("--accelerate-config", str(config))
    assert result.exit_code == EXIT_USAGE
    assert result.stderr.startswith(f"error: accelerate config {config} is not YAML: ")
    assert launched == {}


def test_main_address_reads_host_and_port():
    assert parse_main_address("10.1.2.3:29500") == ("10.1.2.3", 29500)
    assert parse_main_address("[fe80::1]:6000") == ("fe80::1", 6000)
    with pytest.raises(UsageError, match="the port must be a number"):
        parse_main_address("node001:")


def test_one_machine_launches_as_before():
    command = launch_command(2, ["train", "r.yaml"])
    assert _after(command, "--num_machines") == "1" and "--machine_rank" not in command and "--rdzv_conf" not in command


def test_the_rendezvous_timeout_is_read_from_rdzv_conf():
    assert rendezvous_timeout("timeout=30") == 30
    assert rendezvous_timeout("read_timeout=5, timeout=600") == 600
    assert rendezvous_timeout("read_timeout=5") is None and rendezvous_timeout(None) is None


def test_the_exit_barrier_gets_the_rendezvous_timeout_and_is_put_back():
    """torchrun (torch.distributed.launcher.api.launch_agent) builds its agent by this module-level name
    and leaves exit_barrier_timeout at 300 s: if either changes, this says so."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.launcher import api

    assert "exit_barrier_timeout" in inspect.signature(LocalElasticAgent).parameters
    assert "LocalElasticAgent(" in inspect.getsource(api.launch_agent)
    with ppo_cli.launch.exit_barrier_timeout(30):
        assert api.LocalElasticAgent.func is LocalElasticAgent
        assert api.LocalElasticAgent.keywords == {"exit_barrier_timeout": 30}
    assert api.LocalElasticAgent is LocalElasticAgent
    with ppo_cli.launch.exit_barrier_timeout(None):
        assert api.LocalElasticAgent is LocalElasticAgent


def test_a_process_whose_launcher_is_gone_ends_and_one_whose_launcher_lives_goes_on():
    from ppo_cli.collectives import end_with_launcher

    gone = []
    end_with_launcher(os.getppid() + 1_000_000, on_gone=lambda: gone.append(True))  # never our parent
    assert gone == [True]
    stop = end_with_launcher(os.getppid(), poll_s=0.01, on_gone=lambda: gone.append("again"))
    import time

    time.sleep(0.1)
    stop.set()
    assert gone == [True]


# --- the SLURM example -------------------------------------------------------------------------

FAKE_SRUN = """#!/bin/bash
# srun's tasks, one per node in turn, each with its own SLURM_NODEID (options before the command dropped)
while [[ $1 == --* ]]; do shift; done
for id in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do SLURM_NODEID=$id "$@"; done
"""
FAKE_SCONTROL = "#!/bin/bash\nprintf 'gpu-a17\\ngpu-b03\\n'\n"  # `scontrol show hostnames`
FAKE_PPO = "#!/bin/bash\nprintf '%s\\n' \"$@\" > \"$ARGS_DIR/node$SLURM_NODEID\"\n"


@pytest.mark.slow  # runs bash
def test_the_sbatch_example_runs_one_ppo_train_per_node_with_its_rank(tmp_path):
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("ppo", FAKE_PPO)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "ARGS_DIR": str(tmp_path),
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu-a17,gpu-b03", "SLURM_GPUS_ON_NODE": "4"}
    subprocess.run(["bash", str(SBATCH), "recipes/tiny_sentiment.yaml", "--set", "seed=2", "--resume"],
                   env=env, check=True, cwd=ROOT)
    import typer

    from ppo_cli.cli import _bare_resume

    group = typer.main.get_command(app)
    parent = group.make_context("ppo", ["train"], resilient_parsing=True)
    for node in (0, 1):
        argv = (tmp_path / f"node{node}").read_text().splitlines()
        assert argv[0] == "train"
        params = group.get_command(parent, "train").make_context("train", _bare_resume(argv[1:]), parent=parent).params
        assert (params["num_machines"], params["machine_rank"], params["main_address"], params["num_processes"]) == \
            (2, node, "gpu-a17:29500", 8)
        assert list(params["overrides"]) == ["seed=2"] and params["resume"] == "latest"
        assert machines_for(params["num_processes"], 2, node, params["main_address"]) == Machines(2, node, ("gpu-a17", 29500))


def test_the_launcher_named_by_ppo_cli_is_trusted_only_in_a_process_torchrun_started(monkeypatch):
    from ppo_cli.collectives import launcher_pid
    from ppo_cli.launch import LAUNCHER_PID_ENV

    monkeypatch.setenv(LAUNCHER_PID_ENV, "4242")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert launcher_pid() == os.getppid()  # e.g. DeepSpeed's own launcher on another machine
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert launcher_pid() == 4242
