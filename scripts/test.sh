#!/usr/bin/env bash
# The test command: install dependencies, configure (default preset: CPU plus
# the CUDA backend compiled for sm_80/sm_90 when nvcc exists), build
# everything, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
cmake --preset default
cmake --build --preset default
ctest --preset default
