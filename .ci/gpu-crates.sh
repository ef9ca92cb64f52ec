#!/usr/bin/env bash
# Sourced from the repository root by the scripts that build the GPU code: sets
# GPU_CRATES, when not given, to every crate whose build script includes hip-backend's
# build/hip_build.rs (so a crate that adds kernels is picked up without editing them),
# and `packages` to the matching cargo arguments (`-p CRATE` each).
if [ -z "${GPU_CRATES:-}" ]; then
    GPU_CRATES=""
    for manifest in */Cargo.toml; do
        dir="$(dirname "$manifest")"
        if grep -qs 'hip_build\.rs' "$dir"/build.rs "$dir"/build/*.rs; then
            GPU_CRATES="$GPU_CRATES $dir"
        fi
    done
fi
packages=()
for crate in $GPU_CRATES; do packages+=(-p "$crate"); done
