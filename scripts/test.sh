#!/usr/bin/env bash
# The test command: install dependencies, configure (default preset: CPU plus
# the CUDA backend compiled for sm_80/sm_90 when nvcc exists), build the tests,
# examples and the Python extension, run the whole suite; then the sanitizer
# stage: the CPU suite and the fuzz corpora under ASan + UBSan, the threaded
# cases and corpora under ThreadSanitizer (scripts/sanitize.sh,
# docs/reliability.md "Sanitizers").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --fuzz
source scripts/env.sh
# Benchmarks are not tests: leaving them out keeps the suite inside CI's time on
# 2 cores (they are built by `cmake --preset default`, docs/performance.md).
cmake --preset default -DMOE_ROUTE_BUILD_BENCHMARKS=OFF
cmake --build --preset default
# The engines' oracles (python/tests/test_megatron.py, test_transformers.py,
# test_torchtitan.py) must run here, not skip.
MOE_ROUTE_REQUIRE_ENGINES=1 ctest --preset default
bash scripts/sanitize.sh
