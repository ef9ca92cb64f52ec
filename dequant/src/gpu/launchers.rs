//! The product launchers of each weight type. `kernels/matmul.hip` and
//! `kernels/matvec.hip` are built once per type (build.rs, `PRODUCT_TYPES`), each unit a
//! device module of its own with launchers named after its type: the runtimes load a
//! module whole at the first use of any of its kernels, so a model loads only its own
//! types' products. This table maps a [`GgmlType`] to its unit's launchers.

use std::ffi::{c_int, c_void};

use gguf_format::GgmlType;

/// Declares each launcher signature once: a function-pointer type, a field of
/// [`Launchers`], and the launcher of every type's unit (`rf_FIELD_NAME`, e.g.
/// `rf_matvec_load_q4_k`), with the table from type to launchers. Keep the types in step
/// with `PRODUCT_TYPES` in build.rs: a type missing on either side fails the link.
macro_rules! product_launchers {
    ($signatures:tt types { $($ty:ident => $name:literal,)* }) => {
        product_launchers!(@types $signatures);
        $(product_launchers!(@unit $ty $name $signatures);)*

        /// The launchers of `ty`'s products; None for a type without products.
        pub(super) fn launchers(ty: GgmlType) -> Option<Launchers> {
            match ty {
                $(GgmlType::$ty => Some(product_launchers!(@table $ty $signatures)),)*
                _ => None,
            }
        }
    };
    (@types { $($(#[doc = $doc:literal])* $field:ident: $alias:ident = fn $args:tt;)* }) => {
        $(
            $(#[doc = $doc])*
            pub(super) type $alias = unsafe extern "C" fn $args -> c_int;
        )*

        /// One weight type's product launchers.
        #[derive(Clone, Copy)]
        pub(super) struct Launchers {
            $(pub(super) $field: $alias,)*
        }
    };
    (@unit $ty:ident $name:literal
        { $($(#[doc = $doc:literal])* $field:ident: $alias:ident = fn $args:tt;)* }) => {
        /// The launchers of one type's unit.
        #[allow(non_snake_case)]
        mod $ty {
            use std::ffi::{c_int, c_void};

            extern "C" {
                $(
                    #[allow(clippy::too_many_arguments)]
                    #[link_name = concat!("rf_", stringify!($field), "_", $name)]
                    pub(super) fn $field $args -> c_int;
                )*
            }
        }
    };
    (@table $ty:ident { $($(#[doc = $doc:literal])* $field:ident: $alias:ident = fn $args:tt;)* }) => {
        Launchers { $($field: $ty::$field,)* }
    };
}

product_launchers! {
    {
        /// `rf_matmul_NAME` (see `kernels/matmul.hip`).
        matmul: MatmulFn = fn(
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
        );
        /// `rf_matvec_NAME` (see `kernels/matvec.hip`).
        matvec: MatvecFn = fn(
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
        );
        /// `rf_matvec_load_NAME` (see `kernels/matvec.hip`).
        matvec_load: MatvecLoadFn = fn(n_cols: c_int, n_tokens: c_int, device: c_int);
        /// `rf_matvec_experts_NAME` (see `kernels/matvec_experts.hip`).
        matvec_experts: MatvecExpertsFn = fn(
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
        );
        /// `rf_matvec_experts_sum_NAME` (see `kernels/matvec_experts.hip`).
        matvec_experts_sum: MatvecExpertsSumFn = fn(
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
        );
        /// `rf_matmul_experts_NAME` (see `kernels/matmul.hip`).
        matmul_experts: MatmulExpertsFn = fn(
            weights: *const *const c_void,
            outs: *const *mut c_void,
            n_mats: c_int,
            rows: c_int,
            cols: c_int,
            expert_bytes: usize,
            experts: c_int,
            tiles: *const c_void,
            n_tiles: c_int,
            tile_tokens: c_int,
            order: *const c_void,
            slot_div: c_int,
            x16: *const c_void,
            scales: *const c_void,
            device: c_int,
            stream: *mut c_void,
        );
        /// `rf_matmul_q8k_NAME` (see `kernels/matmul.hip`).
        matmul_q8k: MatmulQ8kFn = fn(
            weights: *const *const c_void,
            outs: *const *mut c_void,
            rows: *const c_int,
            n_mats: c_int,
            cols: c_int,
            xq: *const c_void,
            n_tokens: c_int,
            accumulate: c_int,
            partials: *mut c_void,
            partial_floats: i64,
            counters: *mut c_void,
            n_counters: c_int,
            device: c_int,
            stream: *mut c_void,
        );
        /// `rf_matmul_experts_q8_NAME` (see `kernels/matmul.hip`).
        matmul_experts_q8: MatmulExpertsQ8Fn = fn(
            weights: *const *const c_void,
            outs: *const *mut c_void,
            n_mats: c_int,
            rows: c_int,
            cols: c_int,
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
        );
    }
    types {
        F32 => "f32",
        F16 => "f16",
        BF16 => "bf16",
        Q4_0 => "q4_0",
        Q4_1 => "q4_1",
        Q5_0 => "q5_0",
        Q5_1 => "q5_1",
        Q8_0 => "q8_0",
        Q2_K => "q2_k",
        Q3_K => "q3_k",
        Q4_K => "q4_k",
        Q5_K => "q5_k",
        Q6_K => "q6_k",
        IQ2_XXS => "iq2_xxs",
        IQ2_XS => "iq2_xs",
        IQ2_S => "iq2_s",
        IQ3_XXS => "iq3_xxs",
        IQ3_S => "iq3_s",
        IQ1_S => "iq1_s",
        IQ1_M => "iq1_m",
        IQ4_NL => "iq4_nl",
        IQ4_XS => "iq4_xs",
        MXFP4 => "mxfp4",
    }
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
