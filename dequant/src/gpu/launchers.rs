//! The product launchers of each weight type. `kernels/matmul.hip` and
//! `kernels/matvec.hip` are built once per type (build.rs, `PRODUCT_TYPES`), each unit a
//! device module of its own with launchers named after its type: the runtimes load a
//! module whole at the first use of any of its kernels, so a model loads only its own
//! types' products. This table maps a [`GgmlType`] to its unit's launchers.

use std::ffi::{c_int, c_void};

use gguf_format::GgmlType;

/// `rf_matmul_NAME` (see `kernels/matmul.hip`).
pub(super) type MatmulFn = unsafe extern "C" fn(
    weights: *const *const c_void,
    outs: *const *mut c_void,
    rows: *const c_int,
    n_mats: c_int,
    cols: c_int,
    x16: *const c_void,
    scales: *const c_void,
    n_tokens: c_int,
    accumulate: c_int,
    partials: *mut c_void,
    partial_floats: i64,
    counters: *mut c_void,
    n_counters: c_int,
    kernel: c_int,
    device: c_int,
    stream: *mut c_void,
) -> c_int;

/// `rf_matvec_NAME` (see `kernels/matvec.hip`).
pub(super) type MatvecFn = unsafe extern "C" fn(
    weights: *const *const c_void,
    outs: *const *mut c_void,
    rows: *const c_int,
    n_mats: c_int,
    n_cols: c_int,
    x: *const c_void,
    n_tokens: c_int,
    accumulate: c_int,
    device: c_int,
    stream: *mut c_void,
) -> c_int;

/// `rf_matvec_load_NAME` (see `kernels/matvec.hip`).
pub(super) type MatvecLoadFn =
    unsafe extern "C" fn(n_cols: c_int, n_tokens: c_int, device: c_int) -> c_int;

/// `rf_matvec_experts_NAME` (see `kernels/matvec.hip`).
pub(super) type MatvecExpertsFn = unsafe extern "C" fn(
    weights: *const *const c_void,
    outs: *const *mut c_void,
    n_mats: c_int,
    rows: c_int,
    n_cols: c_int,
    expert_bytes: usize,
    tiles: *const c_void,
    n_tiles: c_int,
    tile_tokens: c_int,
    order: *const c_void,
    slot_div: c_int,
    xq: *const c_void,
    n_x: c_int,
    device: c_int,
    stream: *mut c_void,
) -> c_int;

/// `rf_matvec_experts_sum_NAME` (see `kernels/matvec.hip`).
pub(super) type MatvecExpertsSumFn = unsafe extern "C" fn(
    weights: *const c_void,
    expert_bytes: usize,
    rows: c_int,
    n_cols: c_int,
    ids: *const c_void,
    slot_weights: *const c_void,
    k: c_int,
    n_tokens: c_int,
    xq: *const c_void,
    n_x: c_int,
    out: *mut c_void,
    device: c_int,
    stream: *mut c_void,
) -> c_int;

/// `rf_matmul_experts_NAME` (see `kernels/matmul.hip`).
pub(super) type MatmulExpertsFn = unsafe extern "C" fn(
    weights: *const *const c_void,
    outs: *const *mut c_void,
    n_mats: c_int,
    rows: c_int,
    cols: c_int,
    expert_bytes: usize,
    experts: c_int,
    tiles: *const c_void,
    n_tiles: c_int,
    order: *const c_void,
    slot_div: c_int,
    x16: *const c_void,
    scales: *const c_void,
    device: c_int,
    stream: *mut c_void,
) -> c_int;

/// One weight type's product launchers.
#[derive(Clone, Copy)]
pub(super) struct Launchers {
    pub(super) matmul: MatmulFn,
    pub(super) matvec: MatvecFn,
    pub(super) matvec_load: MatvecLoadFn,
    pub(super) matvec_experts: MatvecExpertsFn,
    pub(super) matvec_experts_sum: MatvecExpertsSumFn,
    pub(super) matmul_experts: MatmulExpertsFn,
}

