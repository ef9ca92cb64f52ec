//! hip-backend: the GPU runtime for ROCmForge, one HIP code base for AMD and NVIDIA GPUs.
//!
//! It finds devices and hands out what GPU work needs: [`Device`] (name, architecture,
//! memory), [`Stream`], [`Event`] (record, wait, query, time), [`DeviceBuffer`] with typed
//! views ([`DeviceView`], [`DeviceViewMut`]), [`PinnedBuffer`] (page-locked host memory),
//! asynchronous host↔device copies on a stream, [`Graph`] (a stream's work captured once
//! and replayed with one launch), and [`DeviceArena`], one allocation carved
//! into aligned sub-buffers. [`list_devices`] and [`PLATFORM`] serve `rocmforge devices`.
//!
//! **Architecture Invariant:** this crate knows nothing of GGUF, tensors or models; it
//! moves bytes and runs nothing but copies (and, through [`collective`], the collectives
//! library's all-reduce). Kernels live in the crates that own their math (`dequant`,
//! `model`) and are compiled with this crate's build configuration.
//!
//! # Layers
//! As in cudarc: `sys` declares the `rfhip_*` C functions of our runtime shim
//! (`csrc/rfhip_runtime.hip`, which calls HIP on AMD and, through
//! `include/rocmforge_hip.h`, CUDA on NVIDIA); `result` turns each status into
//! `Result<_, HipError>` carrying the runtime's error name and message; the public types
//! above own their handles. `Drop` never panics: a failed release is recorded and returned
//! by the next [`Device::check_err`], [`Device::synchronize`] or [`Stream::synchronize`].
//!
//! # Platforms (no cargo features)
//! The build script picks the platform (`HIP_PLATFORM=amd|nvidia|none` forces it):
//! - **amd** when ROCm's `hipcc` is found (`HIPCC`, `HIP_PATH`, `ROCM_PATH`, `PATH`,
//!   `/opt/rocm`). Kernel targets come from `HIP_OFFLOAD_ARCH` (`;`-separated), by
//!   default `gfx90a;gfx942;gfx1030;gfx1100` filtered to what the installed device
//!   libraries support (`HIP_DEVICE_LIB_PATH` to point at them). Links `libamdhip64`.
//! - **nvidia** when `nvcc` is found (`NVCC`, `CUDA_PATH/bin`, `PATH`,
//!   `/usr/local/cuda/bin`): architectures from `CUDA_ARCH`, default `sm_90`; links the
//!   static CUDA runtime, so a binary needs only the driver's `libcuda.so` where it runs.
//! - **none** otherwise: the same API compiles and every entry point returns
//!   [`HipError::BuiltWithoutGpu`].
//!
//! With a platform but no usable device (no GPU, no driver), entry points return
//! [`HipError::NoDevice`]. Nothing panics in either case. Code can test the platform
//! with `cfg(hip_platform = "amd" | "nvidia" | "none")`, which the build script sets.
//! `README.md` says how to build and test each variant, and how to run the tests on a GPU
//! machine that has no Rust toolchain (`scripts/collect-gpu-binaries.sh`,
//! `scripts/gpu-suite.sh`).
//!
//! [`collective`] sums buffers over several GPUs of the process ([`Communicator`]'s
//! all-reduce, capturable into a [`Graph`]) through NCCL (NVIDIA) or RCCL (AMD). That
//! library is loaded at run time with `dlopen` ([`Collectives::load`]), never linked: it
//! is hundreds of megabytes, and only tensor-parallel runs need it, so builds and
//! single-GPU runs do without it. Without it, loading fails with
//! [`HipError::CollectivesUnavailable`], which names the paths tried.
//!
//! [`fault`] is a testing hook: it makes a chosen device or page-locked allocation fail,
//! as a full device would, so the paths that clean up after one can be tested.
//!
//! # Kernels in other crates
//! A crate with HIP kernels (`dequant`, later `model`) reuses this configuration rather
//! than detecting again:
//! 1. depend on `hip-backend` in `[dependencies]` (so its build script receives the
//!    `DEP_ROCMFORGE_HIP_*` variables: `PLATFORM`, `COMPILER`, `ARCHS`, `INCLUDE`) and
//!    on `cc` in `[build-dependencies]`;
//! 2. in its `build.rs`, include the helper and compile:
//!    ```text
//!    #[path = "../hip-backend/build/hip_build.rs"]
//!    mod hip_build;
//!    fn main() {
//!        let config = hip_build::GpuConfig::from_dependency().unwrap_or_else(|e| hip_build::fail(&e));
//!        config.emit_cfg(); // cfg(hip_platform = "...") for this crate too
//!        if config.platform != hip_build::Platform::None {
//!            config.compile("rocmforge_dequant_kernels", &["kernels/dequant.hip"])
//!                .unwrap_or_else(|e| hip_build::fail(&e));
//!        }
//!    }
//!    ```
//! 3. write kernels in `.hip` files that `#include "rocmforge_hip.h"` and use only the HIP
//!    names it maps (add a mapping there when a new one is needed); export an
//!    `extern "C"` launcher per kernel taking device pointers, sizes and a `void*` stream
//!    and returning the status of `hipGetLastError()`;
//! 4. in Rust, declare the launchers under `#[cfg(not(hip_platform = "none"))]`, and give
//!    each one typed wrapper that checks lengths, takes [`DeviceView`]/[`DeviceViewMut`]
//!    and a [`Stream`] (`as_ptr`, `as_mut_ptr`, [`Stream::as_raw`]), turns the launcher's
//!    status into a `Result` with [`check_status`], and returns
//!    [`HipError::BuiltWithoutGpu`] under `cfg(hip_platform = "none")`.
//!
//! The runtime library needs no second link line; this crate's reaches the final binary.
//! One helper file, included by path, keeps the compile flags in one place without a
//! separate build-helper crate to version; the `links` metadata carries the decisions,
//! so no two crates can build for different platforms or targets.

