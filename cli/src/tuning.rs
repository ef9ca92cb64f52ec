//! The settings that choose between two ways of doing the same work (to measure or test
//! one against the other), as the binaries take them from the environment. The library
//! crates never read the environment: each variable below names an option that the
//! `rocmforge` binary (which also takes a flag for each) and `cargo xtask` hand to them.
//!
//! | variable | option | default |
//! |---|---|---|
//! | `ROCMFORGE_CPU_AVX512` | [`dequant::matmul::set_avx512_allowed`] | allowed; `0` keeps the CPU's products on the AVX2 kernels |
//! | `ROCMFORGE_CHAINED_LAUNCH` | [`hip_backend::set_chained_launch`] | allowed; `0` launches every kernel plainly |
//! | `ROCMFORGE_FLASH_MMA` | [`GpuTuning::flash_mma`] | allowed; `0` keeps a prompt's attention off the matrix units |
//! | `ROCMFORGE_WARP_ATTENTION` | [`GpuTuning::warp_attention`] | on; `0` gives a decode step's attention over f16 caches the kernel every cache type runs |
//! | `ROCMFORGE_INT8_PROMPTS` | [`GpuTuning::int8_prompts`] | on; `0` gives the `Q4_K` products of prompts and batches the f16 tiles and skinny products every type runs |
//! | `ROCMFORGE_HOST_ROWS_ON_GPU` | [`GpuTuning::host_rows_share`] | the CPU's threads decide; a share between 0 and 1 |
//! | `ROCMFORGE_EXPERT_LINK_SLOTS` | [`GpuTuning::expert_link_slots`] | up to 4 a layer, a quarter of the budget's slots at most; `0` leaves every missed expert's routes to the CPU |
//! | `ROCMFORGE_EXPERTS_IN_PLACE` | [`GpuTuning::experts_in_place`] | on; `0` splits a few tokens' missed routes between the link slots and the CPU |
//! | `ROCMFORGE_STAGING_RING` | [`GpuTuning::staging_ring`] | `region`; `separate` allocates a buffer at a time |

use model::gpu::GpuTuning;
use tensor_store::device::StagingRing;

/// Set to `0`, the CPU's products keep off the AVX-512 kernels.
pub const CPU_AVX512_ENV: &str = "ROCMFORGE_CPU_AVX512";
/// Set to `0`, every GPU kernel is launched plainly, none chained.
pub const CHAINED_LAUNCH_ENV: &str = "ROCMFORGE_CHAINED_LAUNCH";
/// Set to `0`, a prompt's attention on the GPU keeps off the matrix units.
pub const FLASH_MMA_ENV: &str = "ROCMFORGE_FLASH_MMA";
/// Set to `0`, a decode step's attention over f16 caches takes the kernel every cache
/// type runs, not the one whose 32-lane groups take a key a lane.
pub const WARP_ATTENTION_ENV: &str = "ROCMFORGE_WARP_ATTENTION";
/// Set to `0`, a prompt's `Q4_K` products on the GPU take the f16 tiles, not the int8
/// matrix units.
pub const INT8_PROMPTS_ENV: &str = "ROCMFORGE_INT8_PROMPTS";
/// A share between 0 and 1: the device's share of the host layers' rows.
pub const HOST_ROWS_ON_GPU_ENV: &str = "ROCMFORGE_HOST_ROWS_ON_GPU";
/// A count: a mixture of experts' link slots a layer over budget.
pub const EXPERT_LINK_SLOTS_ENV: &str = "ROCMFORGE_EXPERT_LINK_SLOTS";
/// Set to `0`, a mixture of experts over budget reads no missed expert in place.
pub const EXPERTS_IN_PLACE_ENV: &str = "ROCMFORGE_EXPERTS_IN_PLACE";
/// `region` or `separate`: how the upload's staging buffers are allocated.
pub const STAGING_RING_ENV: &str = "ROCMFORGE_STAGING_RING";

/// Every setting of the table above.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tuning {
    /// For [`dequant::matmul::set_avx512_allowed`].
    pub cpu_avx512: bool,
    /// For [`hip_backend::set_chained_launch`].
    pub chained_launch: bool,
    /// For [`model::gpu::GpuOptions::tuning`].
    pub gpu: GpuTuning,
}

impl Default for Tuning {
    /// The libraries' own defaults.
    fn default() -> Tuning {
        Tuning {
            cpu_avx512: true,
            chained_launch: true,
            gpu: GpuTuning::default(),
        }
    }
}

