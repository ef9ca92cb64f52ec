//! The launchers of the transformer kernels (`kernels/*.hip`) and one typed wrapper each,
//! in a file per kernel file (`kernels/rows.rs` for `kernels/rows.hip`, …), re-exported
//! here; the shapes and checks they share are here too. A wrapper is its
//! launcher's only caller: it checks every length against the shapes it is given and
//! that every view lives on the stream's device, then queues the kernel. Built without
//! GPU support, each returns [`HipError::BuiltWithoutGpu`] after its checks.
//!
//! [`CacheView`]s hold the KV cache; `q8` views hold Q8 activation blocks
//! (`dequant::gpu::matvec::q8_bytes`).

use dequant::gpu::matvec::q8_bytes;
use gguf_format::GgmlType;
use hip_backend::{DeviceView, DeviceViewMut, HipError, Stream};

use crate::kv_type::KvType;

pub use crate::error::{KernelError, ShapeError};

/// A soft cap as the kernels take it: the cap, or 0 for none; a cap that is not a
/// positive number is refused.
fn soft_cap(kernel: &'static str, cap: Option<f32>) -> Result<f32, KernelError> {
    match cap {
        None => Ok(0.0),
        Some(c) if c.is_finite() && c > 0.0 => Ok(c),
        Some(value) => Err(KernelError::NotPositive {
            kernel,
            what: "the soft cap",
            value,
        }),
    }
}

fn expect(
    kernel: &'static str,
    what: &'static str,
    actual: usize,
    expected: usize,
) -> Result<(), ShapeError> {
    if actual == expected {
        Ok(())
    } else {
        Err(ShapeError {
            kernel,
            what,
            expected,
            actual,
        })
    }
}

fn expect_at_least(
    kernel: &'static str,
    what: &'static str,
    actual: usize,
    expected: usize,
) -> Result<(), ShapeError> {
    if actual >= expected {
        Ok(())
    } else {
        Err(ShapeError {
            kernel,
            what,
            expected,
            actual,
        })
    }
}

fn on_device(stream: &Stream, ordinals: &[usize]) -> Result<i32, HipError> {
    let expected = stream.device_ordinal();
    if let Some(&found) = ordinals.iter().find(|&&o| o != expected) {
        return Err(HipError::DeviceMismatch {
            what: "a kernel argument",
            expected,
            found,
        });
    }
    i32::try_from(expected).map_err(|_| HipError::InvalidDevice {
        ordinal: expected,
        count: i32::MAX as usize,
    })
}

fn small(kernel: &'static str, what: &'static str, value: usize) -> Result<i32, ShapeError> {
    i32::try_from(value).map_err(|_| ShapeError {
        kernel,
        what,
        expected: i32::MAX as usize,
        actual: value,
    })
}

/// The element type of a norm vector, as the kernels take it (ggml's numbering).
pub fn norm_type_code(ty: GgmlType) -> Option<i32> {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => Some(ty as u32 as i32),
        _ => None,
    }
}

fn element_bytes(type_code: i32) -> usize {
    if type_code == 0 {
        4
    } else {
        2
    }
}

/// A norm vector: raw bytes of `len` F32, F16 or BF16 values.
#[derive(Clone, Copy)]
pub struct NormWeight<'a> {
    pub bytes: DeviceView<'a, u8>,
    pub type_code: i32,
    pub len: usize,
}

impl NormWeight<'_> {
    fn check(&self, kernel: &'static str, len: usize) -> Result<(), ShapeError> {
        expect(kernel, "the norm weight", self.len, len)?;
        expect(
            kernel,
            "the norm weight's bytes",
            self.bytes.len(),
            len * element_bytes(self.type_code),
        )
    }
}

