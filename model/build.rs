//! model's build script: compiles the transformer kernels (`kernels/norm_rope.hip`,
//! `kernels/attention.hip`, `kernels/attention_warps.hip`, `kernels/flash_attention.hip`,
//! `kernels/rows.hip`, which share `kernels/transformer_common.h`; the norms' parts are
//! `kernels/norm.h`, the split attention's chunks `kernels/attention_chunks.h`) and the
//! mixture-of-experts kernels (`kernels/experts.hip`) with hip-backend's GPU
//! configuration, when that configuration has a platform. Each `.hip` file is a
//! translation unit of its own.

#[path = "../hip-backend/build/hip_build.rs"]
mod hip_build;

use hip_build::{fail, GpuConfig, Platform};

/// The kernel sources, one translation unit each.
const SOURCES: &[&str] = &[
    "kernels/norm_rope.hip",
    "kernels/attention.hip",
    "kernels/attention_warps.hip",
    "kernels/flash_attention.hip",
    "kernels/rows.hip",
    "kernels/experts.hip",
];
/// The headers they include (a change re-runs the build).
const HEADERS: &[&str] = &[
    "kernels/transformer_common.h",
    "kernels/norm.h",
    "kernels/attention_chunks.h",
];

fn main() {
    let config = GpuConfig::from_dependency().unwrap_or_else(|error| fail(&error));
    config.emit_cfg();
    if config.platform == Platform::None {
        return;
    }
    for header in HEADERS {
        println!("cargo::rerun-if-changed={header}");
    }
    config
        .compile("rocmforge_model_kernels", SOURCES)
        .unwrap_or_else(|error| fail(&error));
}
