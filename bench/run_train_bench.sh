#!/bin/sh
# run_train_bench: moerl's LoRA training step against eager PyTorch on the same CPU, with
# the same model (moerl init-model --size small), adapter, batch and thread count; prints
# both results and their ratio.
#
# usage: bench/run_train_bench.sh [BUILD_DIR]
# environment: THREADS (default: all cores), ARCH (qwen3_moe | mixtral, default
# qwen3_moe), DTYPE (weights: f32 | bf16, default f32), STEPS (10), WARMUP (2),
# TOKENS (512), SEQS (4), RANK (16), MOERL_PYTHON (/usr/bin/python3).
set -eu

SRC=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$SRC/build}
THREADS=${THREADS:-$(nproc)}
ARCH=${ARCH:-qwen3_moe}
DTYPE=${DTYPE:-f32}
STEPS=${STEPS:-10}
WARMUP=${WARMUP:-2}
TOKENS=${TOKENS:-512}
SEQS=${SEQS:-4}
RANK=${RANK:-16}
PY=${MOERL_PYTHON:-/usr/bin/python3}

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT INT TERM

"$BUILD/moerl" init-model --arch "$ARCH" --size small --dtype "$DTYPE" --out "$WORK/model"
OMP_NUM_THREADS=$THREADS "$BUILD/bench/bench_train_step" --model "$WORK/model" \
    --threads "$THREADS" --tokens "$TOKENS" --seqs "$SEQS" --rank "$RANK" \
    --steps "$STEPS" --warmup "$WARMUP" --out "$WORK/peer" | tee "$WORK/moerl.txt"
OMP_NUM_THREADS=$THREADS "$PY" "$SRC/bench/train_peer.py" --model "$WORK/model" \
    --adapter "$WORK/peer/adapter" --batch "$WORK/peer/batch.safetensors" \
    --threads "$THREADS" --steps "$STEPS" --warmup "$WARMUP" | tee "$WORK/torch.txt"

field() { # field FILE KEY: the value of KEY= on the RESULT line
    sed -n "s/^RESULT .* $2=\([^ ]*\).*/\1/p" "$1"
}
awk -v c="$(field "$WORK/moerl.txt" tokens_per_s)" -v t="$(field "$WORK/torch.txt" tokens_per_s)" \
    -v cc="$(field "$WORK/moerl.txt" cpu_ms)" -v ct="$(field "$WORK/torch.txt" cpu_ms)" \
    -v lc="$(field "$WORK/moerl.txt" loss0)" -v lt="$(field "$WORK/torch.txt" loss0)" \
    -v th="$THREADS" 'BEGIN {
        d = lc - lt; if (d < 0) d = -d; s = lt < 0 ? -lt : lt
        printf "same step: loss %.9g (moerl) vs %.9g (torch), relative difference %.1e\n", lc, lt, d / s
        printf "ratio: moerl %.0f tokens/s / torch %.0f tokens/s = %.2fx on %d threads\n", c, t, c / t, th
        printf "ratio of CPU time per step: torch %.0f ms / moerl %.0f ms = %.2fx\n", ct, cc, ct / cc
    }'
