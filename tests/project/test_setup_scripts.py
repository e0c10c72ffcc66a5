"""scripts/setup_env.sh and the vLLM / DeepSpeed test scripts, run by bash against a fake venv whose
python records its pip arguments: which torch each machine gets, and how fast an unreachable CPU
index is given up."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # spawns bash

FAKE_PYTHON = """#!/bin/bash
echo "$*" >> "$PIP_LOG"
[ "$*" = "-c import torch" ] && exit "${TORCH_IMPORT_RC:-1}"
exit 0
"""


class Machine:
    """A fake venv (python records its arguments) and a PATH that has nvidia-smi or not, on Linux or macOS."""

    def __init__(self, tmp: Path, cuda: bool = False, system: str = "Linux"):
        self.venv, self.bin, self.log = tmp / "venv", tmp / "bin", tmp / "pip.log"
        (self.venv / "bin").mkdir(parents=True)
        self.bin.mkdir()
        self._script(self.venv / "bin" / "python", FAKE_PYTHON)
        self._script(self.bin / "uname", f"#!/bin/bash\necho {system}\n")
        if cuda:
            self._script(self.bin / "nvidia-smi", "#!/bin/bash\nexit 0\n")
        self.log.write_text("")

    @staticmethod
    def _script(path: Path, text: str) -> None:
        path.write_text(text)
        path.chmod(0o755)

    def run(self, command: list[str], **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
        full_env = {"PATH": f"{self.bin}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"),
                    "PIP_LOG": str(self.log), "PPO_VENV": str(self.venv), **env}
        result = subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=60)
        return result, self.log.read_text().splitlines()

    def setup_env(self, **env: str):
        return self.run(["bash", str(ROOT / "scripts" / "setup_env.sh")], **env)


def _torch_installs(calls: list[str]) -> list[str]:
    return [call for call in calls if call.startswith("-m pip install") and "torch" in call]


@pytest.fixture
def cpu_index(tmp_path):
    """A local index that answers like download.pytorch.org/whl/cpu does: a page under torch/."""
    root = tmp_path / "index"
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "index.html").write_text("<a>torch-2.13.0+cpu</a>")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(root))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def silent_index():
    """A host that accepts connections and never answers (a firewall that drops, a hung proxy)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_setup_env_takes_the_cpu_build_from_pytorchs_index_on_linux_without_cuda(tmp_path, cpu_index):
    machine = Machine(tmp_path)
    result, calls = machine.setup_env(PPO_TORCH_CPU_INDEX=cpu_index)
    assert result.returncode == 0, result.stderr
    assert _torch_installs(calls) == [f"-m pip install -q --extra-index-url {cpu_index} torch==2.13.0+cpu"]
    assert calls[-1] == f"-m pip install -q -e {ROOT}[dev,plot,tensorboard]"
    assert (machine.venv / ".ppo_cli-installed").exists()


def test_setup_env_falls_back_to_the_configured_index_within_seconds_when_pytorchs_cannot_be_reached(tmp_path, silent_index):
    machine = Machine(tmp_path)
    started = time.monotonic()
    result, calls = machine.setup_env(PPO_TORCH_CPU_INDEX=silent_index)
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 20  # a 5 s probe, not pip's minutes of retries
    assert _torch_installs(calls) == ["-m pip install -q torch==2.13.0"]
    assert f"setup: {silent_index} cannot be reached" in result.stdout


@pytest.mark.parametrize("cuda, system", [(True, "Linux"), (False, "Darwin")], ids=["linux-cuda", "macos"])
def test_setup_env_takes_the_default_index_where_it_has_the_right_build(tmp_path, cpu_index, cuda, system):
    result, calls = Machine(tmp_path, cuda=cuda, system=system).setup_env(PPO_TORCH_CPU_INDEX=cpu_index)
    assert result.returncode == 0, result.stderr
    assert _torch_installs(calls) == ["-m pip install -q torch==2.13.0"]


def test_setup_env_keeps_an_installed_torch_and_an_up_to_date_install(tmp_path):
    machine = Machine(tmp_path)
    (machine.venv / ".ppo_cli-installed").touch()
    os.utime(machine.venv / ".ppo_cli-installed", (time.time() + 60, time.time() + 60))  # newer than pyproject.toml
    result, calls = machine.setup_env(TORCH_IMPORT_RC="0")
    assert result.returncode == 0, result.stderr
    assert calls == ["-c import torch"]


@pytest.mark.parametrize("script, extra", [("deepspeed_test.sh", "[deepspeed]"), ("vllm_test.sh", "[gguf]")])
def test_the_vllm_and_deepspeed_venvs_get_the_same_cpu_torch(tmp_path, cpu_index, script, extra):
    machine = Machine(tmp_path)
    result, calls = machine.run(["bash", str(ROOT / "scripts" / script), "--setup-only"], PPO_TORCH_CPU_INDEX=cpu_index)
    assert result.returncode == 0, result.stderr
    assert _torch_installs(calls) == [f"-m pip install -q --extra-index-url {cpu_index} torch==2.13.0+cpu"]
    assert f"-m pip install -q -e {ROOT}{extra} pytest" in calls


def test_test_sh_passes_its_pytest_arguments_to_pytest_not_to_the_venv_setup(tmp_path):
    """scripts/test.sh sources setup_env.sh, which sees test.sh's own arguments: `scripts/test.sh -q` must
    still set up ROOT/.venv (here a copy of the scripts whose .venv is the fake one) and run pytest with -q."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in ("test.sh", "setup_env.sh", "venv_lib.sh"):
        (repo / "scripts" / name).write_text((ROOT / "scripts" / name).read_text())
    (repo / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    machine = Machine(tmp_path)
    (repo / ".venv").symlink_to(machine.venv)
    env = {"PATH": f"{machine.bin}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp"), "PIP_LOG": str(machine.log),
           "TORCH_IMPORT_RC": "0"}
    for workers, pytest_line in (("3", "-m pytest -n 3 --dist loadfile --no-loadscope-reorder -q -x"), ("1", "-m pytest -q -x")):
        result = subprocess.run(["bash", "scripts/test.sh", "-q", "-x"], cwd=repo, env=env | {"PPO_TEST_WORKERS": workers},
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
        assert not (repo / "-q").exists()
        assert machine.log.read_text().splitlines()[-1] == pytest_line
    # A caller's own -n wins.
    result = subprocess.run(["bash", "scripts/test.sh", "-n", "2", "-q"], cwd=repo, env=env | {"PPO_TEST_WORKERS": "3"},
                            capture_output=True, text=True, timeout=60)
    assert machine.log.read_text().splitlines()[-1] == "-m pytest -n 2 -q"
