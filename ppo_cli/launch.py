"""`ppo train --num-processes N`: the same command under `accelerate launch`, N data-parallel processes;
with `--num-machines M --machine-rank I --main-address HOST:PORT`, this machine's share of them (N is the
total over all M machines, as accelerate's --num_processes; by default one process per machine).

The launched processes get the user's command line whole, less the launcher's own options: whatever
`ppo train` accepts (today's options and tomorrow's) reaches them unchanged. The launcher is accelerate's,
run by this module's ``main`` so that a process that fails is said once, by that process, in one line
(accelerate's own launcher ends with a traceback of torchrun's ChildFailedError).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import NoReturn

LAUNCHER_PID_ENV = "PPO_LAUNCHER_PID"  # the launcher's pid, for the processes it starts (collectives.launcher_pid)

# The launcher's own options, each taking one value: the launched processes must not launch again.
LAUNCHER_OPTIONS = ("--num-processes", "--accelerate-config", "--num-machines", "--machine-rank", "--main-address")


@dataclass(frozen=True)
class Machines:
    """Where this launcher sits among the run's machines (accelerate's num_machines, machine_rank,
    main_process_ip, main_process_port). ``address``: the main machine's (host, port); None: one machine."""

    count: int = 1
    rank: int = 0
    address: tuple[str, int] | None = None

    def launcher_options(self, timeout_s: int | None = None) -> list[str]:
        """`accelerate launch` options for these machines; [] for one machine without an address. Static
        rendezvous (torchrun's): every machine is told its rank, machine 0 hosts the rendezvous store.
        ``timeout_s`` (train.collective_timeout_s): how long the launchers wait for each other, to join
        and (quiet_launch) to leave."""
        if self.address is None:
            return []
        host, port = self.address
        options = ["--num_machines", str(self.count), "--machine_rank", str(self.rank),
                   "--main_process_ip", host, "--main_process_port", str(port), "--rdzv_backend", "static"]
        return options + (["--rdzv_conf", f"timeout={timeout_s}"] if timeout_s else [])


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


def machines_for(num_processes: int | None, count: int | None, rank: int | None, address: str | None,
                 config_file=None) -> Machines:
    """check_machines for the options given, each option not given read from the accelerate config
    ``config_file`` (num_machines, machine_rank, main_process_ip/port, num_processes) or defaulted."""
    config = _read_accelerate_config(config_file) if config_file is not None else {}
    count = count if count is not None else int(config.get("num_machines") or 1)
    rank = rank if rank is not None else int(config.get("machine_rank") or 0)
    if address is None and count > 1 and config.get("main_process_ip"):
        address = f"{config['main_process_ip']}:{config.get('main_process_port') or 29500}"
    num_processes = num_processes if num_processes is not None else config.get("num_processes")
    return check_machines(num_processes, count, rank, address)


def _read_accelerate_config(path) -> dict:
    import yaml

    from ppo_cli.errors import UsageError

    try:
        config = yaml.safe_load(open(path)) or {}
    except yaml.YAMLError as err:
        raise UsageError(f"accelerate config {path} is not YAML: {str(err).splitlines()[0]}",
                         hint="give a file written by `accelerate config` (or one of recipes/accelerate/)") from None
    if not isinstance(config, dict):
        raise UsageError(f"accelerate config {path} is not a mapping of settings",
                         hint="give a file written by `accelerate config` (or one of recipes/accelerate/)")
    return config


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


def launch_command(num_processes: int, ppo_args: list[str], config_file=None, machines: Machines = Machines(),
                   timeout_s: int | None = None) -> list[str]:
    """`accelerate launch` running `python -m ppo_cli <ppo_args>` (``ppo_args`` from forwarded_args).

    ``num_processes``: the total over all ``machines`` (each machine starts its share); ``machines``' options
    override what a config file says about them; ``timeout_s``: Machines.launcher_options.

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
        launcher += machines.launcher_options(timeout_s)
    else:
        launcher += ["--multi_gpu", "--num_processes", str(num_processes),
                     "--mixed_precision", "no", "--dynamo_backend", "no"]
        launcher += machines.launcher_options(timeout_s) or ["--num_machines", "1", "--main_process_port", str(_free_port())]
    return [*launcher, "-m", "ppo_cli", *ppo_args]


def launch_train(num_processes: int, argv: list[str], config_file=None, machines: Machines = Machines(),
                 timeout_s: int | None = None, resume: str | None = None) -> NoReturn:
    """Become the launcher, the user's ``argv`` forwarded: the process the user (or SLURM) started is the
    one that launches, so killing it kills the launcher and its exit code is the launcher's. ``resume``:
    the user's command to resume the run, for the hints of the launcher and its processes (errors.RESUME)."""
    from ppo_cli.errors import RESUME_ENV

    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({RESUME_ENV: resume} if resume else {})}
    command = launch_command(num_processes, forwarded_args(argv), config_file, machines, timeout_s)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(command[0], command, env)


