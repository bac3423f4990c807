#!/usr/bin/env bash
# Builds the libFuzzer targets of the wire-protocol decoders with clang
# (ASan + UBSan) in build/fuzz, then runs each for a bounded time on a copy
# of its seed corpus (fuzz/corpus/<target>). Fails on any crash, sanitizer
# report, leak, timeout or out-of-memory; the input that caused it is kept
# in build/fuzz/run/<target>/artifacts/.
#
#   bash scripts/fuzz.sh            # 20 s per target
#   bash scripts/fuzz.sh 300        # 5 minutes per target
#   FUZZ_TARGETS="weights" bash scripts/fuzz.sh 60
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-${FUZZ_SECONDS:-20}}"
targets=(${FUZZ_TARGETS:-control work trajectory weights})
build=build/fuzz
jobs=$(nproc)

CC=clang cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Debug -DMOERL_FUZZ=ON -DMOERL_CUDA=OFF \
  -DMOERL_ASAN=OFF >/dev/null
cmake --build "$build" -j"$jobs" --target fuzz_all

run="$build/run"
rm -rf "$run"
failed=()
for t in "${targets[@]}"; do
  exe="$build/fuzz/fuzz_$t"
  dir="$run/$t"
  mkdir -p "$dir/corpus" "$dir/artifacts"
  cp fuzz/corpus/"$t"/* "$dir/corpus/"
  echo "=== fuzz_$t: ${seconds}s on $(ls "$dir/corpus" | wc -l) seeds ==="
  if ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
     "$exe" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
       -print_final_stats=1 -artifact_prefix="$dir/artifacts/" "$dir/corpus" >"$dir/log" 2>&1; then
    grep -E "^stat::(number_of_executed_units|peak_rss_mb)" "$dir/log" || true
  else
    echo "fuzz_$t FAILED (log: $dir/log):"
    tail -n 40 "$dir/log"
    failed+=("$t")
  fi
done

if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzzing failed: ${failed[*]}"
  exit 1
fi
echo "=== all fuzz targets ran ${seconds}s each without a finding ==="
