"""`ppo train --num-processes N`: the same command under `accelerate launch`, N data-parallel processes."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

# Set in the processes of our own launch (no --accelerate-config): the `--mixed_precision no` given to
# accelerate is a placeholder, and train.mixed_precision decides (distributed.launcher_mixed_precision).
RECIPE_DECIDES = "PPO_CLI_PRECISION_FROM_RECIPE"


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
    ppo_cli asks accelerate for cpu=True there) and precision comes from the recipe
    (train.mixed_precision, 'auto' included: launch_train tells the processes so).
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
    env.pop(RECIPE_DECIDES, None)
    if config_file is None:  # our `--mixed_precision no` is a placeholder, not the user's choice
        env[RECIPE_DECIDES] = "1"
    return subprocess.run(launch_command(num_processes, train_args, config_file), env=env).returncode
