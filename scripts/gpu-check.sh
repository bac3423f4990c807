#!/usr/bin/env bash
# Checks the CUDA backend on a machine with an NVIDIA GPU: builds the optimised
# build with CUDA, runs the GPU suites (ctest label "gpu": the kernel parity
# test against the CPU backend, the model, the learner, the rollout engine,
# NCCL), then the GPU kernel benchmark and the rollout engine's generation
# benchmark on the GPU, and prints a short summary table last. Sized for a few
# minutes on one H200.
#
#   scripts/gpu-check.sh             build in $BUILD_DIR, ctest -L gpu, benchmark
#   scripts/gpu-check.sh --pack DIR  build here (no GPU needed), then copy the GPU
#                                    test and benchmark executables into DIR/bin
#                                    and the shared libraries they need, except
#                                    the CUDA ones and the C/C++ runtime, into
#                                    DIR/lib: for a GPU machine that has the CUDA
#                                    Toolkit but not moerl's build dependencies
#   scripts/gpu-check.sh --run DIR   on that GPU machine: run what --pack put in
#                                    DIR (each test, 77 = skipped; the benchmark)
#   DIR may also name an archive, DIR.tar.xz: --pack then writes the bundle
#   into it (about 8 MB instead of about 60), and --run unpacks it first.
#
# Environment: BUILD_DIR (default build/gpu), JOBS (default: all cores),
# LOG_DIR (optional: each step's full log is copied there).
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD_DIR:-$root/build/gpu}
jobs=${JOBS:-$(nproc)}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
summary=()

note() { summary+=("$(printf '%-28s %s' "$1" "$2")"); }

save_logs() {
    if [[ -n "${LOG_DIR:-}" ]]; then
        mkdir -p "$LOG_DIR" || return 0
        cp "$logs"/*.log "$LOG_DIR"/ 2>/dev/null || true
    fi
}

print_summary() {
    echo
    echo "=== gpu-check summary ==="
    printf '%s\n' "${summary[@]}"
}

# The GPU test executables (tests/gpu_*.c) and the benchmark.
gpu_targets() {
    for f in "$root"/tests/gpu_*.c; do basename "$f" .c; done
    echo bench_gpu_kernels bench_generate
}

build_gpu() {
    echo "=== configure and build ($build) ==="
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DMOERL_CUDA=ON || return 1
    # shellcheck disable=SC2046
    cmake --build "$build" -j"$jobs" --target $(gpu_targets) || return 1
}

# Runs the benchmark (77: no device, skipped); its table is its last output.
run_bench() {
    local exe=$1
    echo "=== benchmark ==="
    "$exe" 2>&1 | tee "$logs/bench_gpu_kernels.log"
    local rc=${PIPESTATUS[0]}
    case $rc in
    0) note bench_gpu_kernels "ran (table above)" ;;
    77) note bench_gpu_kernels "skipped (no CUDA device)" ;;
    *) note bench_gpu_kernels "FAILED (exit $rc)" ;;
    esac
    [[ $rc == 0 || $rc == 77 ]]
}

# The rollout engine on the GPU (bench_generate --device cuda, a small Qwen3-MoE in bf16):
# tokens/s of 64 prompts x 8 samples batched and of single sequences, without an adapter
# and with a rank-16 LoRA adapter on attention and experts (as a rollout runs the policy),
# then that adapter with the decode steps replayed as CUDA graphs (rollout.cuda_graphs).
run_engine_bench() {
    local exe=$1 failed=0 run rank graphs log what rc
    for run in 0 16 16g; do
        rank=${run%g}
        graphs=()
        [[ $run == *g ]] && graphs=(--cuda-graphs)
        log="$logs/bench_generate_r$run.log"
        what="engine (cuda)"
        [[ $rank == 0 ]] || what="engine, LoRA r$rank (cuda)"
        [[ $run == *g ]] && what="engine, LoRA r$rank, graphs"
        echo "=== rollout engine on the GPU, adapter rank $rank${graphs:+ ${graphs[*]}} ==="
        "$exe" --device cuda --prompts 64 -n 8 --prompt-len 32 --max-tokens 64 --single 2 \
            --adapter-rank "$rank" "${graphs[@]}" 2>&1 | tee "$log"
        rc=${PIPESTATUS[0]}
        if [[ $rc == 0 ]]; then
            note "$what batched" "$(awk '/^moerl batched/ {print $4 " tokens/s"}' "$log")"
            note "$what single" "$(awk '/^moerl single/ {print $4 " tokens/s"}' "$log")"
            [[ $run == *g ]] && note "graphs replayed" "$(sed -n 's/^cuda graphs: //p' "$log")"
        else
            note "bench_generate r$run" "FAILED (exit $rc)"
            failed=1
        fi
    done
    [[ $failed == 0 ]]
}

mode_build_and_check() {
    local failed=0
    if ! build_gpu 2>&1 | tee "$logs/build.log"; then
        echo "gpu-check: the build failed (log above)." >&2
        echo "gpu-check: on a GPU machine without moerl's dependencies, build elsewhere with" >&2
        echo "gpu-check: '$0 --pack DIR' and run '$0 --run DIR' here." >&2
        save_logs
        return 1
    fi
    echo "=== ctest -L gpu ==="
    ctest --test-dir "$build" -L gpu --output-on-failure 2>&1 | tee "$logs/ctest.log"
    local rc=${PIPESTATUS[0]}
    note "ctest -L gpu" "$(grep -E 'tests passed|tests failed' "$logs/ctest.log" | tail -1)"
    grep -q "Not Run\|\*\*\*Skipped" "$logs/ctest.log" &&
        note "" "(some GPU tests were skipped: see the log)"
    [[ $rc == 0 ]] || failed=1
    run_bench "$build/bench/bench_gpu_kernels" || failed=1
    run_engine_bench "$build/bench/bench_generate" || failed=1
    save_logs
    print_summary
    return $failed
}

# Libraries the packed executables may take from the GPU machine itself.
skip_lib() {
    [[ $1 =~ ^(libc|libm|libdl|libpthread|librt|libresolv|libutil|ld-linux.*|libstdc\+\+|libgcc_s)\.so ]] ||
        [[ $1 =~ ^lib(cuda|cudart|cublas|cublasLt|nccl|nvidia|nvrtc|nvJitLink)[.-] ]]
}

# --pack into an archive: the bundle in a temporary folder, then xz-compressed.
mode_pack_archive() {
    local archive=$1 tmp
    tmp=$(mktemp -d) || return 1
    mode_pack "$tmp/gpu-pack" &&
        tar -cJf "$archive" -C "$tmp" gpu-pack &&
        echo "archived into $archive ($(du -h "$archive" | cut -f1))"
    local rc=$?
    rm -rf "$tmp"
    return $rc
}

# --run from an archive: unpacked into a temporary folder.
mode_run_archive() {
    local archive=$1 tmp
    tmp=$(mktemp -d) || return 1
    tar -xJf "$archive" -C "$tmp" || { rm -rf "$tmp"; return 1; }
    mode_run "$tmp/gpu-pack"
    local rc=$?
    rm -rf "$tmp"
    return $rc
}

mode_pack() {
    local dir=$1
    build_gpu || return 1
    mkdir -p "$dir/bin" "$dir/lib" || return 1
    local t exe lib
    for t in $(gpu_targets); do
        exe=$(find "$build" -type f -name "$t" -perm -u+x | head -1)
        [[ -n "$exe" ]] || { echo "gpu-check: $t was not built" >&2; return 1; }
        cp "$exe" "$dir/bin/"
        for lib in $(ldd "$exe" | awk '/=>/ && $3 ~ /^\// {print $3}'); do
            skip_lib "$(basename "$lib")" || cp -L "$lib" "$dir/lib/"
        done
    done
    echo "packed into $dir/bin:" "$(cd "$dir/bin" && echo *)"
    echo "($(du -sh "$dir" | cut -f1); CUDA, NCCL and the C/C++ runtime come from the GPU machine)"
}

# CUDA library folders on a GPU machine: the toolkit's, then those of Python's
# nvidia-* wheels (which carry NCCL when the toolkit does not).
cuda_lib_path() {
    local dirs=() d
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/lib; do
        [[ -d $d ]] && dirs+=("$d")
    done
    while IFS= read -r d; do [[ -n $d ]] && dirs+=("$d"); done < <(python3 - 2>/dev/null <<'EOF'
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
for r in roots:
    for pat in ("nvidia/*/lib", "nvidia/*/*/lib"):
        for d in sorted(glob.glob(os.path.join(r, pat))):
            print(d)
EOF
)
    local IFS=:
    echo "${dirs[*]}"
}

