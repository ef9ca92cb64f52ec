//! GPU build configuration shared by every ROCmForge crate that compiles HIP sources.
//!
//! This file is compiled into build scripts, not into any library:
//! - `hip-backend`'s build script calls [`GpuConfig::detect`] (the one place that looks for
//!   toolchains), compiles the runtime shim, links the runtime, and publishes the result to
//!   its dependents with [`GpuConfig::publish`] (the `links = "rocmforge_hip"` metadata).
//! - A crate with kernels of its own (`dequant`, later `model`) depends on `hip-backend`
//!   and includes this same file in its build script:
//!
//!   ```text
//!   #[path = "../hip-backend/build/hip_build.rs"]
//!   mod hip_build;
//!
//!   fn main() {
//!       let config = hip_build::GpuConfig::from_dependency().unwrap_or_else(|e| hip_build::fail(&e));
//!       config.emit_cfg();
//!       if config.platform != hip_build::Platform::None {
//!           config.compile("rocmforge_dequant_kernels", &["kernels/dequant.hip"])
//!               .unwrap_or_else(|e| hip_build::fail(&e));
//!       }
//!   }
//!   ```
//!
//!   It then sees the platform, compiler and architectures hip-backend chose, so the two
//!   can never disagree, and compiles with the same flags. The runtime library needs no
//!   second link: hip-backend's link lines reach the final binary.
//!
//! The metadata keys, as dependents' build scripts read them:
//!
//! | variable | value |
//! |---|---|
//! | `DEP_ROCMFORGE_HIP_PLATFORM` | `amd`, `nvidia` or `none` |
//! | `DEP_ROCMFORGE_HIP_COMPILER` | absolute path of `hipcc` or `nvcc` (empty for `none`) |
//! | `DEP_ROCMFORGE_HIP_ARCHS` | `;`-separated targets: `gfx90a;gfx1030` or `sm_90` |
//! | `DEP_ROCMFORGE_HIP_INCLUDE` | the folder holding `rocmforge_hip.h` |
#![allow(dead_code)] // Each build script uses its own part of this file.

use std::env;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Kernel targets for AMD when `HIP_OFFLOAD_ARCH` is unset: CDNA2 (MI200), CDNA3 (MI300),
/// RDNA2 and RDNA3, kept to those the installed device libraries can build.
pub const DEFAULT_AMD_ARCHS: &str = "gfx90a;gfx942;gfx1030;gfx1100";
/// Kernel targets for NVIDIA when `CUDA_ARCH` is unset: Hopper (H100).
pub const DEFAULT_CUDA_ARCHS: &str = "sm_90";

/// Every environment variable the detection reads; a change to any re-runs the build.
pub const WATCHED_ENV: &[&str] = &[
    "HIP_PLATFORM",
    "HIP_OFFLOAD_ARCH",
    "CUDA_ARCH",
    "HIPCC",
    "HIP_PATH",
    "ROCM_PATH",
    "HIP_DEVICE_LIB_PATH",
    "NVCC",
    "CUDA_PATH",
    "NVCC_CCBIN",
    "NVCC_PREPEND_FLAGS",
    "NVCC_APPEND_FLAGS",
    "PATH",
];

include!("platform.rs");

impl Platform {
    pub fn parse(value: &str) -> Result<Platform, String> {
        match value.trim().to_ascii_lowercase().as_str() {
            "amd" | "rocm" | "hip" => Ok(Platform::Amd),
            "nvidia" | "cuda" | "nvcc" => Ok(Platform::Nvidia),
            "none" | "cpu" | "" => Ok(Platform::None),
            other => Err(format!(
                "HIP_PLATFORM={other:?} is not a platform: use amd, nvidia or none"
            )),
        }
    }
}

/// What a build script needs to compile HIP sources for one platform.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuConfig {
    pub platform: Platform,
    /// `hipcc` or `nvcc`; `None` for [`Platform::None`].
    pub compiler: Option<PathBuf>,
    /// `gfx…` targets (AMD) or `sm_…` architectures (NVIDIA); empty for none.
    pub archs: Vec<String>,
    /// The folder holding `rocmforge_hip.h`.
    pub include_dir: PathBuf,
}

