#!/usr/bin/env bash
# Runs the fuzz targets (tests/fuzz, docs/reliability.md) under libFuzzer with
# ASan + UBSan: builds them in the sanitize preset (clang), then fuzzes each target named
# (default: all) for SECONDS each, starting from its committed corpus. New
# inputs go to build/sanitize/corpus/<target>; crashes to build/sanitize/findings/.
#   bash scripts/fuzz.sh [SECONDS] [TARGET...]        e.g. bash scripts/fuzz.sh 600 route
# With MERGE=1 the committed corpus's generated inputs (named by their SHA-1)
# are replaced by a small set, of them and the new ones, that reaches every
# edge they reach (libFuzzer -set_cover_merge=1 over edges, not hit counts:
# about 150 inputs rather than 1500, so CI replays it in seconds); named
# inputs (seeds, regression_*) stay. The full corpus stays in build/sanitize/corpus.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(route config npy cli training expert_choice moe_lm_command_line moe_lm_data ep_driver)
bash scripts/setup.sh --fuzz
cmake --preset sanitize >/dev/null
cmake --build --preset sanitize --target "${targets[@]/#/moe_route_fuzz_}"
mkdir -p build/sanitize/findings
# Absolute paths: the cli and driver targets work inside a private directory.
root=$PWD
for t in "${targets[@]}"; do
  corpus=$root/tests/fuzz/corpus/$t work=$root/build/sanitize/corpus/$t
  mkdir -p "$work"
  options=(-max_total_time="$seconds" -max_len=4096 -malloc_limit_mb=512 -print_final_stats=1
           -artifact_prefix="$root/build/sanitize/findings/$t-")
  [[ -f tests/fuzz/$t.dict ]] && options+=(-dict="$root/tests/fuzz/$t.dict")
  echo "fuzz: $t for $seconds s"
  "build/sanitize/tests/fuzz/moe_route_fuzz_$t" "${options[@]}" "$work" "$corpus" 2>&1 |
    grep -E "^(#[0-9]+ *DONE|stat::number_of_executed_units|stat::peak_rss_mb|fuzz finding|SUMMARY|==[0-9]+==ERROR)" || true
  if [[ "${MERGE:-0}" == 1 ]]; then
    merged=$(mktemp -d)
    "build/sanitize/tests/fuzz/moe_route_fuzz_$t" -set_cover_merge=1 -use_counters=0 -max_len=4096 "$merged" "$corpus" "$work" \
      2>/dev/null
    find "$corpus" -type f -regextype egrep -regex '.*/[0-9a-f]{40}' -delete
    named=$(find "$corpus" -type f -exec sha1sum {} + | cut -d' ' -f1)
    for f in "$merged"/*; do
      grep -qx "$(basename "$f")" <<<"$named" || cp "$f" "$corpus"/
    done
    rm -rf "$merged"
    echo "fuzz: $t corpus merged to $(ls "$corpus" | wc -l) inputs"
  fi
done