#[cfg(not(hip_platform = "none"))]
mod sys {
    use std::ffi::{c_int, c_void};
    extern "C" {
        pub(super) fn rf_rms_norm(
            x: *mut c_void,
            w: *const c_void,
            w_type: c_int,
            n_tokens: c_int,
            dim: c_int,
            eps: f32,
            out: *mut c_void,
            add: c_int,
            out_q8: *mut c_void,
            slot_y: *const c_void,
            slot_w: *const c_void,
            used: c_int,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_rms_norm_router(
            x: *const c_void,
            w: *const c_void,
            w_type: c_int,
            n_tokens: c_int,
            dim: c_int,
            eps: f32,
            router: *const c_void,
            n_experts: c_int,
            logits: *mut c_void,
            out: *mut c_void,
            out_q8: *mut c_void,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_qk_rope_kv(
            q: *mut c_void,
            k: *const c_void,
            v: *const c_void,
            bq: *const c_void,
            bk: *const c_void,
            bv: *const c_void,
            q_norm: *const c_void,
            k_norm: *const c_void,
            norm_type: c_int,
            n_tokens: c_int,
            head_dim: c_int,
            head_dim_v: c_int,
            n_heads: c_int,
            n_kv_heads: c_int,
            rope_dims: c_int,
            neox: c_int,
            theta_scale: f32,
            freq_scale: f32,
            attn_factor: f32,
            freq_factors: *const c_void,
            q_scale: f32,
            eps: f32,
            yarn_low: f32,
            yarn_high: f32,
            ext_factor: f32,
            pos: *const c_void,
            positions: *const c_void,
            table_start: *const c_void,
            tables: *const c_void,
            shift: c_int,
            k_cache: *mut c_void,
            v_cache: *mut c_void,
            k_type: c_int,
            v_type: c_int,
            cache_positions: c_int,
            k_rot: c_int,
            v_rot: c_int,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_attention(
            q: *const c_void,
            k_cache: *const c_void,
            v_cache: *const c_void,
            k_type: c_int,
            v_type: c_int,
            cache_positions: c_int,
            v_rot: c_int,
            n_tokens: c_int,
            n_heads: c_int,
            n_kv_heads: c_int,
            head_dim: c_int,
            head_dim_v: c_int,
            window: c_int,
            scale: f32,
            softcap: f32,
            sinks: *const c_void,
            n_chunks: c_int,
            chunk: c_int,
            pos: *const c_void,
            positions: *const c_void,
            table_start: *const c_void,
            tables: *const c_void,
            shift: c_int,
            part_ml: *mut c_void,
            part_acc: *mut c_void,
            done: *mut c_void,
            out: *mut c_void,
            out_q8: *mut c_void,
            warps: c_int,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_flash_attention(
            q: *const c_void,
            k_cache: *const c_void,
            v_cache: *const c_void,
            k_type: c_int,
            v_type: c_int,
            cache_positions: c_int,
            n_tokens: c_int,
            n_heads: c_int,
            n_kv_heads: c_int,
            head_dim: c_int,
            head_dim_v: c_int,
            window: c_int,
            scale: f32,
            softcap: f32,
            sinks: *const c_void,
            pos: *const c_void,
            table: *const c_void,
            shift: c_int,
            out: *mut c_void,
            allow_mma: c_int,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_moe_route(
            logits: *const c_void,
            bias: *const c_void,
            n_tokens: c_int,
            n_experts: c_int,
            k: c_int,
            gating: c_int,
            renorm: c_int,
            ids: *mut c_void,
            weights: *mut c_void,
            tiles: *mut c_void,
            order: *mut c_void,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_moe_router_route_available(device: c_int) -> c_int;
        pub(super) fn rf_moe_router_route(
            x: *const c_void,
            norm_w: *const c_void,
            w_type: c_int,
            dim: c_int,
            eps: f32,
            router: *const c_void,
            bias: *const c_void,
            n_experts: c_int,
            k: c_int,
            gating: c_int,
            renorm: c_int,
            logits: *mut c_void,
            out: *mut c_void,
            out_q8: *mut c_void,
            ids: *mut c_void,
            weights: *mut c_void,
            tiles: *mut c_void,
            order: *mut c_void,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_moe_tiles(
            ids: *const c_void,
            n_slots: c_int,
            n_experts: c_int,
            tile_tokens: c_int,
            max_tiles: c_int,
            tiles: *mut c_void,
            order: *mut c_void,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_moe_stage(
            ids: *const c_void,
            n_slots: c_int,
            tables: *const c_void,
            n_mats: c_int,
            count: c_int,
            mat_bytes: *const usize,
            mat_at: *const usize,
            room: usize,
            lo: u64,
            hi: u64,
            staged: *mut c_void,
            pass: *mut c_void,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_moe_combine(
            y: *const c_void,
            w: *const c_void,
            n_tokens: c_int,
            k: c_int,
            d: c_int,
            shared: *const c_void,
            shared_gate: *const c_void,
            bias: *const c_void,
            ids: *const c_void,
            n_bias_rows: c_int,
            x: *mut c_void,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_gated(
            gate: *const c_void,
            up: *const c_void,
            n: usize,
            act_kind: c_int,
            out: *mut c_void,
            out_q8: *mut c_void,
            gate_bias: *const c_void,
            up_bias: *const c_void,
            ids: *const c_void,
            width: c_int,
            n_bias_rows: c_int,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_add_bias(
            x: *mut c_void,
            n: usize,
            width: c_int,
            bias: *const c_void,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_gather_rows(
            table: *const c_void,
            row_bytes: usize,
            n_rows: usize,
            tokens: *const c_void,
            n_tokens: c_int,
            out: *mut c_void,
            bad: *mut c_void,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_scale(
            x: *mut c_void,
            n: usize,
            s: f32,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_hadamard64(
            x: *mut c_void,
            n: usize,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_softcap(
            x: *mut c_void,
            n: usize,
            cap: f32,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_argmax(
            x: *const c_void,
            n: c_int,
            n_rows: c_int,
            token: *mut c_void,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_add_at(
            x: *mut c_void,
            at: *const c_void,
            values: *const c_void,
            count: c_int,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_mask_rows(
            x: *mut c_void,
            n: c_int,
            rows: *const c_void,
            words: *const c_void,
            n_words: c_int,
            n_masks: c_int,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_select_rows(
            src: *const c_void,
            dim: c_int,
            rows: *const c_void,
            n_rows: c_int,
            dst: *mut c_void,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_advance(
            pos: *mut c_void,
            n: c_int,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
    }
}

/// Queues a launcher call: on a GPU build, the unsafe call and its status; without GPU
/// support, [`HipError::BuiltWithoutGpu`].
macro_rules! launch {
    ($name:ident, $what:literal, $($arg:expr),* $(,)?) => {{
        #[cfg(not(hip_platform = "none"))]
        {
            // SAFETY: the wrapper checked, just before, that every view holds what the
            // kernel reads or writes for the shapes passed (see each wrapper's docs) and
            // lives on the stream's device; the views borrow device memory that stays
            // allocated while the kernel is queued (the runtime's free waits for queued
            // work); the stream handle is live while `stream` is borrowed.
            let status = unsafe { sys::$name($($arg),*) };
            hip_backend::check_status(stringify!($name), status).map_err(KernelError::from)
        }
        #[cfg(hip_platform = "none")]
        {
            let _ = ($($arg),*);
            Err(KernelError::Hip(HipError::BuiltWithoutGpu))
        }
    }};
}

fn ptr_or_null<T: bytemuck::Pod>(view: Option<DeviceView<'_, T>>) -> *const std::ffi::c_void {
    view.map_or(std::ptr::null(), |v| v.as_ptr())
}

/// The paged layout of a batch of tokens from several sequences: token `t` is at
/// position `positions[t]` of the sequence whose block table starts at
/// `tables[table_start[t]]`; key `j` of that sequence lives in cache row
/// `table[j >> block_shift] << block_shift | j % 2^block_shift`.
///
/// The views' lengths are checked by each wrapper; their contents by whoever fills them
/// (the forward pass checks every table against the cache's blocks on the host before
/// it copies them over): every position must be covered by its table, and every block id
/// must lie within the cache.
#[derive(Clone, Copy)]
pub struct Pages<'a> {
    pub positions: DeviceView<'a, i32>,
    pub table_start: DeviceView<'a, i32>,
    pub tables: DeviceView<'a, i32>,
    pub block_shift: u32,
}

impl Pages<'_> {
    fn check(&self, kernel: &'static str, n_tokens: usize) -> Result<[usize; 3], ShapeError> {
        expect(kernel, "the positions", self.positions.len(), n_tokens)?;
        expect(kernel, "the table starts", self.table_start.len(), n_tokens)?;
        expect_at_least(
            kernel,
            "31 bits of block shift",
            31,
            self.block_shift as usize,
        )?;
        Ok([
            self.positions.device_ordinal(),
            self.table_start.device_ordinal(),
            self.tables.device_ordinal(),
        ])
    }

    /// The launchers' four arguments (nulls and 0 for the contiguous layout).
    fn raw(pages: Option<Pages<'_>>) -> [*const std::ffi::c_void; 3] {
        [
            ptr_or_null(pages.map(|p| p.positions)),
            ptr_or_null(pages.map(|p| p.table_start)),
            ptr_or_null(pages.map(|p| p.tables)),
        ]
    }
}

/// One layer's cached keys or values on the device: `positions` rows of `dim` values of
/// type `ty`. f16 rows are `dim` halves; a quantized cache (`Q8_0`, `Q4_0`: `dim` a
/// multiple of 32) holds every row's quants first (a byte a value for `Q8_0`, a nibble
/// for `Q4_0`, values `2i` and `2i + 1` the low and high nibble of byte `i`), then every
/// row's f16 scales, one per block of 32 values: so that a head's quants are one aligned
/// run. The bytes are those of llama.cpp's blocks, laid out for the device.
#[derive(Clone, Copy)]
pub struct CacheView<'a> {
    pub bytes: DeviceView<'a, u8>,
    pub ty: KvType,
    pub positions: usize,
    pub dim: usize,
}

/// As [`CacheView`], to write.
pub struct CacheViewMut<'a> {
    pub bytes: DeviceViewMut<'a, u8>,
    pub ty: KvType,
    pub positions: usize,
    pub dim: usize,
}

/// The kernels' number of a cache type (`kCache*` in `transformer_common.h`).
fn cache_code(ty: KvType) -> i32 {
    match ty {
        KvType::F16 => 0,
        KvType::Q8_0 => 1,
        KvType::Q4_0 => 2,
    }
}

/// Checks a cache's bytes against its shape: `what` names it.
fn check_cache(
    k: &'static str,
    what: &'static str,
    ty: KvType,
    bytes: usize,
    positions: usize,
    dim: usize,
) -> Result<(), ShapeError> {
    if ty.is_quantized() {
        expect(k, "a quantized cache row's width modulo 32", dim % 32, 0)?;
    }
    expect_at_least(k, what, bytes, positions * ty.row_bytes(dim))
}

impl CacheView<'_> {
    fn check(&self, k: &'static str, what: &'static str) -> Result<(), ShapeError> {
        check_cache(k, what, self.ty, self.bytes.len(), self.positions, self.dim)
    }
}

impl CacheViewMut<'_> {
    fn check(&self, k: &'static str, what: &'static str) -> Result<(), ShapeError> {
        check_cache(k, what, self.ty, self.bytes.len(), self.positions, self.dim)
    }
}

/// The checks both attention kernels make of the caches (both of the same positions,
/// at least the shape's, whole rows of every key head) and of the position counter.
fn check_caches(
    k: &'static str,
    s: &AttentionShape,
    k_cache: &CacheView<'_>,
    v_cache: &CacheView<'_>,
    pos: usize,
) -> Result<(), KernelError> {
    expect_at_least(
        k,
        "positions in the caches",
        k_cache.positions,
        s.positions(),
    )?;
    expect(
        k,
        "positions in the value cache",
        v_cache.positions,
        k_cache.positions,
    )?;
    expect(
        k,
        "the key cache's row",
        k_cache.dim,
        s.n_kv_heads * s.head_dim,
    )?;
    expect(
        k,
        "the value cache's row",
        v_cache.dim,
        s.n_kv_heads * s.head_dim_v,
    )?;
    k_cache.check(k, "the key cache")?;
    v_cache.check(k, "the value cache")?;
    expect(k, "the position", pos, 1)?;
    Ok(())
}

mod attention;
mod experts;
mod flash_attention;
mod norm_rope;
mod rows;

pub use attention::{attention, attention_chunk, hadamard64, AttentionShape};
pub use experts::{
    moe_combine, moe_route, moe_router_route, moe_router_route_fits, moe_stage, moe_tiles,
    stage_room, Gating, Staging, MAX_USED,
};
pub use flash_attention::flash_attention;
pub use norm_rope::{
    qk_rope_kv, rms_norm, rms_norm_router, rms_norm_summed, HeadExtras, HeadShape, SlotSum,
};
pub use rows::{
    add_at, add_bias, advance, argmax, gated, gather_rows, mask_rows, scale, select_rows, softcap,
    GateActivation, GatedBias, SlotBias,
};
