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


def launch_command(num_processes: int, train_args: list[str], config_file=None) -> list[str]:
    """`accelerate launch` running `python -m ppo_cli train ...`.

    With ``config_file`` (the user's accelerate config) the launch is as that file says: its
    distributed type, mixed precision and dynamo backend are not overridden; ``num_processes`` > 1
    overrides its process count. Without one: ``num_processes`` data-parallel processes, where
    --multi_gpu selects torchrun-style launching (on a machine without CUDA they talk over gloo:
    ppo_cli asks accelerate for cpu=True there) and precision comes from the recipe (train.mixed_precision:
    the launcher's 'no' reads as "not set", distributed.launcher_mixed_precision).
    """
    launcher = [sys.executable, "-m", "accelerate.commands.launch"]
    if config_file is not None:
        launcher += ["--config_file", str(config_file)]
        launcher += ["--num_processes", str(num_processes)] if num_processes > 1 else []
    else:
        launcher += [
            "--multi_gpu", "--num_processes", str(num_processes), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(_free_port()),
        ]
    return [*launcher, "-m", "ppo_cli", "train", *train_args]


def launch_train(num_processes: int, train_args: list[str], config_file=None) -> int:
    """Run the launcher in the foreground; its exit code is ours."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(launch_command(num_processes, train_args, config_file), env=env).returncode
