#!/usr/bin/env bash
# GPU generation on an NVIDIA GPU: builds here (no GPU needed), runs on the GPU machine.
#
#   model/scripts/gpu-generate-suite.sh build [DEST]
#       Builds for NVIDIA (HIP_PLATFORM=nvidia, static CUDA runtime) the `rocmforge`
#       binary, xtask, and the test binaries with GPU tests (dequant's products, model's
#       synthetic models on the GPU against the CPU), strips them into DEST (default
#       target-gpu-gen/bin, which git ignores) with a tokenizer-only GGUF for the
#       synthetic models (made from SmolLM2's metadata, which must be fetched here).
#
#   model/scripts/gpu-generate-suite.sh run [DEST]
#       On the GPU machine, from the repository root: the GPU tests, then the 135M- and
#       7B-shaped synthetic models generated there, greedy text on the GPU against the
#       CPU on each, and `xtask bench-gpu` (beside llama.cpp's llama-bench when
#       LLAMA_BENCH names it). Logs go to $OUT (default ./gpu-gen-out).
#
#   model/scripts/gpu-generate-suite.sh products [DEST]
#       On the GPU machine: the products alone (dequant's gpu_decode bench, --products):
#       each weight type on a 7B Llama's shapes. Logs to $OUT.
#
#   model/scripts/gpu-generate-suite.sh profile [DEST]
#       On the GPU machine, after `run` (which made the models): the device time of each
#       kernel over about one decode step of each model, with Nsight Compute (`ncu`),
#       summed per kernel with its DRAM bandwidth. CSVs go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
bin="${2:-target-gpu-gen/bin}"