mod arena;
pub mod collective;
mod device;
mod error;
#[doc(hidden)]
pub mod fault;
mod graph;
mod memory;
mod pinned;
mod registered;
mod result;
mod stream;
mod sys;

#[cfg(test)]
#[path = "../build/hip_build.rs"]
mod hip_build;

pub use arena::{ArenaBuffer, ArenaStats, DeviceArena, RangeAllocator, DEFAULT_ARENA_ALIGN};
pub use collective::{Collectives, Communicator};
pub use device::{
    device_or_skip, list_devices, runtime_versions, Device, DeviceInfo, MemoryInfo, RuntimeVersions,
};
pub use error::{HipError, Result};
pub use graph::Graph;
pub use memory::{
    allocation_counters, AllocationCounters, DeviceBuffer, DeviceView, DeviceViewMut,
};
pub use pinned::{prepare_pinned_ring, release_prepared_rings, PinnedBuffer};
pub use registered::HostRegistration;
pub use stream::{Event, Stream};

include!("../build/platform.rs");

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The platform the build script chose.
#[cfg(hip_platform = "amd")]
pub const PLATFORM: Platform = Platform::Amd;
/// The platform the build script chose.
#[cfg(hip_platform = "nvidia")]
pub const PLATFORM: Platform = Platform::Nvidia;
/// The platform the build script chose.
#[cfg(hip_platform = "none")]
pub const PLATFORM: Platform = Platform::None;

/// The kernel targets compiled in, `;`-separated (`gfx90a;gfx1030`, `sm_90`); empty
/// for platform `none`.
pub const OFFLOAD_ARCHS: &str = env!("ROCMFORGE_HIP_ARCHS");

/// Turns the native status a kernel launcher of another crate returns (`hipError_t` on
/// AMD, `cudaError_t` on NVIDIA, as an `int`; 0 for success) into a `Result` whose error
/// names `call` and carries the runtime's error name and message.
pub fn check_status(call: &'static str, status: i32) -> Result<()> {
    result::check(call, status)
}

/// The platform the linked runtime shim reports; equal to [`PLATFORM`] unless the build
/// is broken.
pub fn linked_platform_name() -> String {
    result::shim_platform_name()
}

/// Whether kernels launched chained (`rfLaunchChained` in `include/rocmforge_hip.h`) may
/// start while the kernel before them in their stream finishes, where the device and the
/// build allow it (NVIDIA, compute capability 9.0 and later, every target sm_90 or
/// later); they may unless told otherwise. `false` makes every launch a plain one, to
/// compare the two. Process-wide, for the kernels of every crate; it applies from the
/// next launch on (a graph replays the launches it captured), so set it once, before the
/// first kernel runs.
pub fn set_chained_launch(allowed: bool) {
    // SAFETY: stores an int; no pointer crosses.
    unsafe { sys::rfhip_set_chained_launch(i32::from(allowed)) }
}

/// What [`set_chained_launch`] set last (`true` at the start).
pub fn chained_launch_allowed() -> bool {
    // SAFETY: loads an int; no pointer crosses.
    unsafe { sys::rfhip_chained_launch_allowed() != 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_platform_agrees_with_the_build_script_and_the_shim() {
        assert_eq!(PLATFORM.name(), env!("ROCMFORGE_HIP_PLATFORM"));
        assert_eq!(linked_platform_name(), PLATFORM.name());
        match PLATFORM {
            Platform::None => assert!(OFFLOAD_ARCHS.is_empty()),
            Platform::Amd => assert!(
                OFFLOAD_ARCHS.split(';').all(|arch| arch.starts_with("gfx")),
                "{OFFLOAD_ARCHS}"
            ),
            Platform::Nvidia => assert!(
                OFFLOAD_ARCHS.split(';').all(|arch| arch.starts_with("sm_")),
                "{OFFLOAD_ARCHS}"
            ),
        }
    }

    #[test]
    fn chained_launches_are_allowed_until_switched_off() {
        assert!(chained_launch_allowed());
        set_chained_launch(false);
        assert!(!chained_launch_allowed());
        set_chained_launch(true);
        assert!(chained_launch_allowed());
    }

    #[test]
    fn native_statuses_become_errors_with_the_runtime_names() {
        assert!(check_status("launch", 0).is_ok());
        // 1 is hipErrorInvalidValue on AMD and cudaErrorInvalidValue on NVIDIA.
        match (PLATFORM, check_status("launch", 1)) {
            (Platform::None, Err(HipError::BuiltWithoutGpu)) => {}
            (
                _,
                Err(HipError::Api {
                    call: "launch",
                    code: 1,
                    name,
                    message,
                }),
            ) => {
                assert!(name.ends_with("ErrorInvalidValue"), "{name}");
                assert!(!message.is_empty());
            }
            (platform, other) => panic!("{platform}: unexpected {other:?}"),
        }
    }

    #[test]
    fn error_messages_name_the_offending_values() {
        let full = HipError::ArenaFull {
            requested: 4096,
            align: 256,
            used: 1000,
            capacity: 2048,
            largest_free: 1048,
        };
        let text = full.to_string();
        for value in ["4096", "256", "1000", "2048", "1048"] {
            assert!(text.contains(value), "{text}");
        }
        assert!(HipError::BuiltWithoutGpu
            .to_string()
            .starts_with("built without gpu support"));
        assert!(HipError::BuiltWithoutGpu.is_unavailable());
        assert!(!HipError::InvalidAlignment { align: 3 }.is_unavailable());
    }
}
