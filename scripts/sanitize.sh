#!/usr/bin/env bash
# The sanitizer stage of the test command (docs/reliability.md, "Sanitizers in
# the test command"): the fuzz targets' committed corpus, which reaches every
# CPU entry point (route, backward, admission, dispatch, expert choice, the
# training step with every penalty and prior, the configuration parsers, the
# .npy reader, the CLI, the drivers' inputs), replayed under ASan + UBSan (the
# fuzz preset); then, in one ThreadSanitizer build (the tsan-suite preset),
# the doctest CPU suite (every thread-count invariance case, the worker
# pool's own tests) and the threaded corpora (route, training, expert choice:
# routing, the backward, admission, expert choice and the penalties'
# cross-token sums split over 2 and 3 threads). The presets build with clang,
# which --fuzz installs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --fuzz
for preset in fuzz tsan-suite; do
  start=$SECONDS
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset"
  ctest --preset "$preset"
  echo "sanitize: $preset preset built and run in $((SECONDS - start)) s"
done
