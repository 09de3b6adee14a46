#!/usr/bin/env bash
# The GPU check of a session that holds the device machine (docs/gpu.md):
# configure the gpu preset (doctest and Google Benchmark come from .carry/prefix,
# made here by scripts/carry.sh), build the GPU tests (the runtime routers'
# CUDA instances included) and the GPU benchmark for the local GPU, run them,
# and leave every log in $OUT (the device tool's output folder; build/gpu/out
# elsewhere). Exit status 0 when every GPU test passed, 1 when one failed,
# 2 when the configuration or the build failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu/out}
mkdir -p "$out"
source scripts/env.sh
{ nvidia-smi; nvcc --version; nproc; } > "$out/machine.txt" 2>&1
if ! cmake --preset gpu -DMOE_ROUTE_BUILD_PYTHON=OFF -DMOE_ROUTE_BUILD_EXAMPLES=OFF > "$out/configure.log" 2>&1; then
  tail -30 "$out/configure.log"
  exit 2
fi
if ! cmake --build --preset gpu -j "$(nproc)" --target moe_route_gpu_tests moe_route_gpu_admission_tests \
       moe_route_gpu_bench > "$out/build.log" 2>&1; then
  grep -m 20 -A 8 "error" "$out/build.log"
  exit 2
fi
status=0
for t in moe_route_gpu_tests moe_route_gpu_admission_tests; do
  ./build/gpu/tests/cuda/$t > "$out/$t.txt" 2>&1 || status=1
  echo "== $t"; grep -E "ERROR|test cases|assertions|skipped" "$out/$t.txt" | tail -25
done
./build/gpu/bench/cuda/moe_route_gpu_bench > "$out/bench.txt" 2>&1 || status=1
echo "== moe_route_gpu_bench"; tail -25 "$out/bench.txt"
exit $status
