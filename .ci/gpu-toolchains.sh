#!/usr/bin/env bash
# Installs the two GPU toolchains ROCmForge builds with, without needing a GPU:
#   AMD:    Debian's `hipcc` and `libamdhip64-dev` (HIP/ROCm compiler and runtime library);
#   NVIDIA: nvcc, the CUDA headers and the static CUDA runtime from PyPI, in a venv.
# Each step is skipped when its toolchain is already present, so running it twice is cheap.
#
# Use:
#   .ci/gpu-toolchains.sh            install, then print the `export` lines to use
#   source .ci/gpu-toolchains.sh     install and export the variables into this shell
#
# Variables read (all optional):
#   CUDA_VENV        where the NVIDIA venv lives            (default /opt/cuda-venv)
#   CUDA_PIP_SPEC    version pin of the CUDA pip packages   (default ==13.0.*, the H100
#                    driver's CUDA version; mixing minor versions breaks ptxas)
#   GPU_TOOLCHAINS   which to install: "amd nvidia" (default), "amd" or "nvidia"
# Variables exported: NVCC, CUDA_PATH (the NVIDIA toolchain), HIPCC (the AMD compiler).

_rf_gpu_toolchains() {
    local venv="${CUDA_VENV:-/opt/cuda-venv}"
    local spec="${CUDA_PIP_SPEC:-==13.0.*}"
    local which="${GPU_TOOLCHAINS:-amd nvidia}"
    local sudo=""
    if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then sudo="sudo"; fi

    if [[ " $which " == *" amd "* ]]; then
        if command -v hipcc >/dev/null && [ -e /usr/include/hip/hip_runtime.h ] \
            && [ "$(ldconfig -p 2>/dev/null | grep -c libamdhip64)" -gt 0 ]; then
            echo "gpu-toolchains: AMD toolchain present ($(command -v hipcc))" >&2
        else
            echo "gpu-toolchains: installing hipcc and libamdhip64-dev" >&2
            $sudo apt-get update -q >&2
            DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q hipcc libamdhip64-dev >&2
        fi
        HIPCC="$(command -v hipcc)"
    fi

    if [[ " $which " == *" nvidia "* ]]; then
        local nvcc
        nvcc="$(ls "$venv"/lib/python3*/site-packages/nvidia/cu*/bin/nvcc 2>/dev/null | head -n1 || true)"
        if [ -n "$nvcc" ] && [ -x "$nvcc" ]; then
            echo "gpu-toolchains: NVIDIA toolchain present ($nvcc)" >&2
        else
            echo "gpu-toolchains: installing the CUDA compiler and runtime into $venv" >&2
            [ -x "$venv/bin/pip" ] || python3 -m venv "$venv" >&2
            "$venv/bin/pip" install -q --disable-pip-version-check \
                "nvidia-cuda-nvcc$spec" "nvidia-cuda-runtime$spec" "nvidia-cuda-cccl$spec" \
                "nvidia-cuda-crt$spec" "nvidia-nvvm$spec" >&2
            nvcc="$(ls "$venv"/lib/python3*/site-packages/nvidia/cu*/bin/nvcc | head -n1)"
        fi
        NVCC="$nvcc"
        CUDA_PATH="$(dirname "$(dirname "$nvcc")")"
    fi
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    # Sourced: install in a child shell (so `set -e` there cannot end the caller's shell),
    # then export what it printed.
    if _rf_exports="$(bash "${BASH_SOURCE[0]}")"; then
        eval "$_rf_exports"
        unset _rf_exports
    else
        unset _rf_exports
        echo "gpu-toolchains: installation failed" >&2
        return 1
    fi
else
    set -euo pipefail
    _rf_gpu_toolchains
    if [ -n "${HIPCC:-}" ]; then echo "export HIPCC=$HIPCC"; fi
    if [ -n "${NVCC:-}" ]; then echo "export NVCC=$NVCC CUDA_PATH=$CUDA_PATH"; fi
fi