/// Declares every type's launchers and the table from type to launchers. Keep in step
/// with `PRODUCT_TYPES` in build.rs: a type missing on either side fails the link.
macro_rules! product_launchers {
    ($($ty:ident => $matmul:ident, $matvec:ident, $matvec_load:ident, $experts:ident,
        $experts_sum:ident, $mm_experts:ident;)*) => {
        extern "C" {
            $(
                #[allow(clippy::too_many_arguments)]
                fn $matmul(
                    weights: *const *const c_void,
                    outs: *const *mut c_void,
                    rows: *const c_int,
                    n_mats: c_int,
                    cols: c_int,
                    x16: *const c_void,
                    scales: *const c_void,
                    n_tokens: c_int,
                    accumulate: c_int,
                    partials: *mut c_void,
                    partial_floats: i64,
                    counters: *mut c_void,
                    n_counters: c_int,
                    kernel: c_int,
                    device: c_int,
                    stream: *mut c_void,
                ) -> c_int;
                #[allow(clippy::too_many_arguments)]
                fn $matvec(
                    weights: *const *const c_void,
                    outs: *const *mut c_void,
                    rows: *const c_int,
                    n_mats: c_int,
                    n_cols: c_int,
                    x: *const c_void,
                    n_tokens: c_int,
                    accumulate: c_int,
                    device: c_int,
                    stream: *mut c_void,
                ) -> c_int;
                fn $matvec_load(n_cols: c_int, n_tokens: c_int, device: c_int) -> c_int;
                #[allow(clippy::too_many_arguments)]
                fn $experts(
                    weights: *const *const c_void,
                    outs: *const *mut c_void,
                    n_mats: c_int,
                    rows: c_int,
                    n_cols: c_int,
                    expert_bytes: usize,
                    tiles: *const c_void,
                    n_tiles: c_int,
                    tile_tokens: c_int,
                    order: *const c_void,
                    slot_div: c_int,
                    xq: *const c_void,
                    n_x: c_int,
                    device: c_int,
                    stream: *mut c_void,
                ) -> c_int;
                #[allow(clippy::too_many_arguments)]
                fn $experts_sum(
                    weights: *const c_void,
                    expert_bytes: usize,
                    rows: c_int,
                    n_cols: c_int,
                    ids: *const c_void,
                    slot_weights: *const c_void,
                    k: c_int,
                    n_tokens: c_int,
                    xq: *const c_void,
                    n_x: c_int,
                    out: *mut c_void,
                    device: c_int,
                    stream: *mut c_void,
                ) -> c_int;
                #[allow(clippy::too_many_arguments)]
                fn $mm_experts(
                    weights: *const *const c_void,
                    outs: *const *mut c_void,
                    n_mats: c_int,
                    rows: c_int,
                    cols: c_int,
                    expert_bytes: usize,
                    experts: c_int,
                    tiles: *const c_void,
                    n_tiles: c_int,
                    order: *const c_void,
                    slot_div: c_int,
                    x16: *const c_void,
                    scales: *const c_void,
                    device: c_int,
                    stream: *mut c_void,
                ) -> c_int;
            )*
        }

        /// The launchers of `ty`'s products; None for a type without products.
        pub(super) fn launchers(ty: GgmlType) -> Option<Launchers> {
            match ty {
                $(GgmlType::$ty => Some(Launchers {
                    matmul: $matmul,
                    matvec: $matvec,
                    matvec_load: $matvec_load,
                    matvec_experts: $experts,
                    matvec_experts_sum: $experts_sum,
                    matmul_experts: $mm_experts,
                }),)*
                _ => None,
            }
        }
    };
}

