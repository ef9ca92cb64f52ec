#!/usr/bin/env bash
# Builds and tests the GPU variants of every crate with GPU code, on a machine without a GPU:
#   amd     hipcc, kernels compiled for the AMD targets; tests run (no device here, so the
#           NoDevice paths are checked and device tests print SKIPPED)
#   nvidia  nvcc and the static CUDA runtime; test binaries and examples built and linked,
#           tests run (no driver here: NoDevice again)
#   none    no GPU toolchain; tests run (the BuiltWithoutGpu paths)
# Each variant is also linted with clippy, since each compiles different cfg branches.
#
# Crates with GPU code are found by their build script including hip-backend's
# build/hip_build.rs, so a crate that adds kernels is picked up without editing this file.
#
# Environment (all optional):
#   GPU_VARIANTS               variants to run, default "amd nvidia none"
#   GPU_CRATES                 crates to build, default: found as above
#   GPU_VARIANTS_TARGET_ROOT   where the per-variant target dirs go, default ./target
#                              (target/gpu-amd, target/gpu-nvidia, target/gpu-none, so the
#                              variants never rebuild each other)
#   GPU_NVIDIA_RUN_TESTS=0     only build the NVIDIA variant
# Exits non-zero on the first failure.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"

variants="${GPU_VARIANTS:-amd nvidia none}"
case " $variants " in
    *" amd "*|*" nvidia "*)
        want=""
        [[ " $variants " == *" amd "* ]] && want="amd"
        [[ " $variants " == *" nvidia "* ]] && want="$want nvidia"
        # shellcheck source=gpu-toolchains.sh
        GPU_TOOLCHAINS="$want" source .ci/gpu-toolchains.sh
        ;;
esac

# shellcheck source=gpu-crates.sh
source .ci/gpu-crates.sh
if [ ${#packages[@]} -eq 0 ]; then
    echo "gpu-variants: no crate with GPU code found" >&2
    exit 1
fi
target_root="${GPU_VARIANTS_TARGET_ROOT:-$root/target}"

for variant in $variants; do
    export HIP_PLATFORM="$variant"
    export CARGO_TARGET_DIR="$target_root/gpu-$variant"
    started=$SECONDS
    echo "== gpu variant $variant (crates:$GPU_CRATES; target dir $CARGO_TARGET_DIR)"
    cargo clippy "${packages[@]}" --all-targets -- -D warnings
    echo "== gpu variant $variant: clippy passed at $((SECONDS - started)) s"
    if [ "$variant" = nvidia ] && [ "${GPU_NVIDIA_RUN_TESTS:-1}" = 0 ]; then
        cargo test "${packages[@]}" --no-run
    else
        cargo test "${packages[@]}"
    fi
    echo "== gpu variant $variant passed in $((SECONDS - started)) s"
done
