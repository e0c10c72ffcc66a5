"""`ppo train --num-processes N`: the same command under `accelerate launch`, N data-parallel processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(num_processes: int, train_args: list[str]) -> list[str]:
    """`accelerate launch` running `python -m ppo_cli train ...` in ``num_processes`` processes.

    --multi_gpu selects torchrun-style launching; on a machine without CUDA the processes then talk
    over gloo (ppo_cli asks accelerate for cpu=True there). An accelerate config file, if the user
    has one (ACCELERATE_CONFIG_FILE or `accelerate config`), still applies to the rest.
    """
    return [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", str(num_processes), "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(_free_port()),
        "-m", "ppo_cli", "train", *train_args,
    ]


def launch_train(num_processes: int, train_args: list[str]) -> int:
    """Run the launcher in the foreground; its exit code is ours."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(launch_command(num_processes, train_args), env=env).returncode
