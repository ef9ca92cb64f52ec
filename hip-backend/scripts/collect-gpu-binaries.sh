#!/usr/bin/env bash
# Builds, on a machine without a GPU, the release test binaries, benchmarks and examples of
# every crate with GPU code for the NVIDIA platform, and copies them stripped into DEST
# with gpu-suite.sh, ready to carry to a GPU machine and run there:
#
#   hip-backend/scripts/collect-gpu-binaries.sh DEST
#   (on the GPU machine)  DEST/gpu-suite.sh DEST OUT_DIR
#
# Names in DEST: test-<crate>-<target> (test-hip-backend-lib for unit tests),
# bench-<crate>-<target>, example-<name>. A `<stem>.suite-args` file beside a target's
# source file (`examples/gpu_smoke.suite-args`, `benches/gpu_decode.suite-args`,
# `src/lib.suite-args` for unit tests) is copied as `<name>.args`: arguments the suite
# adds (a libtest filter, say, so that only a crate's GPU tests run there).
# Benchmarks are collected only when their source uses hip_backend (CPU benchmarks
# stay here). Test data (`testdata/`) is compiled into the test binaries: nothing else
# needs to travel with them.
# Environment: HIP_PLATFORM (default nvidia), CUDA_ARCH, GPU_CRATES, CARGO_TARGET_DIR
# (default target/gpu-<platform>, shared with .ci/gpu-variants.sh).
set -euo pipefail
if [ $# -ne 1 ]; then
    echo "usage: $0 DEST" >&2
    exit 2
fi
mkdir -p "$1"
dest="$(cd "$1" && pwd)"
cd "$(dirname "$0")/../.."
export HIP_PLATFORM="${HIP_PLATFORM:-nvidia}"
GPU_TOOLCHAINS="$HIP_PLATFORM" source .ci/gpu-toolchains.sh
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target/gpu-$HIP_PLATFORM}"

# shellcheck source=../../.ci/gpu-crates.sh
source .ci/gpu-crates.sh

artifacts="$(mktemp)"
trap 'rm -f "$artifacts"' EXIT
cargo test --release "${packages[@]}" --no-run --message-format=json > "$artifacts"
cargo build --release "${packages[@]}" --examples --message-format=json >> "$artifacts"
cargo bench "${packages[@]}" --benches --no-run --message-format=json >> "$artifacts"

python3 - "$artifacts" "$dest" <<'PY'
import json, os, shutil, subprocess, sys
artifacts, dest = sys.argv[1], sys.argv[2]
seen = set()
for line in open(artifacts):
    try:
        message = json.loads(line)
    except ValueError:
        continue
    executable = message.get("executable")
    if message.get("reason") != "compiler-artifact" or not executable:
        continue
    target, package = message["target"], message["package_id"]
    crate = message["manifest_path"].split("/")[-2] if "manifest_path" in message else target["name"]
    kind = target["kind"][0]
    if kind == "example":
        name = f"example-{target['name']}"
    elif kind == "bench":
        if "hip_backend" not in open(target["src_path"]).read():
            continue
        name = f"bench-{crate}-{target['name']}"
    elif kind in ("lib", "test"):
        name = f"test-{crate}-{'lib' if kind == 'lib' else target['name']}"
    else:
        continue
    if name in seen:
        continue
    seen.add(name)
    stem = os.path.splitext(target["src_path"])[0]
    if os.path.exists(stem + ".suite-args"):
        shutil.copy(stem + ".suite-args", os.path.join(dest, name + ".args"))
    out = os.path.join(dest, name)
    shutil.copy(executable, out)
    subprocess.run(["strip", out], check=True)
    print(f"{name:<48} {os.path.getsize(out) / 2**20:7.1f} MiB")
PY
cp hip-backend/scripts/gpu-suite.sh "$dest/"
du -sh "$dest"
