//! hip-backend's build script: detects the GPU platform once, compiles the runtime shim,
//! links the runtime, and publishes the configuration to dependents. The reusable part
//! lives in `hip_build.rs`, which crates with kernels of their own include as well.

#[path = "hip_build.rs"]
mod hip_build;

use hip_build::{fail, GpuConfig, Platform};
use std::path::PathBuf;

fn main() {
    let manifest_dir = PathBuf::from(
        std::env::var("CARGO_MANIFEST_DIR")
            .unwrap_or_else(|_| fail("CARGO_MANIFEST_DIR is not set")),
    );
    println!("cargo::rerun-if-changed=build/hip_build.rs");
    println!("cargo::rerun-if-changed=build/platform.rs");
    let config =
        GpuConfig::detect(manifest_dir.join("include")).unwrap_or_else(|error| fail(&error));
    config.emit_cfg();
    config.publish();
    if config.platform != Platform::None {
        config
            .compile("rocmforge_hip_runtime", &["csrc/rfhip_runtime.hip"])
            .unwrap_or_else(|error| fail(&error));
        config.link_runtime().unwrap_or_else(|error| fail(&error));
    }
}
