"""`ppo train --num-processes N`: the same command under `accelerate launch`, N data-parallel processes;
with `--num-machines M --machine-rank I --main-address HOST:PORT`, this machine's share of them (N is the
total over all M machines, as accelerate's --num_processes; by default one process per machine).

The launched processes get the user's command line whole, less the launcher's own options: whatever
`ppo train` accepts (today's options and tomorrow's) reaches them unchanged. The launcher is accelerate's,
run by this module's ``main`` so that a process that fails is said once, by that process, in one line
(accelerate's own launcher ends with a traceback of torchrun's ChildFailedError).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from dataclasses import dataclass

# The launcher's own options, each taking one value: the launched processes must not launch again.
LAUNCHER_OPTIONS = ("--num-processes", "--accelerate-config", "--num-machines", "--machine-rank", "--main-address")


@dataclass(frozen=True)
class Machines:
    """Where this launcher sits among the run's machines (accelerate's num_machines, machine_rank,
    main_process_ip, main_process_port). ``address``: the main machine's (host, port); None: one machine."""

    count: int = 1
    rank: int = 0
    address: tuple[str, int] | None = None

    def launcher_options(self) -> list[str]:
        """`accelerate launch` options for these machines; [] for one machine without an address. Static
        rendezvous (torchrun's): every machine is told its rank, the main machine hosts the store."""
        if self.address is None:
            return []
        host, port = self.address
        return ["--num_machines", str(self.count), "--machine_rank", str(self.rank),
                "--main_process_ip", host, "--main_process_port", str(port), "--rdzv_backend", "static"]


def parse_main_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6 address]:PORT`` too) -> (host, port); UsageError when either is missing or bad."""
    from ppo_cli.errors import UsageError

    host, colon, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    hint = "write the first machine's address and a free port on it, e.g. --main-address node001:29500"
    if not colon or not host:
        raise UsageError(f"--main-address {text!r} is not HOST:PORT", hint=hint)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--main-address {text!r}: the port must be a number from 1 to 65535", hint=hint)
    return host, int(port)


def check_machines(num_processes: int | None, count: int, rank: int, address: str | None) -> Machines:
    """The machines the options describe, or a UsageError naming the first inconsistency.
    ``num_processes``: --num-processes as given (None: one per machine), the total over all machines."""
    from ppo_cli.errors import UsageError

    if not 0 <= rank < count:
        raise UsageError(f"--machine-rank {rank} is out of range for --num-machines {count}",
                         hint=f"number the machines 0 to {count - 1}; the one at --main-address is 0")
    if count > 1 and address is None:
        raise UsageError(f"--num-machines {count} needs --main-address HOST:PORT",
                         hint="give every machine the address of machine 0 and a free port on it, e.g. node001:29500")
    if num_processes is not None and num_processes % count:
        raise UsageError(f"--num-processes {num_processes} cannot be split evenly over --num-machines {count}",
                         hint=f"--num-processes is the total over all machines (accelerate's --num_processes): "
                              f"give a multiple of {count}, e.g. {count * max(1, num_processes // count)}")
    return Machines(count, rank, parse_main_address(address) if address is not None else None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def forwarded_args(argv: list[str]) -> list[str]:
    """``argv`` (a `ppo` command line without the program name, e.g. ``['train', 'r.yaml', ...]``)
    without the launcher's options, in both spellings (``--num-processes 2``, ``--num-processes=2``).
    Everything after a ``--`` is passed as it is."""
    out: list[str] = []
    skip_value = False
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if skip_value:
            skip_value = False
        elif arg in LAUNCHER_OPTIONS:
            skip_value = True
        elif not arg.startswith(tuple(option + "=" for option in LAUNCHER_OPTIONS)):
            out.append(arg)
    return out


def launch_command(num_processes: int, ppo_args: list[str], config_file=None, machines: Machines = Machines()) -> list[str]:
    """`accelerate launch` running `python -m ppo_cli <ppo_args>` (``ppo_args`` from forwarded_args).

    ``num_processes``: the total over all ``machines`` (each machine starts its share); ``machines``' options
    override what a config file says about them.

    With ``config_file`` (the user's accelerate config) the launch is as that file says: its
    distributed type, mixed precision and dynamo backend are not overridden; ``num_processes`` > 1
    overrides its process count. Without one: ``num_processes`` data-parallel processes, where
    --multi_gpu selects torchrun-style launching (on a machine without CUDA they talk over gloo:
    ppo_cli asks accelerate for cpu=True there) and precision comes from the recipe (train.mixed_precision:
    the launcher's 'no' reads as "not set", distributed.launcher_mixed_precision).
    """
    launcher = [sys.executable, "-m", "ppo_cli.launch"]
    if config_file is not None:
        launcher += ["--config_file", str(config_file)]
        launcher += ["--num_processes", str(num_processes)] if num_processes > 1 else []
        launcher += machines.launcher_options()
    else:
        launcher += ["--multi_gpu", "--num_processes", str(num_processes),
                     "--mixed_precision", "no", "--dynamo_backend", "no"]
        launcher += machines.launcher_options() or ["--num_machines", "1", "--main_process_port", str(_free_port())]
    return [*launcher, "-m", "ppo_cli", *ppo_args]


def launch_train(num_processes: int, argv: list[str], config_file=None, machines: Machines = Machines()) -> int:
    """Run the launcher in the foreground with the user's ``argv`` forwarded; its exit code is ours."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = launch_command(num_processes, forwarded_args(argv), config_file, machines)
    return subprocess.run(command, env=env).returncode


def quiet_launch(argv: list[str]) -> int:
    """`accelerate launch ARGV`; returns the exit code of the process that failed first (0 when none did).

    A process that exits with a code has printed its own error line; one killed by a signal (the
    out-of-memory killer's SIGKILL, a crash) could not, so that line is printed here. torchrun's log
    lines (each failure, each process it stops) are left out: they repeat what the processes said.
    """
    import logging

    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    quiet = logging.getLogger("torch.distributed.elastic")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    try:
        launch_command(launch_command_parser().parse_args(argv))
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode > 0:
            return failure.exitcode
        from ppo_cli.errors import print_error

        name = failure.signal_name()
        print_error(f"process {rank} was killed by {name}",
                    hint="SIGKILL often means the machine ran out of memory: see `ppo plan RECIPE`" if name == "SIGKILL"
                    else "the other processes' lines above say what they saw")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(quiet_launch(sys.argv[1:]))
