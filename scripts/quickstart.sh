#!/usr/bin/env bash
# The quickstart: RL post-training of a tiny mixture-of-experts model on this
# machine's CPUs. docs/quickstart.md explains each step and the numbers to expect.
#
#   1. installs the Debian packages and builds the optimised moerl;
#   2. makes the base model once (cached in models/quickstart-base): a random
#      tiny Qwen3-MoE (moerl init-model) given a short supervised warm start on
#      the built-in arithmetic task (moerl sft --full, one thread: faster than
#      two for a model this small);
#   3. runs the RL job (moerl run configs/quickstart.yaml, 2500 steps): the
#      learner, 2 rollout workers and a reward worker as separate processes,
#      GRPO with LoRA on the attention and expert projections;
#   4. prints reward mean and held-out greedy accuracy by step, the accuracy
#      before and after RL, and writes runs/quickstart/report.svg.
#
# Environment: QUICKSTART_SFT_STEPS (warm-start updates, default 2500) and
# QUICKSTART_RL_STEPS (learner steps, default: configs/quickstart.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."

start=$(date +%s)
bash scripts/install-deps.sh
cmake -S . -B build/release -DCMAKE_BUILD_TYPE=Release -DMOERL_CUDA=AUTO
cmake --build build/release -j"$(nproc)"
moerl=./build/release/moerl
config=configs/quickstart.yaml
base=models/quickstart-base
sft_steps=${QUICKSTART_SFT_STEPS:-2500}

# The cached base is reused only when it was made by this recipe: the task's
# problem stream and the warm start both shape it.
recipe="init qwen3_moe tiny seed 1; sft --full --steps $sft_steps --lr 4e-3 --logit-scale 16;"
recipe+=" task arith, operands uniform"
if [ -f "$base/model.safetensors" ] && [ "$(cat "$base/recipe.txt" 2>/dev/null)" = "$recipe" ]; then
  echo "quickstart: base model $base is already there (delete it to make it again)"
else
  if [ -d "$base" ]; then
    echo "quickstart: $base was made by another recipe; making it again"
  fi
  echo "quickstart: making the base model $base ($sft_steps warm-start updates)"
  mkdir -p models
  "$moerl" init-model --arch qwen3_moe --size tiny --seed 1 --out models/quickstart-init
  rm -rf "$base.tmp"
  "$moerl" sft "$config" --set model.path=models/quickstart-init --set run.threads=1 \
    --full --steps "$sft_steps" --lr 4e-3 --logit-scale 16 --eval-every 500 --out "$base.tmp"
  printf '%s\n' "$recipe" >"$base.tmp/recipe.txt"
  rm -rf "$base"
  mv "$base.tmp" "$base"
fi

rl_sets=()
if [ -n "${QUICKSTART_RL_STEPS:-}" ]; then
  rl_sets=(--set "learner.steps=$QUICKSTART_RL_STEPS")
fi
rm -rf runs/quickstart
rl_start=$(date +%s)
"$moerl" run "$config" "${rl_sets[@]}"
rl_end=$(date +%s)

echo
echo "quickstart: reward mean and held-out greedy accuracy by step"
"$moerl" report runs/quickstart
end=$(date +%s)
echo
echo "quickstart: RL job $((rl_end - rl_start)) s, everything $((end - start)) s" \
  "(base model cached in $base; logs, metrics, checkpoints and report.svg in runs/quickstart)"
