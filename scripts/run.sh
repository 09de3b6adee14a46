#!/usr/bin/env bash
# The main job: install dependencies, build, and route a batch with several
# model presets on every available backend, printing a short report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/env.sh
cmake --preset default
cmake --build --preset default --target route_report
./build/default/examples/route_report "$@"
