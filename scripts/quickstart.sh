#!/usr/bin/env bash
# The quickstart. Today it installs the dependencies, builds the optimised
# moerl and validates the example job config; the RL job itself is not
# available yet (see README.md, feature status).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release -DMOERL_CUDA=AUTO
cmake --build build/release -j"$(nproc)"

./build/release/moerl config check configs/grpo-tiny.yaml
./build/release/moerl config dump configs/grpo-tiny.yaml