def rendezvous_timeout(rdzv_conf: str | None) -> int | None:
    """The ``timeout`` of accelerate's --rdzv_conf ("timeout=600,key=value"), or None when it names none."""
    for item in (rdzv_conf or "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "timeout" and value.strip().isdigit():
            return int(value)
    return None


@contextlib.contextmanager
def exit_barrier_timeout(timeout_s: int | None):
    """torchrun's agent, once its own processes have all succeeded, waits for every other machine's
    agent in an exit barrier on the rendezvous store, for 300 s whatever torchrun is told (torch 2.13:
    LocalElasticAgent's exit_barrier_timeout, which torchrun and accelerate do not expose). A machine
    whose launcher was killed never arrives: wait ``timeout_s`` instead, the rendezvous timeout.
    None: torchrun's own wait."""
    from torch.distributed.launcher import api

    agent = api.LocalElasticAgent
    if timeout_s is not None:
        api.LocalElasticAgent = functools.partial(agent, exit_barrier_timeout=timeout_s)
    try:
        yield
    finally:
        api.LocalElasticAgent = agent


class _ExitBarrierMissed(logging.Handler):
    """Notes torchrun's agent logging that its exit barrier failed (it then exits as if all went well)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.missed = False

    def emit(self, record: logging.LogRecord) -> None:
        self.missed = self.missed or "exit barrier" in record.getMessage()


def quiet_launch(argv: list[str]) -> int:
    """`accelerate launch ARGV`; returns the exit code of the process that failed first (0 when none did).

    A process that exits with a code has printed its own error line; one killed by a signal (the
    out-of-memory killer's SIGKILL, a crash) could not, so that line is printed here. torchrun's log
    lines (each failure, each process it stops) are left out: they repeat what the processes said.
    The processes learn this launcher's pid (collectives.end_with_launcher: they end with it).
    """
    # torch's C++ warnings (the rendezvous store's socket timeouts) repeat what the line below says; read
    # once, when torch loads: the processes launched get the environment as it was.
    cpp_log_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    _restore_env("TORCH_CPP_LOG_LEVEL", cpp_log_level)
    from ppo_cli.errors import RESUME, print_error

    quiet = logging.getLogger("torch.distributed.elastic")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    missed = _ExitBarrierMissed()
    quiet.addHandler(missed)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    args = launch_command_parser().parse_args(argv)
    timeout_s = rendezvous_timeout(args.rdzv_conf)
    try:
        with exit_barrier_timeout(timeout_s):
            launch_command(args)
    except (ConnectionError, DistError) as err:
        message, hint = _rendezvous_failure(err, args.main_process_port)
        print_error(message, hint=hint)
        return 1
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        if failure.exitcode > 0:
            return failure.exitcode
        name = failure.signal_name()
        print_error(f"process {rank} was killed by {name}",
                    hint="SIGKILL often means the machine ran out of memory: see `ppo plan RECIPE`" if name == "SIGKILL"
                    else "the other processes' lines above say what they saw")
        return 1
    if missed.missed:
        _print_warning(f"this machine's processes finished, but another machine's launcher did not report its end "
                       f"within {timeout_s or 300} s (killed, or its machine went down)",
                       hint=f"the run is complete if its final/ was written; if not, `{RESUME}` on "
                            "every machine continues from the last checkpoint")
    return 0


def _rendezvous_failure(err: Exception, port) -> tuple[str, str]:
    """(line, hint) for a launch whose machines could not meet; ``err`` re-raised when it is something else."""
    from ppo_cli.errors import first_line

    if isinstance(err, ConnectionError) and "utilizing it" in str(err):  # accelerate's check on machine 0
        return (f"port {port} on this machine is in use by another process",
                "choose another port in --main-address (the same on every machine)")
    if isinstance(err, ConnectionError):
        raise err
    # torchrun's static rendezvous: a machine never came, or machine 0 cannot be reached.
    return (f"the machines did not all meet at the rendezvous: {first_line(err)}",
            "start `ppo train` with the same --num-machines and --main-address on every machine within "
            "train.collective_timeout_s, and check that machine 0's address and port are reachable from the others")


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _print_warning(message: str, hint: str) -> None:
    from rich.text import Text

    from ppo_cli.errors import stderr_console, with_resume_command

    console = stderr_console()
    console.print(Text.assemble(("warning:", "bold yellow"), " ", message))
    console.print(Text.assemble(("hint:", "bold"), " ", with_resume_command(hint)))


if __name__ == "__main__":
    sys.exit(quiet_launch(sys.argv[1:]))
