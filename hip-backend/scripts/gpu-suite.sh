#!/usr/bin/env bash
# Runs prebuilt GPU test binaries, benchmarks and examples on a machine with a GPU (no Rust
# toolchain needed) and writes one log per binary plus a summary.
#
# Usage: gpu-suite.sh BIN_DIR OUT_DIR
#   BIN_DIR holds executables named by collect-gpu-binaries.sh:
#     test-*      libtest binaries, run with --test-threads=1 --nocapture
#     bench-*     benchmark binaries, run with --bench
#     example-*   programs, run as they are
#   A file NAME.args beside a binary adds arguments; {OUT} in it becomes OUT_DIR.
#   OUT_DIR receives machine.txt (GPU and driver), NAME.log for each binary, summary.txt.
#
# Environment (optional):
#   GPU_SUITE_TIMEOUT         seconds allowed per binary (default 300)
#   GPU_SUITE_ALLOW_SKIPS=1   do not fail when a test prints SKIPPED (by default a skip
#                             fails the suite: on a GPU machine it means no device was found)
# Exits non-zero when any binary fails, times out, or (by default) skips.
set -uo pipefail

if [ $# -ne 2 ]; then
    echo "usage: $0 BIN_DIR OUT_DIR" >&2
    exit 2
fi
bin_dir="$1"
out="$2"
mkdir -p "$out"
timeout_s="${GPU_SUITE_TIMEOUT:-300}"

{
    date -u
    uname -a
    if command -v nvidia-smi >/dev/null; then nvidia-smi; fi
    if command -v rocm-smi >/dev/null; then rocm-smi; fi
} > "$out/machine.txt" 2>&1

status=0
printf '%-56s %5s %9s %8s\n' binary rc seconds skipped > "$out/summary.txt"
shopt -s nullglob
for bin in "$bin_dir"/test-* "$bin_dir"/bench-* "$bin_dir"/example-*; do
    name="$(basename "$bin")"
    case "$name" in *.args) continue ;; esac
    [ -x "$bin" ] || continue
    args=()
    case "$name" in
        test-*) args=(--test-threads=1 --nocapture) ;;
        bench-*) args=(--bench) ;;
    esac
    if [ -f "$bin.args" ]; then
        read -r -a extra < <(sed "s|{OUT}|$out|g" "$bin.args")
        args+=("${extra[@]}")
    fi
    started=$(date +%s.%N)
    timeout "$timeout_s" "$bin" "${args[@]}" > "$out/$name.log" 2>&1
    rc=$?
    seconds=$(awk -v a="$started" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
    # A skip line may follow the harness's "test NAME ... " on the same line.
    skipped=$(grep -o 'SKIPPED [A-Za-z0-9_]*:' "$out/$name.log" | wc -l)
    printf '%-56s %5s %9s %8s\n' "$name" "$rc" "$seconds" "$skipped" >> "$out/summary.txt"
    if [ "$rc" -ne 0 ]; then
        status=1
    elif [ "$skipped" -gt 0 ] && [ "${GPU_SUITE_ALLOW_SKIPS:-0}" != 1 ]; then
        status=1
    fi
done

cat "$out/summary.txt"
if [ "$status" -ne 0 ]; then
    echo "gpu-suite: FAILED (see the logs in $out)"
else
    echo "gpu-suite: all passed"
fi
exit "$status"
