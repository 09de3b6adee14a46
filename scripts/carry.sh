#!/usr/bin/env bash
# Copies what the gpu preset needs and the device machine cannot install
# (doctest's headers and CMake package, Google Benchmark's headers, libraries
# and CMake package, nlohmann-json's headers and CMake package for moe_lm's
# core and CUDA test) from this Debian machine into .carry/prefix, the
# git-ignored folder the gpu preset searches (docs/gpu.md). Give it to the
# device tool as `carry: [".carry"]`, then run scripts/gpu_check.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
p=.carry/prefix
rm -rf .carry
mkdir -p $p/include $p/lib/cmake $p/lib/x86_64-linux-gnu/cmake $p/share/cmake
cp -r /usr/include/doctest /usr/include/benchmark /usr/include/nlohmann $p/include/
cp -r /usr/share/cmake/nlohmann_json $p/share/cmake/
cp -r /usr/lib/cmake/doctest $p/lib/cmake/
cp -r /usr/lib/x86_64-linux-gnu/cmake/benchmark $p/lib/x86_64-linux-gnu/cmake/
cp -P /usr/lib/x86_64-linux-gnu/libbenchmark*.so* /usr/lib/x86_64-linux-gnu/libbenchmark_main.a $p/lib/x86_64-linux-gnu/
du -sh .carry
