// The GPU platforms, shared by the build scripts (`hip_build.rs`) and the library,
// which both `include!` this file.

/// The GPU platform a build targets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Platform {
    /// AMD GPUs through ROCm's HIP runtime.
    Amd,
    /// NVIDIA GPUs through the CUDA runtime.
    Nvidia,
    /// No GPU support compiled in.
    None,
}

impl Platform {
    /// `amd`, `nvidia` or `none`, as `HIP_PLATFORM` spells it.
    pub fn name(self) -> &'static str {
        match self {
            Platform::Amd => "amd",
            Platform::Nvidia => "nvidia",
            Platform::None => "none",
        }
    }
}