build() {
    GPU_TOOLCHAINS=nvidia source .ci/gpu-toolchains.sh
    export HIP_PLATFORM=nvidia CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target/gpu-nvidia}"
    cargo build --release -p rocmforge -p xtask
    local artifacts
    artifacts="$(mktemp)"
    cargo test --release -p dequant --lib --no-run --message-format=json > "$artifacts"
    cargo test --release -p model --test real_models --no-run --message-format=json >> "$artifacts"
    cargo bench -p dequant --bench gpu_decode --no-run --message-format=json >> "$artifacts"
    mkdir -p "$bin"
    strip -o "$bin/rocmforge" "$CARGO_TARGET_DIR/release/rocmforge"
    strip -o "$bin/xtask" "$CARGO_TARGET_DIR/release/xtask"
    local dequant_tests model_tests bench_products
    dequant_tests="$(grep -o '"executable":"[^"]*dequant-[^"]*"' "$artifacts" | tail -n1 | cut -d'"' -f4)"
    model_tests="$(grep -o '"executable":"[^"]*real_models-[^"]*"' "$artifacts" | tail -n1 | cut -d'"' -f4)"
    bench_products="$(grep -o '"executable":"[^"]*gpu_decode-[^"]*"' "$artifacts" | tail -n1 | cut -d'"' -f4)"
    rm -f "$artifacts"
    [ -n "$dequant_tests" ] && [ -n "$model_tests" ] && [ -n "$bench_products" ] || { echo "test executables not found" >&2; exit 1; }
    strip -o "$bin/test-dequant" "$dequant_tests"
    strip -o "$bin/test-model" "$model_tests"
    strip -o "$bin/bench-gpu-decode" "$bench_products"
    "$CARGO_TARGET_DIR/release/xtask" synth-model --tokenizer-only --out "$bin/tokenizer.gguf"
    du -sh "$bin"/*
}

run() {
    local out="${OUT:-$PWD/gpu-gen-out}" dir=/tmp/rocmforge-models
    mkdir -p "$out" "$dir"
    exec > >(tee "$out/summary.log") 2>&1
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv || true
    echo "== GPU tests: dequant products"
    timeout 180 "$bin/test-dequant" gpu:: --test-threads 1 2>&1 | tee "$out/test-dequant.log" | grep -E "SKIPPED|test result|FAILED|panicked|error" || true
    echo "== GPU tests: model on the GPU against the CPU"
    timeout 240 "$bin/test-model" gpu --test-threads 1 --nocapture 2>&1 | tee "$out/test-model.log" | grep -E "^gpu |SKIPPED|test result|FAILED|panicked" || true
    echo "== synthetic models"
    "$bin/xtask" synth-model --preset 135m-q4_1 --out "$dir/135m-q4_1.gguf" --tokenizer-from "$bin/tokenizer.gguf"
    "$bin/xtask" synth-model --preset 7b-q4k --out "$dir/7b-q4k.gguf" --tokenizer-from "$bin/tokenizer.gguf"
    for m in 135m-q4_1 7b-q4k; do
        echo "== generate on $m: GPU against CPU, greedy, 32 tokens"
        for d in gpu cpu; do
            timeout 120 "$bin/rocmforge" generate -m "$dir/$m.gguf" -p "The capital of France is" -n 32 \
                --temperature 0 --device $d --json > "$dir/gen-$m-$d.json" || echo "generate $d failed"
        done
        python3 - "$dir/gen-$m-gpu.json" "$dir/gen-$m-cpu.json" <<'PY'
import json, sys
g, c = (json.load(open(p)) for p in sys.argv[1:3])
same = next((i for i, (a, b) in enumerate(zip(g["tokens"], c["tokens"])) if a != b), min(len(g["tokens"]), len(c["tokens"])))
print(f"tokens identical: {same}/{len(c['tokens'])}; gpu timings {g['timings']}")
PY
    done
    echo "== products"
    products
    echo "== bench-gpu"
    local llama=()
    [ -n "${LLAMA_BENCH:-}" ] && llama=(--llama-bench "$LLAMA_BENCH")
    timeout 240 "$bin/xtask" bench-gpu --gguf "$dir/135m-q4_1.gguf" --gguf "$dir/7b-q4k.gguf" "${llama[@]}" \
        --json "$out/bench-gpu.json"
}

products() {
    local out="${OUT:-$PWD/gpu-gen-out}"
    mkdir -p "$out"
    timeout 300 "$bin/bench-gpu-decode" --products --iters 20 --json "$out/gpu-products.json" \
        2>&1 | grep -v '^{' | tee "$out/gpu-products.log"
}

profile() {
    local out="${OUT:-$PWD/gpu-gen-out}" dir=/tmp/rocmforge-models
    mkdir -p "$out"
    # Skip the prompt and the first tokens; then about one token's kernels (11 a layer).
    for m in 7b-q4k:360 135m-q4_1:340; do
        local name="${m%%:*}" count="${m##*:}"
        ncu --graph-profiling node --launch-skip 800 --launch-count "$count" \
            --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
            "$bin/rocmforge" generate -m "$dir/$name.gguf" -p "Hello world" -n 8 \
            --temperature 0 --device gpu --load-mode eager > "$out/ncu-$name.csv" 2>/dev/null
        python3 - "$out/ncu-$name.csv" <<'PY'
import collections, csv, sys
scale = {"nsecond": 1, "usecond": 1e3, "msecond": 1e6, "byte": 1, "Kbyte": 1e3,
         "Mbyte": 1e6, "Gbyte": 1e9}
rows = csv.DictReader(l for l in open(sys.argv[1]) if l.startswith('"'))
per = collections.defaultdict(lambda: [0, 0.0, 0.0])
for r in rows:
    name = r["Kernel Name"].split("(")[0].split("<")[0]
    value = float(r["Metric Value"].replace(",", "")) * scale.get(r["Metric Unit"], 1)
    if r["Metric Name"] == "gpu__time_duration.sum":
        per[name][0] += 1
        per[name][1] += value
    else:
        per[name][2] += value
total = sum(v[1] for v in per.values())
print(f"{sys.argv[1]}: {total / 1e3:.0f} us of kernels")
for name, (n, ns, b) in sorted(per.items(), key=lambda kv: -kv[1][1]):
    print(f"  {name:40s} {n:4d} launches {ns / 1e3:8.1f} us {100 * ns / total:5.1f}%  {b / ns:7.0f} GB/s")
PY
    done
}

case "${1:-}" in
    build) build ;;
    run) run ;;
    products) products ;;
    profile) profile ;;
    *) echo "usage: $0 build|run|products|profile [DEST]" >&2; exit 2 ;;
esac