impl Tuning {
    /// The settings the variables give, `var` returning a variable's value (`None` when
    /// it is unset): a switch is off only when its variable is `0`; a value that is not
    /// one of a setting's is logged and leaves the default.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Tuning {
        let mut tuning = Tuning::default();
        if switched_off(var(CPU_AVX512_ENV)) {
            tuning.cpu_avx512 = false;
        }
        if switched_off(var(CHAINED_LAUNCH_ENV)) {
            tuning.chained_launch = false;
        }
        if switched_off(var(FLASH_MMA_ENV)) {
            tuning.gpu.flash_mma = false;
        }
        if switched_off(var(WARP_ATTENTION_ENV)) {
            tuning.gpu.warp_attention = false;
        }
        if switched_off(var(INT8_PROMPTS_ENV)) {
            tuning.gpu.int8_prompts = false;
        }
        if let Some(value) = var(HOST_ROWS_ON_GPU_ENV) {
            match parse_share(&value) {
                Ok(share) => tuning.gpu.host_rows_share = Some(share),
                Err(_) => {
                    tracing::warn!(%value, "{HOST_ROWS_ON_GPU_ENV} is not a share between 0 and 1");
                }
            }
        }
        if let Some(value) = var(EXPERT_LINK_SLOTS_ENV) {
            match value.trim().parse::<usize>() {
                Ok(slots) => tuning.gpu.expert_link_slots = Some(slots),
                Err(_) => {
                    tracing::warn!(%value, "{EXPERT_LINK_SLOTS_ENV} is not a count of slots");
                }
            }
        }
        if switched_off(var(EXPERTS_IN_PLACE_ENV)) {
            tuning.gpu.experts_in_place = false;
        }
        if let Some(value) = var(STAGING_RING_ENV) {
            match StagingRing::parse(&value) {
                Some(ring) => tuning.gpu.staging_ring = ring,
                None if value.trim().is_empty() => {}
                None => tracing::warn!(
                    %value,
                    "{STAGING_RING_ENV} is neither `region` nor `separate`: using the regions"
                ),
            }
        }
        tuning
    }

    /// Hands the process-wide settings to the libraries ([`Tuning::cpu_avx512`],
    /// [`Tuning::chained_launch`]). Call it once, before the first product or kernel.
    pub fn apply_process_wide(&self) {
        dequant::matmul::set_avx512_allowed(self.cpu_avx512);
        hip_backend::set_chained_launch(self.chained_launch);
    }
}

/// Whether a switch's variable turns it off: only `0` does.
fn switched_off(value: Option<String>) -> bool {
    value.is_some_and(|value| value == "0")
}

/// A share between 0 and 1 (surrounding white space ignored).
pub fn parse_share(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(share) if (0.0..=1.0).contains(&share) => Ok(share),
        _ => Err(format!("expected a share between 0 and 1, got {text:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(vars: &[(&str, &str)]) -> Tuning {
        Tuning::from_vars(|name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn no_variable_leaves_the_libraries_defaults() {
        let tuning = from(&[]);
        assert_eq!(tuning, Tuning::default());
        assert!(tuning.cpu_avx512);
        assert!(tuning.chained_launch);
        assert!(tuning.gpu.flash_mma);
        assert!(tuning.gpu.warp_attention);
        assert!(tuning.gpu.int8_prompts);
        assert_eq!(tuning.gpu.staging_ring, StagingRing::Region);
        assert_eq!(tuning.gpu.host_rows_share, None);
        assert!(tuning.gpu.experts_in_place);
    }

    #[test]
    fn each_variable_sets_its_option() {
        let tuning = from(&[
            (CPU_AVX512_ENV, "0"),
            (CHAINED_LAUNCH_ENV, "0"),
            (FLASH_MMA_ENV, "0"),
            (INT8_PROMPTS_ENV, "0"),
            (WARP_ATTENTION_ENV, "0"),
            (STAGING_RING_ENV, "separate"),
            (HOST_ROWS_ON_GPU_ENV, " 0.25\n"),
            (EXPERT_LINK_SLOTS_ENV, "2"),
            (EXPERTS_IN_PLACE_ENV, "0"),
        ]);
        assert!(!tuning.cpu_avx512);
        assert!(!tuning.chained_launch);
        assert!(!tuning.gpu.flash_mma);
        assert!(!tuning.gpu.warp_attention);
        assert!(!tuning.gpu.int8_prompts);
        assert_eq!(tuning.gpu.staging_ring, StagingRing::Separate);
        assert_eq!(tuning.gpu.host_rows_share, Some(0.25));
        assert_eq!(tuning.gpu.expert_link_slots, Some(2));
        assert!(!tuning.gpu.experts_in_place);
    }

    #[test]
    fn values_outside_a_settings_range_leave_its_default() {
        // A switch is off only for `0`, as it always was.
        let tuning = from(&[
            (CPU_AVX512_ENV, "1"),
            (CHAINED_LAUNCH_ENV, "off"),
            (FLASH_MMA_ENV, ""),
            (STAGING_RING_ENV, "rings"),
            (HOST_ROWS_ON_GPU_ENV, "1.5"),
            (EXPERTS_IN_PLACE_ENV, "no"),
        ]);
        assert_eq!(tuning, Tuning::default());
        assert_eq!(from(&[(STAGING_RING_ENV, " ")]), Tuning::default());
        assert_eq!(from(&[(HOST_ROWS_ON_GPU_ENV, "half")]), Tuning::default());
        assert_eq!(from(&[(EXPERT_LINK_SLOTS_ENV, "-1")]), Tuning::default());
        assert_eq!(from(&[(EXPERT_LINK_SLOTS_ENV, "four")]), Tuning::default());
        assert_eq!(parse_share("0"), Ok(0.0));
        assert_eq!(parse_share("1"), Ok(1.0));
        assert!(parse_share("NaN").is_err());
        assert!(parse_share("-0.1").is_err());
    }
}
