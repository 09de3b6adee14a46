#!/usr/bin/env bash
# The sanitizer stage of the test command (docs/reliability.md, "Sanitizers").
# The sanitize preset: the CPU suite (the doctest suite, analysis, the
# moe-route CLI and its tests) and the fuzz targets' committed corpus, which
# reaches every CPU entry point and the drivers' inputs, under ASan + UBSan.
# Then the tsan preset: the cases that run the backend on several threads (the
# worker pool, thread-count invariance of routing, the backward, the prior
# builder, expert choice and dispatch) and the threaded corpora (route,
# training, expert choice), under ThreadSanitizer. Both build with clang,
# which --fuzz installs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --fuzz
for preset in sanitize tsan; do
  start=$SECONDS
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset"
  ctest --preset "$preset"
  echo "sanitize: $preset preset built and run in $((SECONDS - start)) s"
done
