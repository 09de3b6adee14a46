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

# The engines whose routers the tests use as oracles (python/tests/test_megatron.py):
# their pure-PyTorch paths on the CPU, random weights, nothing downloaded from a hub.
# megatron-core 0.16.1 is the newest release for Python 3.11 (Debian 12's).
engines=("megatron-core==0.16.1" "transformers==5.23.0")
if "$venv/bin/python" -c "
import sys
from importlib.metadata import version
sys.exit(not (version('megatron-core') == '0.16.1' and version('transformers') == '5.23.0'))" 2>/dev/null; then
  echo "setup: $venv has ${engines[*]}"
else
  echo "setup: installing ${engines[*]} from PyPI"
  "$venv/bin/pip" install -q --disable-pip-version-check "${engines[@]}"
fi
