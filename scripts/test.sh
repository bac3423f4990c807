#!/usr/bin/env bash
# Installs the dependencies, then builds moerl twice -- optimised (with the
# CUDA sources when nvcc is present) and Debug with ASan+UBSan -- and runs the
# whole ctest suite on both, then runs every wire-protocol fuzz target for a
# bounded time. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh

jobs=$(nproc)
# A failing test is run once more before it fails the run: the multi-process
# integration tests start real daemons and can lose a race on a loaded machine
# (ctest prints every failed attempt).

echo "=== optimised build (build/release) ==="
cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release -DMOERL_CUDA=AUTO
cmake --build build/release -j"$jobs"
ctest --test-dir build/release --output-on-failure -j"$jobs" --repeat until-pass:2

echo "=== ASan+UBSan build (build/asan) ==="
cmake -S . -B build/asan -DCMAKE_BUILD_TYPE=Debug -DMOERL_ASAN=ON -DMOERL_CUDA=OFF
cmake --build build/asan -j"$jobs"
ctest --test-dir build/asan --output-on-failure -j"$jobs" --repeat until-pass:2

echo "=== fuzzing the wire-protocol decoders (clang, libFuzzer) ==="
bash scripts/fuzz.sh "${FUZZ_SECONDS:-20}"

echo "=== all tests passed in both builds; fuzz targets clean ==="