product_launchers! {
    F32 => rf_matmul_f32, rf_matvec_f32, rf_matvec_load_f32, rf_matvec_experts_f32,
        rf_matvec_experts_sum_f32, rf_matmul_experts_f32;
    F16 => rf_matmul_f16, rf_matvec_f16, rf_matvec_load_f16, rf_matvec_experts_f16,
        rf_matvec_experts_sum_f16, rf_matmul_experts_f16;
    BF16 => rf_matmul_bf16, rf_matvec_bf16, rf_matvec_load_bf16, rf_matvec_experts_bf16,
        rf_matvec_experts_sum_bf16, rf_matmul_experts_bf16;
    Q4_0 => rf_matmul_q4_0, rf_matvec_q4_0, rf_matvec_load_q4_0, rf_matvec_experts_q4_0,
        rf_matvec_experts_sum_q4_0, rf_matmul_experts_q4_0;
    Q4_1 => rf_matmul_q4_1, rf_matvec_q4_1, rf_matvec_load_q4_1, rf_matvec_experts_q4_1,
        rf_matvec_experts_sum_q4_1, rf_matmul_experts_q4_1;
    Q5_0 => rf_matmul_q5_0, rf_matvec_q5_0, rf_matvec_load_q5_0, rf_matvec_experts_q5_0,
        rf_matvec_experts_sum_q5_0, rf_matmul_experts_q5_0;
    Q5_1 => rf_matmul_q5_1, rf_matvec_q5_1, rf_matvec_load_q5_1, rf_matvec_experts_q5_1,
        rf_matvec_experts_sum_q5_1, rf_matmul_experts_q5_1;
    Q8_0 => rf_matmul_q8_0, rf_matvec_q8_0, rf_matvec_load_q8_0, rf_matvec_experts_q8_0,
        rf_matvec_experts_sum_q8_0, rf_matmul_experts_q8_0;
    Q2_K => rf_matmul_q2_k, rf_matvec_q2_k, rf_matvec_load_q2_k, rf_matvec_experts_q2_k,
        rf_matvec_experts_sum_q2_k, rf_matmul_experts_q2_k;
    Q3_K => rf_matmul_q3_k, rf_matvec_q3_k, rf_matvec_load_q3_k, rf_matvec_experts_q3_k,
        rf_matvec_experts_sum_q3_k, rf_matmul_experts_q3_k;
    Q4_K => rf_matmul_q4_k, rf_matvec_q4_k, rf_matvec_load_q4_k, rf_matvec_experts_q4_k,
        rf_matvec_experts_sum_q4_k, rf_matmul_experts_q4_k;
    Q5_K => rf_matmul_q5_k, rf_matvec_q5_k, rf_matvec_load_q5_k, rf_matvec_experts_q5_k,
        rf_matvec_experts_sum_q5_k, rf_matmul_experts_q5_k;
    Q6_K => rf_matmul_q6_k, rf_matvec_q6_k, rf_matvec_load_q6_k, rf_matvec_experts_q6_k,
        rf_matvec_experts_sum_q6_k, rf_matmul_experts_q6_k;
    IQ2_XXS => rf_matmul_iq2_xxs, rf_matvec_iq2_xxs, rf_matvec_load_iq2_xxs, rf_matvec_experts_iq2_xxs,
        rf_matvec_experts_sum_iq2_xxs, rf_matmul_experts_iq2_xxs;
    IQ2_XS => rf_matmul_iq2_xs, rf_matvec_iq2_xs, rf_matvec_load_iq2_xs, rf_matvec_experts_iq2_xs,
        rf_matvec_experts_sum_iq2_xs, rf_matmul_experts_iq2_xs;
    IQ2_S => rf_matmul_iq2_s, rf_matvec_iq2_s, rf_matvec_load_iq2_s, rf_matvec_experts_iq2_s,
        rf_matvec_experts_sum_iq2_s, rf_matmul_experts_iq2_s;
    IQ3_XXS => rf_matmul_iq3_xxs, rf_matvec_iq3_xxs, rf_matvec_load_iq3_xxs, rf_matvec_experts_iq3_xxs,
        rf_matvec_experts_sum_iq3_xxs, rf_matmul_experts_iq3_xxs;
    IQ3_S => rf_matmul_iq3_s, rf_matvec_iq3_s, rf_matvec_load_iq3_s, rf_matvec_experts_iq3_s,
        rf_matvec_experts_sum_iq3_s, rf_matmul_experts_iq3_s;
    IQ1_S => rf_matmul_iq1_s, rf_matvec_iq1_s, rf_matvec_load_iq1_s, rf_matvec_experts_iq1_s,
        rf_matvec_experts_sum_iq1_s, rf_matmul_experts_iq1_s;
    IQ1_M => rf_matmul_iq1_m, rf_matvec_iq1_m, rf_matvec_load_iq1_m, rf_matvec_experts_iq1_m,
        rf_matvec_experts_sum_iq1_m, rf_matmul_experts_iq1_m;
    IQ4_NL => rf_matmul_iq4_nl, rf_matvec_iq4_nl, rf_matvec_load_iq4_nl, rf_matvec_experts_iq4_nl,
        rf_matvec_experts_sum_iq4_nl, rf_matmul_experts_iq4_nl;
    IQ4_XS => rf_matmul_iq4_xs, rf_matvec_iq4_xs, rf_matvec_load_iq4_xs, rf_matvec_experts_iq4_xs,
        rf_matvec_experts_sum_iq4_xs, rf_matmul_experts_iq4_xs;
    MXFP4 => rf_matmul_mxfp4, rf_matvec_mxfp4, rf_matvec_load_mxfp4, rf_matvec_experts_mxfp4,
        rf_matvec_experts_sum_mxfp4, rf_matmul_experts_mxfp4;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every type the GPU multiplies has its unit's launchers, and no other.
    #[test]
    fn every_gpu_type_has_launchers() {
        for ty in GgmlType::ALL {
            assert_eq!(
                launchers(ty).is_some(),
                super::super::matvec::is_supported_on_gpu(ty),
                "{ty}"
            );
        }
    }
}
