#!/usr/bin/env bash
# The GPU check of a session that holds the device machine (docs/gpu.md):
# configure the gpu preset (doctest and Google Benchmark come from .carry/prefix,
# made here by scripts/carry.sh), build the GPU tests (the runtime routers'
# CUDA instances included), the GPU benchmark, the PyTorch extension and
# moe_lm's CUDA test against the machine's CUDA PyTorch (python3 on PATH) for
# the local GPU, run them (the extension: its whole pytest suite, test_cuda.py
# included, and bench_extension.py --device cuda), and leave every log in $OUT (the device
# tool's output folder; build/gpu/out elsewhere). Exit status 0 when every GPU
# test passed, 1 when one failed, 2 when the configuration or the build failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu/out}
mkdir -p "$out"
source scripts/env.sh
{ nvidia-smi; nvcc --version; nproc; } > "$out/machine.txt" 2>&1
# Every find_package(Torch) of the build takes the machine's PyTorch (python3 on PATH),
# its Caffe2 package included (TorchConfig searches the system's first).
torch_cmake=$(python3 -c "import torch; print(torch.utils.cmake_prefix_path)" 2>/dev/null)
if ! cmake --preset gpu ${torch_cmake:+-DTorch_DIR="$torch_cmake/Torch" -DCaffe2_DIR="$torch_cmake/Caffe2"} \
       > "$out/configure.log" 2>&1; then
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
# The host-framework builds against the machine's PyTorch: a failure here is reported, and the core results stand.
grep -E "moe_route: (PyTorch extension|moe_lm)" "$out/configure.log"
if cmake --build --preset gpu -j "$(nproc)" --target moe_route_torch_extension moe_lm_cuda_tests \
     > "$out/build_torch.log" 2>&1; then
  ./build/gpu/examples/moe_lm/moe_lm_cuda_tests > "$out/moe_lm_cuda_tests.txt" 2>&1 || status=1
  echo "== moe_lm_cuda_tests"; grep -E "ERROR|test cases|assertions|skipped" "$out/moe_lm_cuda_tests.txt" | tail -25
  export PYTHONPATH=build/gpu/python
  python3 -m pytest -q -p no:cacheprovider -rs python/tests > "$out/pytest.txt" 2>&1 || status=1
  echo "== pytest python/tests"; grep -E "passed|failed|SKIPPED|Error" "$out/pytest.txt" | tail -15
  for n in 16384 262144; do
    python3 python/bench/bench_extension.py --device cuda --tokens $n > "$out/bench_extension_$n.txt" 2>&1 || status=1
    echo "== bench_extension.py --device cuda --tokens $n"; cat "$out/bench_extension_$n.txt"
  done
else
  echo "== the extension / moe_lm_cuda_tests did not build:"; grep -m 10 -A 8 "error" "$out/build_torch.log"
  status=1
fi
./build/gpu/bench/cuda/moe_route_gpu_bench > "$out/bench.txt" 2>&1 || status=1
echo "== moe_route_gpu_bench"; tail -25 "$out/bench.txt"
exit $status
