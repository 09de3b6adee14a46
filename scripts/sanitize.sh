#!/usr/bin/env bash
# The sanitizer stage of the test command (docs/reliability.md, "Sanitizers in
# the test command"): the fuzz targets' committed corpus, which reaches every
# CPU entry point (route, backward, admission, dispatch, expert choice, the
# training step with every penalty and prior, the configuration parsers, the
# .npy reader, the CLI), replayed under ASan + UBSan (the fuzz preset) and
# under ThreadSanitizer (the tsan preset): its threaded cases split routing,
# the backward, admission, expert choice and the penalties' cross-token sums
# over 2 and 3 threads. Then the doctest CPU suite under ThreadSanitizer (the
# tsan-suite preset): every thread-count invariance case and the worker pool's
# own tests. The presets build with clang, which --fuzz installs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --fuzz
for preset in fuzz tsan tsan-suite; do
  start=$SECONDS
  cmake --preset "$preset" >/dev/null
  cmake --build --preset "$preset"
  ctest --preset "$preset"
  echo "sanitize: $preset preset built and replayed in $((SECONDS - start)) s"
done