/// Reports a build failure the way cargo shows it, and stops the build script.
pub fn fail(message: &str) -> ! {
    eprintln!("error: {message}");
    std::process::exit(1)
}

fn env_nonempty(name: &str) -> Option<String> {
    env::var(name).ok().filter(|value| !value.trim().is_empty())
}

fn find_on_path(program: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join(program))
        .find(|candidate| candidate.is_file())
}

fn first_file(candidates: impl IntoIterator<Item = Option<PathBuf>>) -> Option<PathBuf> {
    candidates.into_iter().flatten().find(|path| path.is_file())
}

/// `hipcc`: `$HIPCC`, `$HIP_PATH/bin`, `$ROCM_PATH/bin`, `PATH`, `/opt/rocm/bin`.
pub fn find_hipcc() -> Option<PathBuf> {
    first_file([
        env_nonempty("HIPCC").map(PathBuf::from),
        env_nonempty("HIP_PATH").map(|dir| Path::new(&dir).join("bin/hipcc")),
        env_nonempty("ROCM_PATH").map(|dir| Path::new(&dir).join("bin/hipcc")),
        find_on_path("hipcc"),
        Some(PathBuf::from("/opt/rocm/bin/hipcc")),
    ])
}

/// `nvcc`: `$NVCC`, `$CUDA_PATH/bin`, `PATH`, `/usr/local/cuda/bin`.
pub fn find_nvcc() -> Option<PathBuf> {
    first_file([
        env_nonempty("NVCC").map(PathBuf::from),
        env_nonempty("CUDA_PATH").map(|dir| Path::new(&dir).join("bin/nvcc")),
        find_on_path("nvcc"),
        Some(PathBuf::from("/usr/local/cuda/bin/nvcc")),
    ])
}

