#!/usr/bin/env bash
# Installs what moe_route's build, tests, benchmarks and examples need: Debian
# 12 packages, and PyTorch with the Python test tools from PyPI into the
# project's virtual environment .venv (scripts/env.sh puts it first on PATH,
# and CMake finds LibTorch inside it: cmake/torch.cmake). One PyTorch serves
# the Python extension, the moe_lm driver and the benchmarks' LibTorch peers.
# Idempotent: what is already present is left alone.
set -euo pipefail

packages=(cmake ninja-build g++ doctest-dev libbenchmark-dev pkgconf libigraph-dev libcli11-dev
          nlohmann-json3-dev libxtensor-dev gnuplot-nox python3-dev python3-venv
          libopenmpi-dev openmpi-bin)
# --fuzz: also clang and its libFuzzer and sanitizer runtimes, for the fuzz
# preset (scripts/fuzz.sh); the normal build replays the corpus without them.
if [[ "${1:-}" == "--fuzz" ]]; then
  packages+=(clang libclang-rt-14-dev)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  echo "setup: all packages present"
fi

# PyPI's torch for Linux x86-64 is its CUDA build (the CUDA libraries come as
# nvidia-* wheels, about 5 GB in all); it runs on machines without a GPU.
torch_version=2.15.0
venv="$(cd "$(dirname "$0")/.." && pwd)/.venv"
if "$venv/bin/python" -c "import sys, torch, pytest, pybind11, numpy; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
  echo "setup: $venv has torch $torch_version"
else
  echo "setup: creating $venv with torch $torch_version from PyPI"
  /usr/bin/python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "torch==$torch_version" "pytest==9.2.0" "pybind11==3.1.0" "numpy==2.4.6"
fi

# Installs pinned PyPI packages (name==version) into the venv unless all are
# there at those versions; arguments starting with -- go to pip.
pip_pinned() {
  local options=() specs=() a
  for a in "$@"; do
    if [[ $a == --* ]]; then options+=("$a"); else specs+=("$a"); fi
  done
  if "$venv/bin/python" -c "
import sys
from importlib.metadata import version
sys.exit(not all(version(name) == v for name, v in (spec.split('==') for spec in sys.argv[1:])))" "${specs[@]}" 2>/dev/null; then
    echo "setup: $venv has ${specs[*]}"
  else
    echo "setup: installing ${specs[*]} from PyPI ${options[*]}"
    "$venv/bin/pip" install -q --disable-pip-version-check "${options[@]}" "${specs[@]}"
  fi
}

# The engines whose routers the tests use as oracles (python/tests/test_megatron.py,
# test_transformers.py): their pure-PyTorch paths on the CPU, random weights,
# nothing downloaded from a hub. megatron-core 0.16.1 is the newest release for
# Python 3.11 (Debian 12's).
pip_pinned "megatron-core==0.16.1" "transformers==5.23.0"

# torchtitan's router (python/tests/test_torchtitan.py): the package without its
# training stack (datasets, tokenizers, wandb, torchdata, tensorboard, ...), with
# only what its model and optimizer modules import (torchtitan.models.common.moe,
# torchtitan.components.optimizer): spmd_types, and tyro with its docstring_parser.
pip_pinned --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3" "tyro==1.0.17" "docstring_parser==0.18.0"
