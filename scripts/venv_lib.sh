# Sourced by setup_env.sh, vllm_test.sh and deepspeed_test.sh: make a venv, install the right torch.
# Expects ROOT (the repository root). PPO_TORCH_SPEC overrides the torch to install (pip arguments).

PPO_TORCH_VERSION=2.13.0  # the torch the tests run with; pyproject's range (<2.14) keeps it
PPO_TORCH_CPU_INDEX="${PPO_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

# make_venv DIR: create the venv DIR if it is missing; sets PY to its python.
make_venv() {
  PY="$1/bin/python"
  if [ ! -x "$PY" ]; then
    echo "setup: creating $1"
    python3 -m venv "$1"
    "$PY" -m pip install -q --upgrade pip
  fi
}

# needs_install STAMP: true until STAMP is newer than pyproject.toml.
needs_install() {
  [ ! -f "$1" ] || [ "$ROOT/pyproject.toml" -nt "$1" ]
}

# index_reachable URL: the index answers within 5 s. pip would retry an unreachable host for minutes.
index_reachable() {
  python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5)' \
    "$1" >/dev/null 2>&1
}

# install_torch: torch before ppo_cli, so that ppo_cli's torch range is met and pip installs no other.
# PyPI's Linux torch wheels are CUDA builds (several GB of nvidia-* packages); on Linux without CUDA
# the CPU build (2.13.0+cpu) comes from PyTorch's own index. PyPI's macOS wheels are CPU builds already.
install_torch() {
  if "$PY" -c "import torch" 2>/dev/null; then
    return 0
  fi
  if [ -n "${PPO_TORCH_SPEC:-}" ]; then
    echo "setup: installing $PPO_TORCH_SPEC"
    # shellcheck disable=SC2086
    "$PY" -m pip install -q $PPO_TORCH_SPEC
    return
  fi
  if [ "$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    if index_reachable "$PPO_TORCH_CPU_INDEX"; then
      echo "setup: installing torch==$PPO_TORCH_VERSION+cpu from $PPO_TORCH_CPU_INDEX"
      "$PY" -m pip install -q --extra-index-url "$PPO_TORCH_CPU_INDEX" "torch==$PPO_TORCH_VERSION+cpu"
      return
    fi
    echo "setup: $PPO_TORCH_CPU_INDEX cannot be reached; torch==$PPO_TORCH_VERSION from the configured index" \
         "(on PyPI a CUDA build of several GB; set PPO_TORCH_SPEC to choose another)"
  fi
  echo "setup: installing torch==$PPO_TORCH_VERSION"
  "$PY" -m pip install -q "torch==$PPO_TORCH_VERSION"
}