/// Splits a target list written with `;`, `,` or spaces, dropping empty entries.
pub fn parse_arch_list(list: &str) -> Vec<String> {
    list.split([';', ',', ' ', '\t', '\n'])
        .map(str::trim)
        .filter(|arch| !arch.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The folder of AMD device-library bitcode (`oclc_isa_version_*.bc`) next to `hipcc`.
pub fn find_device_lib_dir(hipcc: &Path) -> Option<PathBuf> {
    let hipcc_root = hipcc.parent().and_then(Path::parent).map(Path::to_path_buf);
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(dir) = env_nonempty("HIP_DEVICE_LIB_PATH") {
        candidates.push(dir.into());
    }
    for root in [
        env_nonempty("ROCM_PATH").map(PathBuf::from),
        hipcc_root,
        Some("/opt/rocm".into()),
    ]
    .into_iter()
    .flatten()
    {
        candidates.push(root.join("amdgcn/bitcode"));
        candidates.push(root.join("lib/amdgcn/bitcode"));
        candidates.push(root.join("lib/x86_64-linux-gnu/amdgcn/bitcode"));
    }
    candidates.push("/usr/lib/x86_64-linux-gnu/amdgcn/bitcode".into());
    candidates.push("/usr/lib64/amdgcn/bitcode".into());
    candidates
        .into_iter()
        .find(|dir| dir.join("ockl.bc").is_file())
}

/// The `gfx…` targets a device-library folder supports, read from its
/// `oclc_isa_version_<id>.bc` file names (`90a` means `gfx90a`).
pub fn supported_amd_archs(device_lib_dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(device_lib_dir) else {
        return Vec::new();
    };
    let mut archs: Vec<String> = entries
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter_map(|name| {
            let id = name
                .strip_prefix("oclc_isa_version_")?
                .strip_suffix(".bc")?;
            Some(format!("gfx{id}"))
        })
        .collect();
    archs.sort();
    archs
}

/// Keeps the requested targets the device libraries support. A target may carry feature
/// suffixes (`gfx90a:xnack+`); only its processor part is checked. Returns (kept, dropped).
pub fn filter_amd_archs(requested: &[String], supported: &[String]) -> (Vec<String>, Vec<String>) {
    requested.iter().cloned().partition(|arch| {
        let processor = arch.split(':').next().unwrap_or(arch);
        supported.iter().any(|known| known == processor)
    })
}

/// Whether every NVIDIA target is sm_90 or later, so that every kernel of the build has
/// the wait that chained launches need (see `rocmforge_hip.h`): a build that also holds
/// sm_80 code may run that code on a newer device through its PTX, without the wait.
pub fn chained_launch_archs(archs: &[String]) -> bool {
    !archs.is_empty()
        && archs.iter().all(|arch| {
            let digits: String = arch
                .trim_start_matches("sm_")
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            digits.parse::<u32>().is_ok_and(|number| number >= 90)
        })
}

/// Checks an NVIDIA architecture list (`sm_90`, `sm_90a`, or a bare `90`) and returns it
/// in `sm_…` form.
pub fn normalize_cuda_archs(requested: &[String]) -> Result<Vec<String>, String> {
    requested
        .iter()
        .map(|arch| {
            let digits = arch
                .strip_prefix("sm_")
                .or_else(|| arch.strip_prefix("compute_"))
                .unwrap_or(arch);
            let numeric = digits.trim_end_matches(['a', 'f']);
            if numeric.len() >= 2 && numeric.chars().all(|c| c.is_ascii_digit()) {
                Ok(format!("sm_{digits}"))
            } else {
                Err(format!(
                    "CUDA_ARCH entry {arch:?} is not an architecture like sm_90"
                ))
            }
        })
        .collect()
}

fn choose_platform() -> Result<(Platform, Option<PathBuf>), String> {
    match env_nonempty("HIP_PLATFORM") {
        Some(forced) => match Platform::parse(&forced)? {
            Platform::Amd => match find_hipcc() {
                Some(hipcc) => Ok((Platform::Amd, Some(hipcc))),
                None => Err(
                    "HIP_PLATFORM=amd but no hipcc was found: install ROCm's hipcc \
                     (Debian: hipcc libamdhip64-dev) or set HIPCC or ROCM_PATH"
                        .into(),
                ),
            },
            Platform::Nvidia => match find_nvcc() {
                Some(nvcc) => Ok((Platform::Nvidia, Some(nvcc))),
                None => Err(
                    "HIP_PLATFORM=nvidia but no nvcc was found: set NVCC to its path \
                     or CUDA_PATH to the toolkit folder, or put nvcc on PATH"
                        .into(),
                ),
            },
            Platform::None => Ok((Platform::None, None)),
        },
        None => {
            if let Some(hipcc) = find_hipcc() {
                Ok((Platform::Amd, Some(hipcc)))
            } else if let Some(nvcc) = find_nvcc() {
                Ok((Platform::Nvidia, Some(nvcc)))
            } else {
                Ok((Platform::None, None))
            }
        }
    }
}

impl GpuConfig {
    /// Chooses the platform, compiler and targets from the environment and the installed
    /// toolchains. Only hip-backend's build script calls this; see the module docs.
    pub fn detect(include_dir: PathBuf) -> Result<GpuConfig, String> {
        for name in WATCHED_ENV {
            println!("cargo::rerun-if-env-changed={name}");
        }
        let (platform, compiler) = choose_platform()?;
        let archs = match (platform, &compiler) {
            (Platform::Amd, Some(hipcc)) => amd_archs(hipcc)?,
            (Platform::Nvidia, _) => {
                let requested =
                    env_nonempty("CUDA_ARCH").unwrap_or_else(|| DEFAULT_CUDA_ARCHS.into());
                let archs = normalize_cuda_archs(&parse_arch_list(&requested))?;
                if archs.is_empty() {
                    return Err("CUDA_ARCH names no architecture".into());
                }
                archs
            }
            _ => Vec::new(),
        };
        Ok(GpuConfig {
            platform,
            compiler,
            archs,
            include_dir,
        })
    }

    /// Reads the configuration hip-backend's build script published (DEP_ROCMFORGE_HIP_*).
    /// For build scripts of crates that depend on hip-backend.
    pub fn from_dependency() -> Result<GpuConfig, String> {
        // The user-facing variables decide the configuration: re-run when they change.
        for name in [
            "HIP_PLATFORM",
            "HIP_OFFLOAD_ARCH",
            "CUDA_ARCH",
            "HIPCC",
            "NVCC",
            "CUDA_PATH",
        ] {
            println!("cargo::rerun-if-env-changed={name}");
        }
        let read = |key: &str| {
            env::var(format!("DEP_ROCMFORGE_HIP_{key}")).map_err(|_| {
                format!("DEP_ROCMFORGE_HIP_{key} is not set: this crate must depend on hip-backend")
            })
        };
        let platform = Platform::parse(&read("PLATFORM")?)?;
        let compiler = Some(read("COMPILER")?)
            .filter(|path| !path.is_empty())
            .map(PathBuf::from);
        if platform != Platform::None && compiler.is_none() {
            return Err(format!(
                "hip-backend published platform {} without a compiler",
                platform.name()
            ));
        }
        Ok(GpuConfig {
            platform,
            compiler,
            archs: parse_arch_list(&read("ARCHS")?),
            include_dir: PathBuf::from(read("INCLUDE")?),
        })
    }

    /// Publishes this configuration to dependents' build scripts (links metadata) and to
    /// the crate itself (`ROCMFORGE_HIP_PLATFORM`, `ROCMFORGE_HIP_ARCHS` at compile time).
    pub fn publish(&self) {
        let compiler = self
            .compiler
            .as_deref()
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        println!("cargo::metadata=platform={}", self.platform.name());
        println!("cargo::metadata=compiler={compiler}");
        println!("cargo::metadata=archs={}", self.archs.join(";"));
        println!("cargo::metadata=include={}", self.include_dir.display());
        println!(
            "cargo::rustc-env=ROCMFORGE_HIP_PLATFORM={}",
            self.platform.name()
        );
        println!(
            "cargo::rustc-env=ROCMFORGE_HIP_ARCHS={}",
            self.archs.join(";")
        );
    }

    /// Declares and sets `cfg(hip_platform = "...")` for the crate being built.
    pub fn emit_cfg(&self) {
        println!("cargo::rustc-check-cfg=cfg(hip_platform, values(\"amd\", \"nvidia\", \"none\"))");
        println!("cargo::rustc-cfg=hip_platform=\"{}\"", self.platform.name());
    }

    /// The compiler flags for this platform and target list (no sources, no output).
    pub fn compile_flags(&self) -> Vec<String> {
        let mut flags = Vec::new();
        match self.platform {
            Platform::Amd => {
                flags.extend(["-x", "hip", "-std=c++17", "-O3", "-fPIC"].map(String::from));
                flags.extend(
                    self.archs
                        .iter()
                        .map(|arch| format!("--offload-arch={arch}")),
                );
            }
            Platform::Nvidia => {
                flags.extend(
                    ["-x", "cu", "-std=c++17", "-O3", "-Xcompiler=-fPIC"].map(String::from),
                );
                for arch in &self.archs {
                    let number = arch.trim_start_matches("sm_");
                    // Machine code for the target, plus its PTX so newer GPUs can JIT it.
                    flags.push(format!(
                        "-gencode=arch=compute_{number},code=[sm_{number},compute_{number}]"
                    ));
                }
                if chained_launch_archs(&self.archs) {
                    flags.push("-DRF_CHAINED_LAUNCH=1".to_string());
                }
            }
            Platform::None => {}
        }
        flags
    }

    /// Compiles HIP sources (paths relative to the calling crate's manifest folder) into
    /// a static library `lib<lib_name>.a` and links it into that crate. Prints
    /// `rerun-if-changed` for every source and for our header.
    pub fn compile(&self, lib_name: &str, sources: &[&str]) -> Result<(), String> {
        let Some(compiler) = &self.compiler else {
            return Err(format!(
                "cannot compile {sources:?}: platform {} has no compiler",
                self.platform.name()
            ));
        };
        println!(
            "cargo::rerun-if-changed={}",
            self.include_dir.join("rocmforge_hip.h").display()
        );
        if self.platform == Platform::Amd {
            // cc first runs the compiler bare (`hipcc -E`) to learn its family; without a
            // target, hipcc probes for a GPU and prints a traceback when there is none.
            // Our own compile lines name their targets with --offload-arch.
            env::set_var("HCC_AMDGPU_TARGET", self.archs.join(","));
        }
        let mut build = cc::Build::new();
        // Our flags are complete for each compiler; cc's defaults are gcc/clang host flags
        // that nvcc rejects, and its debug flags would slow the kernels of debug builds.
        build
            .compiler(compiler)
            .cpp(true)
            .no_default_flags(true)
            .warnings(false)
            .extra_warnings(false)
            .include(&self.include_dir);
        for flag in self.compile_flags() {
            build.flag(&flag);
        }
        for source in sources {
            println!("cargo::rerun-if-changed={source}");
            build.file(source);
        }
        if lint_only() {
            return Ok(());
        }
        build.try_compile(lib_name).map_err(|error| {
            let mut message = format!(
                "compiling {sources:?} with {} failed: {error}",
                compiler.display()
            );
            let _ = write!(message, " (flags: {})", self.compile_flags().join(" "));
            message
        })
    }

    /// Links the runtime library: `amdhip64` on AMD, the static CUDA runtime on NVIDIA
    /// (which opens the driver's `libcuda.so` at run time). hip-backend only.
    pub fn link_runtime(&self) -> Result<(), String> {
        match (self.platform, &self.compiler) {
            (Platform::Amd, Some(hipcc)) => {
                if let Some(dir) = amd_runtime_lib_dir(hipcc) {
                    println!("cargo::rustc-link-search=native={}", dir.display());
                }
                println!("cargo::rustc-link-lib=dylib=amdhip64");
                Ok(())
            }
            (Platform::Nvidia, Some(nvcc)) => {
                let dir = cuda_runtime_lib_dir(nvcc).ok_or_else(|| {
                    format!(
                        "libcudart_static.a was not found beside {} (looked in lib64, lib and \
                         targets/x86_64-linux/lib): install the CUDA runtime or set CUDA_PATH",
                        nvcc.display()
                    )
                })?;
                println!("cargo::rustc-link-search=native={}", dir.display());
                println!("cargo::rustc-link-lib=static=cudart_static");
                for system in ["dl", "rt", "pthread"] {
                    println!("cargo::rustc-link-lib=dylib={system}");
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// Whether this build script runs for `cargo clippy`, which checks the crates and links
/// nothing: its build-script runs are units of their own (cargo counts the workspace
/// wrapper in their hash), so their kernels would be compiled a second time beside those
/// of the build that links them, only to be thrown away. A lint-and-test run built every
/// kernel twice for each platform, the longest step of CI.
fn lint_only() -> bool {
    env::var_os("RUSTC_WORKSPACE_WRAPPER")
        .map(PathBuf::from)
        .and_then(|wrapper| wrapper.file_stem().map(|stem| stem.to_owned()))
        .is_some_and(|stem| stem == "clippy-driver")
}

fn amd_archs(hipcc: &Path) -> Result<Vec<String>, String> {
    let explicit = env_nonempty("HIP_OFFLOAD_ARCH");
    let requested = parse_arch_list(explicit.as_deref().unwrap_or(DEFAULT_AMD_ARCHS));
    let Some(lib_dir) = find_device_lib_dir(hipcc) else {
        println!(
            "cargo::warning=AMD device libraries (amdgcn/bitcode) not found; building for {} \
             unchecked (set HIP_DEVICE_LIB_PATH to check)",
            requested.join(";")
        );
        return Ok(requested);
    };
    println!("cargo::rerun-if-changed={}", lib_dir.display());
    let supported = supported_amd_archs(&lib_dir);
    let (kept, dropped) = filter_amd_archs(&requested, &supported);
    if explicit.is_some() && !dropped.is_empty() {
        return Err(format!(
            "HIP_OFFLOAD_ARCH asks for {} but the device libraries in {} support only {}",
            dropped.join(";"),
            lib_dir.display(),
            supported.join(";")
        ));
    }
    if kept.is_empty() {
        return Err(format!(
            "none of the default AMD targets {DEFAULT_AMD_ARCHS} is supported by the device \
             libraries in {} (they support {}): set HIP_OFFLOAD_ARCH",
            lib_dir.display(),
            supported.join(";")
        ));
    }
    Ok(kept)
}

fn amd_runtime_lib_dir(hipcc: &Path) -> Option<PathBuf> {
    let hipcc_root = hipcc.parent().and_then(Path::parent).map(Path::to_path_buf);
    [
        env_nonempty("HIP_PATH").map(PathBuf::from),
        env_nonempty("ROCM_PATH").map(PathBuf::from),
        hipcc_root,
    ]
    .into_iter()
    .flatten()
    .map(|root| root.join("lib"))
    .find(|dir| dir.join("libamdhip64.so").exists())
}

fn cuda_runtime_lib_dir(nvcc: &Path) -> Option<PathBuf> {
    let root = nvcc.parent()?.parent()?;
    [
        "lib64",
        "lib",
        "targets/x86_64-linux/lib",
        "targets/sbsa-linux/lib",
    ]
    .into_iter()
    .map(|sub| root.join(sub))
    .find(|dir| dir.join("libcudart_static.a").is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn arch_lists_accept_semicolons_commas_and_spaces() {
        assert_eq!(
            parse_arch_list("gfx90a;gfx942, gfx1030  gfx1100;"),
            strings(&["gfx90a", "gfx942", "gfx1030", "gfx1100"])
        );
        assert!(parse_arch_list(" ; ,").is_empty());
    }

    #[test]
    fn platform_names_parse_and_unknown_ones_are_refused() {
        assert_eq!(Platform::parse("AMD"), Ok(Platform::Amd));
        assert_eq!(Platform::parse("cuda"), Ok(Platform::Nvidia));
        assert_eq!(Platform::parse("none"), Ok(Platform::None));
        let error = Platform::parse("intel").unwrap_err();
        assert!(error.contains("\"intel\""), "{error}");
    }

    #[test]
    fn amd_targets_are_filtered_by_processor_ignoring_features() {
        let supported = strings(&["gfx1030", "gfx90a", "gfx940"]);
        let (kept, dropped) = filter_amd_archs(
            &strings(&["gfx90a:xnack+", "gfx942", "gfx1030", "gfx1100"]),
            &supported,
        );
        assert_eq!(kept, strings(&["gfx90a:xnack+", "gfx1030"]));
        assert_eq!(dropped, strings(&["gfx942", "gfx1100"]));
    }

    #[test]
    fn supported_amd_targets_come_from_isa_bitcode_names() {
        let dir = env::temp_dir().join(format!("rocmforge-hip-build-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in [
            "oclc_isa_version_90a.bc",
            "oclc_isa_version_1030.bc",
            "ocml.bc",
            "oclc_isa_version_940.txt",
        ] {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        let archs = supported_amd_archs(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(archs, strings(&["gfx1030", "gfx90a"]));
    }

    #[test]
    fn cuda_archs_are_normalized_and_checked() {
        assert_eq!(
            normalize_cuda_archs(&strings(&["sm_90", "80", "sm_90a"])).unwrap(),
            strings(&["sm_90", "sm_80", "sm_90a"])
        );
        let error = normalize_cuda_archs(&strings(&["hopper"])).unwrap_err();
        assert!(error.contains("\"hopper\""), "{error}");
    }

    #[test]
    fn compile_flags_name_every_target() {
        let amd = GpuConfig {
            platform: Platform::Amd,
            compiler: Some("/usr/bin/hipcc".into()),
            archs: strings(&["gfx90a", "gfx1030"]),
            include_dir: "/inc".into(),
        };
        let flags = amd.compile_flags();
        assert!(flags.contains(&"--offload-arch=gfx90a".to_string()));
        assert!(flags.contains(&"--offload-arch=gfx1030".to_string()));
        let nvidia = GpuConfig {
            platform: Platform::Nvidia,
            archs: strings(&["sm_90"]),
            ..amd
        };
        assert!(nvidia
            .compile_flags()
            .contains(&"-gencode=arch=compute_90,code=[sm_90,compute_90]".to_string()));
        assert!(nvidia
            .compile_flags()
            .contains(&"-Xcompiler=-fPIC".to_string()));
        let chained = "-DRF_CHAINED_LAUNCH=1".to_string();
        assert!(nvidia.compile_flags().contains(&chained));
        let mixed = GpuConfig {
            archs: strings(&["sm_80", "sm_90"]),
            ..nvidia
        };
        assert!(!mixed.compile_flags().contains(&chained));
    }

    #[test]
    fn chained_launches_need_every_target_at_sm_90() {
        assert!(chained_launch_archs(&strings(&["sm_90"])));
        assert!(chained_launch_archs(&strings(&["sm_90a", "sm_100"])));
        assert!(!chained_launch_archs(&strings(&["sm_86", "sm_90"])));
        assert!(!chained_launch_archs(&strings(&["sm_"])));
        assert!(!chained_launch_archs(&[]));
    }
}
