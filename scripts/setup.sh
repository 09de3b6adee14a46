#!/usr/bin/env bash
# Installs what moe_route's build, tests, benchmarks and examples need from
# Debian 12 packages. Idempotent: packages already present are left alone.
set -euo pipefail

# libopenblas0-serial: Debian's LibTorch and python3-torch call the system
# libblas.so.3, which Debian points at OpenBLAS once it is installed (moe_lm's
# training steps run about 4x faster than on the reference BLAS); the serial
# build keeps every product independent of the thread count.
packages=(cmake ninja-build g++ doctest-dev libbenchmark-dev libtorch-dev pkgconf libigraph-dev libcli11-dev
          nlohmann-json3-dev libxtensor-dev gnuplot-nox libopenblas0-serial
          python3-dev python3-torch python3-pybind11 pybind11-dev python3-pytest python3-numpy
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
