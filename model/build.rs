//! model's build script: compiles the transformer kernels (`kernels/transformer.hip`) and the
//! mixture-of-experts kernels (`kernels/experts.hip`) with
//! hip-backend's GPU configuration, when that configuration has a platform.

#[path = "../hip-backend/build/hip_build.rs"]
mod hip_build;

use hip_build::{fail, GpuConfig, Platform};

fn main() {
    let config = GpuConfig::from_dependency().unwrap_or_else(|error| fail(&error));
    config.emit_cfg();
    if config.platform == Platform::None {
        return;
    }
    config
        .compile(
            "rocmforge_model_kernels",
            &["kernels/transformer.hip", "kernels/experts.hip"],
        )
        .unwrap_or_else(|error| fail(&error));
}
