#!/usr/bin/env bash
# The GPU check of a session that holds the device machine (docs/gpu.md).
# Configures the gpu preset (doctest, Google Benchmark and nlohmann-json come
# from .carry/prefix, made here by scripts/carry.sh; LibTorch is the machine's
# PyTorch, python3 on PATH) and builds, for the local GPU and in one parallel
# build that keeps going past a failed target:
#   the GPU tests (the runtime routers' CUDA instances included), the GPU
#   benchmark, the PyTorch extension's CUDA branch and moe_lm_cuda_tests.
# Then it runs them, quickest and most telling first, so that a command cut
# short by its time limit still returns the main results: the GPU tests
# without the 2^24-token case, the admission tests, moe_lm_cuda_tests, the
# extension's pytest suite (test_cuda.py: CUDA vs CPU bit for bit, a training step
# under torch.cuda.set_sync_debug_mode("error"), CUDA-graph replay against
# eager; test_operators.py: opcheck), the benchmarks
# (moe_route_gpu_bench, bench_extension.py --device cuda), the 2^24-token
# case, and last the GPU tests under compute-sanitizer (memcheck, racecheck,
# synccheck, initcheck). Every log goes to $OUT (the device tool's output folder;
# build/gpu/out elsewhere), with the time each stage ended in stages.txt.
# Exit status 0 when every test passed, 1 when one failed or a host-framework
# target did not build, 2 when the configuration or the core GPU tests' build failed.
# CUDA_ARCH=90 (say) replaces the preset's `native`, to rehearse the script on
# a machine without a GPU, where every GPU case then reports as skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-build/gpu/out}
mkdir -p "$out"
source scripts/env.sh
stage() { echo "$(date -u +%T) $1" >> "$out/stages.txt"; }
stage start
{ nvidia-smi; nvcc --version; nproc; } > "$out/machine.txt" 2>&1
# Every find_package(Torch) of the build takes the machine's PyTorch (python3 on PATH),
# its Caffe2 package included (TorchConfig searches the system's first).
torch_cmake=$(python3 -c "import torch; print(torch.utils.cmake_prefix_path)" 2>/dev/null)
if ! cmake --preset gpu ${torch_cmake:+-DTorch_DIR="$torch_cmake/Torch" -DCaffe2_DIR="$torch_cmake/Caffe2"} \
       ${CUDA_ARCH:+-DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH} > "$out/configure.log" 2>&1; then
  tail -30 "$out/configure.log"
  exit 2
fi
grep -E "moe_route: (CUDA backend|PyTorch extension|moe_lm)" "$out/configure.log"
stage configured
cmake --build --preset gpu -j "$(nproc)" --target moe_route_gpu_tests moe_route_gpu_admission_tests \
  moe_route_gpu_bench moe_route_torch_extension moe_lm_cuda_tests -- -k 0 > "$out/build.log" 2>&1
stage built
b=build/gpu
if [ ! -x $b/tests/cuda/moe_route_gpu_tests ] || [ ! -x $b/tests/cuda/moe_route_gpu_admission_tests ]; then
  grep -m 20 -A 8 "error" "$out/build.log"
  exit 2
fi
status=0
run() {  # run NAME COMMAND...: log to $OUT/NAME.txt, print its summary
  local name=$1
  shift
  "$@" > "$out/$name.txt" 2>&1 || status=1
  echo "== $name"
  grep -E "ERROR|test cases|assertions|skipped|passed|failed|SKIPPED|Error" "$out/$name.txt" | tail -20
  stage "$name"
}
run gpu_tests $b/tests/cuda/moe_route_gpu_tests -tce="large batch*"
run gpu_admission_tests $b/tests/cuda/moe_route_gpu_admission_tests
have_lm=0; have_ext=0
[ -x $b/examples/moe_lm/moe_lm_cuda_tests ] && have_lm=1
ls $b/python/moe_route/_C*.so > /dev/null 2>&1 && have_ext=1
if [ $have_lm = 0 ] || [ $have_ext = 0 ]; then
  echo "== did not build: $([ $have_lm = 0 ] && echo moe_lm_cuda_tests) $([ $have_ext = 0 ] && echo the extension)"
  grep -m 10 -A 8 "error" "$out/build.log"
  status=1
fi
[ $have_lm = 1 ] && run moe_lm_cuda_tests $b/examples/moe_lm/moe_lm_cuda_tests
if [ $have_ext = 1 ]; then
  export PYTHONPATH=$b/python
  run pytest python3 -m pytest -q -p no:cacheprovider -rs python/tests
fi
run gpu_bench $b/bench/cuda/moe_route_gpu_bench
tail -25 "$out/gpu_bench.txt"
if [ $have_ext = 1 ]; then
  for n in 16384 262144; do
    run bench_extension_$n python3 python/bench/bench_extension.py --device cuda --tokens $n
    cat "$out/bench_extension_$n.txt"
  done
fi
run gpu_tests_large_batch $b/tests/cuda/moe_route_gpu_tests -tc="large batch*"
# Last, as it is the slowest: the GPU tests (without the 2^24-token case)
# under compute-sanitizer's four tools; SANITIZE=0 leaves it out. A report of
# any tool fails the check (--error-exitcode).
sanitizer=$(command -v compute-sanitizer || echo "$(dirname "$(command -v nvcc)")/compute-sanitizer")
if [ "${SANITIZE:-1}" = 1 ] && [ -x "$sanitizer" ]; then
  for tool in memcheck racecheck synccheck initcheck; do
    run sanitize_${tool}_gpu_tests "$sanitizer" --tool $tool --error-exitcode 1 \
      $b/tests/cuda/moe_route_gpu_tests -tce="large batch*"
    run sanitize_${tool}_gpu_admission_tests "$sanitizer" --tool $tool --error-exitcode 1 \
      $b/tests/cuda/moe_route_gpu_admission_tests
  done
elif [ "${SANITIZE:-1}" = 1 ]; then
  echo "== compute-sanitizer not found next to nvcc: not run"
  status=1
fi
exit $status