mode_run() {
    local dir
    dir=$(cd "$1" && pwd) || return 1
    local cuda_libs
    cuda_libs=$(cuda_lib_path)
    export LD_LIBRARY_PATH="$dir/lib:$cuda_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
        sed 's/^/gpu: /'
    local failed=0 exe name missing rc
    for exe in "$dir"/bin/*; do
        missing=$(ldd "$exe" | grep "not found" | awk '{print $1}' | tr '\n' ' ')
        if [[ -n $missing ]]; then
            echo "gpu-check: $(basename "$exe") lacks libraries: $missing" >&2
            failed=1
        fi
    done
    for exe in "$dir"/bin/gpu_*; do
        name=$(basename "$exe")
        echo "=== $name ==="
        "$exe" 2>&1 | tee "$logs/$name.log"
        rc=${PIPESTATUS[0]}
        case $rc in
        0) note "$name" "passed" ;;
        77) note "$name" "skipped: $(tail -1 "$logs/$name.log")" ;;
        *) note "$name" "FAILED (exit $rc)"; failed=1 ;;
        esac
    done
    run_bench "$dir/bin/bench_gpu_kernels" || failed=1
    run_engine_bench "$dir/bin/bench_generate" || failed=1
    save_logs
    print_summary
    return $failed
}

case "${1:-}" in
"") mode_build_and_check ;;
--pack)
    [[ $# == 2 ]] || { echo "usage: $0 --pack DIR|DIR.tar.xz" >&2; exit 2; }
    if [[ $2 == *.tar.xz ]]; then mode_pack_archive "$2"; else mode_pack "$2"; fi ;;
--run)
    [[ $# == 2 ]] || { echo "usage: $0 --run DIR|DIR.tar.xz" >&2; exit 2; }
    if [[ $2 == *.tar.xz ]]; then mode_run_archive "$2"; else mode_run "$2"; fi ;;
-h | --help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//' ;;
*) echo "usage: $0 [--pack DIR|DIR.tar.xz | --run DIR|DIR.tar.xz]" >&2; exit 2 ;;
esac
