#!/usr/bin/env bash
# The device loader on an NVIDIA GPU: builds here, runs on the GPU machine.
#
#   tensor-store/scripts/gpu-load-bench.sh build
#       On the build machine: builds xtask and the tensor-store test binary for NVIDIA
#       (HIP_PLATFORM=nvidia, static CUDA runtime) and puts them, stripped, with a
#       tokenizer-only GGUF (synthetic models need SmolLM2's tokenizer metadata, and the
#       GPU machine has no models cache) in target-gpu-load/bin, a folder git ignores.
#       Carry that folder to the GPU machine.
#
#   tensor-store/scripts/gpu-load-bench.sh run
#       On the GPU machine, from the repository root: runs the tensor-store tests (the GPU
#       ones included), generates the 7B synthetic model, and runs bench-load warm and cold
#       (eager, background, lazy), a read-back check, and a sweep of reader count and
#       staging sizes. Logs and JSON go to $OUT (default ./gpu-load-out).
#
# Variables (optional): MODEL_DIR (where the 7B model is written, default /tmp),
# PRESET (default 7b-q4k), REPEAT (warm repetitions, default 3), SWEEP=0 (skip the sweep).
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=target-gpu-load/bin

build() {
    GPU_TOOLCHAINS=nvidia source .ci/gpu-toolchains.sh
    export HIP_PLATFORM=nvidia CARGO_TARGET_DIR="$PWD/target-gpu-load/cargo"
    cargo build --release -p xtask
    local tests
    tests="$(cargo test --release -p tensor-store --test store --no-run --message-format=json \
        | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n1)"
    [ -n "$tests" ] || { echo "no test executable found" >&2; exit 1; }
    mkdir -p "$bin"
    strip -o "$bin/xtask" "$CARGO_TARGET_DIR/release/xtask"
    strip -o "$bin/tensor-store-tests" "$tests"
    "$CARGO_TARGET_DIR/release/xtask" synth-model --tokenizer-only --out "$bin/tokenizer.gguf"
    du -sh "$bin"
    echo "carry: $bin"
}

run() {
    local out="${OUT:-$PWD/gpu-load-out}" dir="${MODEL_DIR:-/tmp}" preset="${PRESET:-7b-q4k}"
    local repeat="${REPEAT:-3}"
    local model="$dir/rocmforge-$preset.gguf"
    mkdir -p "$out"
    exec > >(tee "$out/summary.log") 2>&1
    echo "== machine"; nproc; free -g; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    echo "== tensor-store tests (GPU tests included)"
    "$bin/tensor-store-tests" --test-threads 1 2>&1 | tee "$out/tests.log" | grep -E "SKIPPED|test result|FAILED|panicked" || true
    echo "== synth-model $preset"
    "$bin/xtask" synth-model --preset "$preset" --out "$model" --tokenizer-from "$bin/tokenizer.gguf"
    local bench=("$bin/xtask" bench-load --gguf "$model" --device gpu)
    echo "== warm, every mode, $repeat times"
    "${bench[@]}" --mode all --repeat "$repeat" --json "$out/warm.json"
    echo "== warm, read back and compare every tensor"
    "${bench[@]}" --mode background --verify --json "$out/verify.json"
    echo "== cold (page cache dropped before each run)"
    "${bench[@]}" --mode all --cold --json "$out/cold.json"
    echo "== cold, direct reads"
    "${bench[@]}" --mode all --cold --direct --json "$out/cold-direct.json"
    if [ "${SWEEP:-1}" != 0 ]; then
        echo "== sweep: readers x staging buffers x chunk MiB (warm, eager)"
        for readers in 4 8 12; do
            for chunk in 4 8 16 32 64; do
                for staging in 4 8 16; do
                    # Host memory of the ring stays at or under 512 MiB.
                    [ $((chunk * staging)) -le 512 ] || continue
                    "${bench[@]}" --mode eager --readers "$readers" --staging "$staging" \
                        --chunk-mib "$chunk" --json "$out/sweep-r$readers-s$staging-c$chunk.json" \
                        | tail -n1 | sed "s/^/r=$readers s=$staging c=$chunk: /"
                done
            done
        done
    fi
    echo "== done: logs and JSON in $out"
}

case "${1:-}" in
    build) build ;;
    run) run ;;
    *) echo "usage: $0 build|run" >&2; exit 2 ;;
esac
