//! The launchers of `kernels/transformer.hip` and `kernels/experts.hip` (whose wrappers
//! are in `kernels/experts.rs`), and one typed wrapper each. A wrapper is its
//! launcher's only caller: it checks every length against the shapes it is given and
//! that every view lives on the stream's device, then queues the kernel. Built without
//! GPU support, each returns [`HipError::BuiltWithoutGpu`] after its checks.
//!
//! Views of `f16` hold the KV cache; `q8` views hold Q8 activation blocks
//! (`dequant::gpu::matvec::q8_bytes`).

use dequant::gpu::matvec::q8_bytes;
use gguf_format::GgmlType;
use half::f16;
use hip_backend::{DeviceView, DeviceViewMut, HipError, Stream};

/// A kernel wrapper was given buffers that do not fit the shapes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{kernel}: {what} holds {actual} elements, expected {expected}")]
pub struct ShapeError {
    pub kernel: &'static str,
    pub what: &'static str,
    pub expected: usize,
    pub actual: usize,
}

/// What a wrapper can fail with.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error(transparent)]
    Shape(#[from] ShapeError),
    #[error(transparent)]
    Hip(#[from] HipError),
    #[error("{kernel}: {what} is {value}, not a positive number")]
    NotPositive {
        kernel: &'static str,
        what: &'static str,
        value: f32,
    },
}

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
            x: *const c_void,
            w: *const c_void,
            w_type: c_int,
            n_tokens: c_int,
            dim: c_int,
            eps: f32,
            out: *mut c_void,
            add: c_int,
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
            pos: *const c_void,
            positions: *const c_void,
            table_start: *const c_void,
            tables: *const c_void,
            shift: c_int,
            k_cache: *mut c_void,
            v_cache: *mut c_void,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_attention(
            q: *const c_void,
            k_cache: *const c_void,
            v_cache: *const c_void,
            n_tokens: c_int,
            n_heads: c_int,
            n_kv_heads: c_int,
            head_dim: c_int,
            head_dim_v: c_int,
            window: c_int,
            scale: f32,
            softcap: f32,
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
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_flash_attention(
            q: *const c_void,
            k_cache: *const c_void,
            v_cache: *const c_void,
            n_tokens: c_int,
            n_heads: c_int,
            n_kv_heads: c_int,
            head_dim: c_int,
            head_dim_v: c_int,
            window: c_int,
            scale: f32,
            softcap: f32,
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
        pub(super) fn rf_moe_combine(
            y: *const c_void,
            w: *const c_void,
            n_tokens: c_int,
            k: c_int,
            d: c_int,
            shared: *const c_void,
            shared_gate: *const c_void,
            x: *mut c_void,
            device: c_int,
            stream: *mut c_void,
        ) -> c_int;
        pub(super) fn rf_gated(
            gate: *const c_void,
            up: *const c_void,
            n: usize,
            gelu: c_int,
            out: *mut c_void,
            out_q8: *mut c_void,
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

/// `out (+)= rms_norm(x) · w` for `n_tokens` rows of `dim`; with `out_q8`, the normed
/// rows (before any add) are also quantized to Q8 blocks (`dim` a multiple of 32).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    x: DeviceView<'_, f32>,
    w: NormWeight<'_>,
    n_tokens: usize,
    dim: usize,
    eps: f32,
    mut out: Option<DeviceViewMut<'_, f32>>,
    add: bool,
    mut out_q8: Option<DeviceViewMut<'_, u8>>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "rms_norm";
    expect(K, "the input", x.len(), n_tokens * dim)?;
    w.check(K, dim)?;
    let mut devices = vec![x.device_ordinal(), w.bytes.device_ordinal()];
    if let Some(o) = &out {
        expect(K, "the output", o.len(), n_tokens * dim)?;
        devices.push(o.device_ordinal());
    }
    if let Some(q) = &out_q8 {
        expect(K, "the Q8 output", q.len(), q8_bytes(n_tokens, dim))?;
        expect(K, "the width modulo 32", dim % 32, 0)?;
        devices.push(q.device_ordinal());
    }
    let device = on_device(stream, &devices)?;
    let (n, d) = (small(K, "tokens", n_tokens)?, small(K, "width", dim)?);
    let out_ptr = out
        .as_mut()
        .map_or(std::ptr::null_mut(), |o| o.as_mut_ptr());
    let q8_ptr = out_q8
        .as_mut()
        .map_or(std::ptr::null_mut(), |o| o.as_mut_ptr());
    launch!(
        rf_rms_norm,
        "rms_norm",
        x.as_ptr(),
        w.bytes.as_ptr(),
        w.type_code,
        n,
        d,
        eps,
        out_ptr,
        i32::from(add),
        q8_ptr,
        device,
        stream.as_raw(),
    )
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

/// Shapes and constants of [`qk_rope_kv`].
#[derive(Clone, Copy, Debug)]
pub struct HeadShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    pub rope_dims: usize,
    pub neox: bool,
    /// `base^(-2/rope_dims)`.
    pub theta_scale: f32,
    /// `1 / rope_scale`.
    pub freq_scale: f32,
    /// Multiplies the rotary cosines and sines (`rope.scaling.attn_factor`; usually 1).
    pub attn_factor: f32,
    /// Multiplies the queries after RoPE (1 when the scores are scaled instead).
    pub q_scale: f32,
    pub eps: f32,
}

/// The optional per-layer vectors of [`qk_rope_kv`].
#[derive(Clone, Copy, Default)]
pub struct HeadExtras<'a> {
    pub bq: Option<DeviceView<'a, f32>>,
    pub bk: Option<DeviceView<'a, f32>>,
    pub bv: Option<DeviceView<'a, f32>>,
    pub q_norm: Option<NormWeight<'a>>,
    pub k_norm: Option<NormWeight<'a>>,
    pub freq_factors: Option<DeviceView<'a, f32>>,
}

/// For `n_tokens` tokens at positions `pos[0]..` (or, with `pages`, at the positions and
/// in the blocks it gives): biases, per-head norms, RoPE (its cosines and sines times
/// `shape.attn_factor`) and the query scale on `q` (in
/// place) and `k`; keys and values (with bias) written to the f16 caches at their
/// positions. The caches must hold those positions.
#[allow(clippy::too_many_arguments)]
pub fn qk_rope_kv(
    mut q: DeviceViewMut<'_, f32>,
    k: DeviceView<'_, f32>,
    v: DeviceView<'_, f32>,
    extras: HeadExtras<'_>,
    shape: &HeadShape,
    n_tokens: usize,
    pos: DeviceView<'_, i32>,
    pages: Option<Pages<'_>>,
    mut k_cache: DeviceViewMut<'_, f16>,
    mut v_cache: DeviceViewMut<'_, f16>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "qk_rope_kv";
    let s = shape;
    let q_dim = s.n_heads * s.head_dim;
    let kv_dim = s.n_kv_heads * s.head_dim;
    let v_dim = s.n_kv_heads * s.head_dim_v;
    expect_at_least(K, "512 values per head", 512, s.head_dim)?;
    expect(K, "the rotated dimensions' parity", s.rope_dims % 2, 0)?;
    expect_at_least(K, "the head's dimensions", s.head_dim, s.rope_dims)?;
    expect(K, "the queries", q.len(), n_tokens * q_dim)?;
    expect(K, "the keys", k.len(), n_tokens * kv_dim)?;
    expect(K, "the values", v.len(), n_tokens * v_dim)?;
    expect(K, "the position", pos.len(), 1)?;
    expect(K, "the key cache's row", k_cache.len() % kv_dim.max(1), 0)?;
    expect(K, "the value cache's row", v_cache.len() % v_dim.max(1), 0)?;
    let mut devices = vec![
        q.device_ordinal(),
        k.device_ordinal(),
        v.device_ordinal(),
        pos.device_ordinal(),
        k_cache.device_ordinal(),
        v_cache.device_ordinal(),
    ];
    if let Some(p) = &pages {
        devices.extend(p.check(K, n_tokens)?);
    }
    for (bias, len, what) in [
        (extras.bq, q_dim, "the query bias"),
        (extras.bk, kv_dim, "the key bias"),
        (extras.bv, v_dim, "the value bias"),
        (
            extras.freq_factors,
            s.rope_dims / 2,
            "the frequency factors",
        ),
    ] {
        if let Some(b) = bias {
            expect(K, what, b.len(), len)?;
            devices.push(b.device_ordinal());
        }
    }
    let mut norm_type = 0;
    for norm in [extras.q_norm, extras.k_norm].into_iter().flatten() {
        norm.check(K, s.head_dim)?;
        norm_type = norm.type_code;
        devices.push(norm.bytes.device_ordinal());
    }
    if let (Some(a), Some(b)) = (extras.q_norm, extras.k_norm) {
        expect(
            K,
            "the norms' element type",
            b.type_code as usize,
            a.type_code as usize,
        )?;
    }
    let device = on_device(stream, &devices)?;
    let c = |what, value| small(K, what, value);
    launch!(
        rf_qk_rope_kv,
        "qk_rope_kv",
        q.as_mut_ptr(),
        k.as_ptr(),
        v.as_ptr(),
        ptr_or_null(extras.bq),
        ptr_or_null(extras.bk),
        ptr_or_null(extras.bv),
        ptr_or_null(extras.q_norm.map(|n| n.bytes)),
        ptr_or_null(extras.k_norm.map(|n| n.bytes)),
        norm_type,
        c("tokens", n_tokens)?,
        c("head width", s.head_dim)?,
        c("value head width", s.head_dim_v)?,
        c("heads", s.n_heads)?,
        c("key heads", s.n_kv_heads)?,
        c("rotated dimensions", s.rope_dims)?,
        i32::from(s.neox),
        s.theta_scale,
        s.freq_scale,
        s.attn_factor,
        ptr_or_null(extras.freq_factors),
        s.q_scale,
        s.eps,
        pos.as_ptr(),
        Pages::raw(pages)[0],
        Pages::raw(pages)[1],
        Pages::raw(pages)[2],
        pages.map_or(0, |p| p.block_shift as i32),
        k_cache.as_mut_ptr(),
        v_cache.as_mut_ptr(),
        device,
        stream.as_raw(),
    )
}

/// Most keys a chunk of [`attention`]'s split along the cache may hold.
pub const MAX_ATTENTION_CHUNK: usize = 256;

/// Keys per chunk of [`attention`] for a cache of `capacity` positions: the smallest of
/// 32, 64, 128 and 256 that splits it into at most 64 chunks. A query is computed by one
/// workgroup per chunk that holds its keys, so small chunks spread a short context over
/// many workgroups, while the merge of a long context's chunks stays short.
pub fn attention_chunk(capacity: usize) -> usize {
    [32, 64, 128]
        .into_iter()
        .find(|&chunk| capacity.div_ceil(chunk) <= 64)
        .unwrap_or(MAX_ATTENTION_CHUNK)
}

/// Shapes of [`attention`].
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub head_dim_v: usize,
    /// Keys more than `window - 1` positions back are masked; `None`: causal only.
    pub window: Option<usize>,
    pub scale: f32,
    /// Scores `s` become `cap · tanh(s · (1/cap))` before the scale (Gemma 2).
    pub softcap: Option<f32>,
    /// Chunks the cache can hold, of `chunk` keys each.
    pub n_chunks: usize,
    /// Keys per chunk (at most [`MAX_ATTENTION_CHUNK`]).
    pub chunk: usize,
}

impl AttentionShape {
    /// Scratch values of the per-chunk maxima and sums (`2` per chunk, head and token).
    pub fn ml_len(&self, n_tokens: usize) -> usize {
        2 * n_tokens * self.n_heads * self.n_chunks
    }

    /// Scratch values of the per-chunk weighted values.
    pub fn acc_len(&self, n_tokens: usize) -> usize {
        n_tokens * self.n_heads * self.n_chunks * self.head_dim_v
    }

    /// Counters of finished chunks, one per query (token and head).
    pub fn done_len(&self, n_tokens: usize) -> usize {
        n_tokens * self.n_heads
    }

    /// Positions the caches hold: whole chunks.
    pub fn positions(&self) -> usize {
        self.n_chunks * self.chunk
    }
}

/// The checks both attention kernels make of the caches (`positions` whole positions of
/// every key head) and of the position counter.
fn check_caches(
    k: &'static str,
    s: &AttentionShape,
    k_cache: usize,
    v_cache: usize,
    pos: usize,
) -> Result<(), KernelError> {
    let positions = s.positions();
    expect_at_least(
        k,
        "the key cache",
        k_cache,
        positions * s.n_kv_heads * s.head_dim,
    )?;
    expect_at_least(
        k,
        "the value cache",
        v_cache,
        positions * s.n_kv_heads * s.head_dim_v,
    )?;
    expect(k, "the position", pos, 1)?;
    Ok(())
}

/// Attention of `n_tokens` queries at positions `pos[0]..` (or, with `pages`, at the
/// positions and against the blocks it gives; each query sees the keys up to its own
/// position) against the f16 caches; `out` gets `n_tokens × n_heads ×
/// head_dim_v` values, and `out_q8` (when given; `head_dim_v` a multiple of 32) the same
/// as Q8 activation blocks. `done` must hold zeros, and is left so.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: DeviceView<'_, f32>,
    k_cache: DeviceView<'_, f16>,
    v_cache: DeviceView<'_, f16>,
    shape: &AttentionShape,
    n_tokens: usize,
    pos: DeviceView<'_, i32>,
    pages: Option<Pages<'_>>,
    mut part_ml: DeviceViewMut<'_, f32>,
    mut part_acc: DeviceViewMut<'_, f32>,
    mut done: DeviceViewMut<'_, u32>,
    mut out: DeviceViewMut<'_, f32>,
    mut out_q8: Option<DeviceViewMut<'_, u8>>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "attention";
    let s = shape;
    expect_at_least(K, "256 values per query head", 256, s.head_dim)?;
    expect_at_least(K, "256 values per value head", 256, s.head_dim_v)?;
    expect(K, "the query head's width modulo 8", s.head_dim % 8, 0)?;
    expect(K, "the value head's width modulo 2", s.head_dim_v % 2, 0)?;
    expect(K, "heads per key head", s.n_heads % s.n_kv_heads.max(1), 0)?;
    expect(K, "the queries", q.len(), n_tokens * s.n_heads * s.head_dim)?;
    expect_at_least(K, "256 keys per chunk", MAX_ATTENTION_CHUNK, s.chunk)?;
    expect_at_least(K, "keys per chunk", s.chunk, 1)?;
    check_caches(K, s, k_cache.len(), v_cache.len(), pos.len())?;
    expect(K, "the chunk maxima", part_ml.len(), s.ml_len(n_tokens))?;
    expect(K, "the chunk sums", part_acc.len(), s.acc_len(n_tokens))?;
    expect(K, "the chunk counters", done.len(), s.done_len(n_tokens))?;
    expect(
        K,
        "the output",
        out.len(),
        n_tokens * s.n_heads * s.head_dim_v,
    )?;
    let mut devices = vec![
        q.device_ordinal(),
        k_cache.device_ordinal(),
        v_cache.device_ordinal(),
        pos.device_ordinal(),
        part_ml.device_ordinal(),
        part_acc.device_ordinal(),
        done.device_ordinal(),
        out.device_ordinal(),
    ];
    if let Some(p) = &pages {
        devices.extend(p.check(K, n_tokens)?);
    }
    if let Some(q8) = &out_q8 {
        expect(K, "the value head's width modulo 32", s.head_dim_v % 32, 0)?;
        expect(
            K,
            "the Q8 output",
            q8.len(),
            q8_bytes(n_tokens, s.n_heads * s.head_dim_v),
        )?;
        devices.push(q8.device_ordinal());
    }
    let device = on_device(stream, &devices)?;
    let softcap = soft_cap(K, s.softcap)?;
    let q8_ptr = out_q8
        .as_mut()
        .map_or(std::ptr::null_mut(), |o| o.as_mut_ptr());
    let c = |what, value| small(K, what, value);
    launch!(
        rf_attention,
        "attention",
        q.as_ptr(),
        k_cache.as_ptr(),
        v_cache.as_ptr(),
        c("tokens", n_tokens)?,
        c("heads", s.n_heads)?,
        c("key heads", s.n_kv_heads)?,
        c("head width", s.head_dim)?,
        c("value head width", s.head_dim_v)?,
        c("window", s.window.unwrap_or(0))?,
        s.scale,
        softcap,
        c("chunks", s.n_chunks)?,
        c("keys per chunk", s.chunk)?,
        pos.as_ptr(),
        Pages::raw(pages)[0],
        Pages::raw(pages)[1],
        Pages::raw(pages)[2],
        pages.map_or(0, |p| p.block_shift as i32),
        part_ml.as_mut_ptr(),
        part_acc.as_mut_ptr(),
        done.as_mut_ptr(),
        out.as_mut_ptr(),
        q8_ptr,
        device,
        stream.as_raw(),
    )
}

/// Attention of a prompt's `n_tokens` queries at positions `pos[0]..` (each seeing the
/// keys up to its own position, within `shape.window`) against the f16 caches, in one
/// launch tiled over queries and keys (an online softmax: no scratch, whatever the
/// number of queries). `out` gets `n_tokens × n_heads × head_dim_v` values, as
/// [`attention`] writes them; the caches must hold the keys and values of every position
/// up to the last query's. With `table` (one sequence's block table and its block shift,
/// as in [`Pages`]), key `j` is read from the cache row the table gives. With
/// `allow_mma`, heads of 32, 64 or 128 values (keys and values alike) take the matrix
/// units where the device has them (NVIDIA, compute capability 8.0 and later).
#[allow(clippy::too_many_arguments)]
pub fn flash_attention(
    q: DeviceView<'_, f32>,
    k_cache: DeviceView<'_, f16>,
    v_cache: DeviceView<'_, f16>,
    shape: &AttentionShape,
    n_tokens: usize,
    pos: DeviceView<'_, i32>,
    table: Option<(DeviceView<'_, i32>, u32)>,
    mut out: DeviceViewMut<'_, f32>,
    allow_mma: bool,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "flash_attention";
    let s = shape;
    expect_at_least(K, "256 values per query head", 256, s.head_dim)?;
    expect_at_least(K, "256 values per value head", 256, s.head_dim_v)?;
    expect_at_least(K, "values per query head", s.head_dim, 8)?;
    expect_at_least(K, "values per value head", s.head_dim_v, 2)?;
    expect(K, "the query head's width modulo 8", s.head_dim % 8, 0)?;
    expect(K, "the value head's width modulo 2", s.head_dim_v % 2, 0)?;
    expect_at_least(K, "key heads", s.n_kv_heads, 1)?;
    expect(K, "heads per key head", s.n_heads % s.n_kv_heads, 0)?;
    expect_at_least(K, "tokens", n_tokens, 1)?;
    expect(K, "the queries", q.len(), n_tokens * s.n_heads * s.head_dim)?;
    let positions = s.positions();
    expect_at_least(K, "positions in the cache", positions, n_tokens)?;
    check_caches(K, s, k_cache.len(), v_cache.len(), pos.len())?;
    expect(
        K,
        "the output",
        out.len(),
        n_tokens * s.n_heads * s.head_dim_v,
    )?;
    let mut devices = vec![
        q.device_ordinal(),
        k_cache.device_ordinal(),
        v_cache.device_ordinal(),
        pos.device_ordinal(),
        out.device_ordinal(),
    ];
    if let Some((t, shift)) = &table {
        expect_at_least(K, "31 bits of block shift", 31, *shift as usize)?;
        devices.push(t.device_ordinal());
    }
    let device = on_device(stream, &devices)?;
    let softcap = soft_cap(K, s.softcap)?;
    let c = |what, value| small(K, what, value);
    // Rows of the kernel's grid: queries times heads per key head.
    c("query rows", n_tokens * (s.n_heads / s.n_kv_heads))?;
    launch!(
        rf_flash_attention,
        "flash_attention",
        q.as_ptr(),
        k_cache.as_ptr(),
        v_cache.as_ptr(),
        c("tokens", n_tokens)?,
        c("heads", s.n_heads)?,
        c("key heads", s.n_kv_heads)?,
        c("head width", s.head_dim)?,
        c("value head width", s.head_dim_v)?,
        c("window", s.window.unwrap_or(0))?,
        s.scale,
        softcap,
        pos.as_ptr(),
        ptr_or_null(table.map(|t| t.0)),
        table.map_or(0, |t| t.1 as i32),
        out.as_mut_ptr(),
        i32::from(allow_mma),
        device,
        stream.as_raw(),
    )
}

/// `act(gate) · up` element-wise (SiLU, or GELU's tanh form with `gelu`), or `act(up)`
/// without a gate, into `out` (f32) and/or `out_q8` (Q8 blocks of `width`-value rows,
/// `width` a multiple of 32).
pub fn gated(
    gate: Option<DeviceView<'_, f32>>,
    up: DeviceView<'_, f32>,
    width: usize,
    gelu: bool,
    mut out: Option<DeviceViewMut<'_, f32>>,
    mut out_q8: Option<DeviceViewMut<'_, u8>>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "gated";
    let n = up.len();
    let mut devices = vec![up.device_ordinal()];
    if let Some(g) = &gate {
        expect(K, "the gate projection", g.len(), n)?;
        devices.push(g.device_ordinal());
    }
    if let Some(o) = &out {
        expect(K, "the output", o.len(), n)?;
        devices.push(o.device_ordinal());
    }
    if let Some(q) = &out_q8 {
        expect(K, "the width modulo 32", width % 32, 0)?;
        expect(K, "the values modulo the width", n % width.max(1), 0)?;
        expect(
            K,
            "the Q8 output",
            q.len(),
            q8_bytes(n / width.max(1), width),
        )?;
        devices.push(q.device_ordinal());
    }
    let device = on_device(stream, &devices)?;
    let out_ptr = out
        .as_mut()
        .map_or(std::ptr::null_mut(), |o| o.as_mut_ptr());
    let q8_ptr = out_q8
        .as_mut()
        .map_or(std::ptr::null_mut(), |o| o.as_mut_ptr());
    launch!(
        rf_gated,
        "gated",
        ptr_or_null(gate),
        up.as_ptr(),
        n,
        i32::from(gelu),
        out_ptr,
        q8_ptr,
        device,
        stream.as_raw(),
    )
}

/// Copies rows `tokens[t]` of `table` (`n_rows` rows of `row_bytes`) to `out`, row by
/// row. A token past the table copies nothing and sets `bad[0]` to 1.
pub fn gather_rows(
    table: DeviceView<'_, u8>,
    row_bytes: usize,
    tokens: DeviceView<'_, u32>,
    mut out: DeviceViewMut<'_, u8>,
    mut bad: DeviceViewMut<'_, i32>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "gather_rows";
    let n_rows = table.len() / row_bytes.max(1);
    expect(K, "the table", table.len(), n_rows * row_bytes)?;
    expect(K, "the output", out.len(), tokens.len() * row_bytes)?;
    expect(K, "the flag", bad.len(), 1)?;
    let device = on_device(
        stream,
        &[
            table.device_ordinal(),
            tokens.device_ordinal(),
            out.device_ordinal(),
            bad.device_ordinal(),
        ],
    )?;
    launch!(
        rf_gather_rows,
        "gather_rows",
        table.as_ptr(),
        row_bytes,
        n_rows,
        tokens.as_ptr(),
        small(K, "tokens", tokens.len())?,
        out.as_mut_ptr(),
        bad.as_mut_ptr(),
        device,
        stream.as_raw(),
    )
}

/// `x *= s`.
pub fn scale(mut x: DeviceViewMut<'_, f32>, s: f32, stream: &Stream) -> Result<(), KernelError> {
    let device = on_device(stream, &[x.device_ordinal()])?;
    let n = x.len();
    launch!(
        rf_scale,
        "scale",
        x.as_mut_ptr(),
        n,
        s,
        device,
        stream.as_raw()
    )
}

/// `x = cap · tanh(x · (1/cap))`: the final logits' soft cap (`cap` a positive number).
pub fn softcap(
    mut x: DeviceViewMut<'_, f32>,
    cap: f32,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "softcap";
    let cap = soft_cap(K, Some(cap))?;
    let device = on_device(stream, &[x.device_ordinal()])?;
    let n = x.len();
    launch!(
        rf_softcap,
        "softcap",
        x.as_mut_ptr(),
        n,
        cap,
        device,
        stream.as_raw()
    )
}

/// For each of the `token.len()` rows that `x` holds, the index of its largest value (the
/// first among equals) into `token[row]`; `u32::MAX` for a row holding a NaN or +inf.
pub fn argmax(
    x: DeviceView<'_, f32>,
    mut token: DeviceViewMut<'_, u32>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "argmax";
    let rows = token.len();
    expect_at_least(K, "rows", rows, 1)?;
    expect(K, "the values modulo the rows", x.len() % rows, 0)?;
    let device = on_device(stream, &[x.device_ordinal(), token.device_ordinal()])?;
    launch!(
        rf_argmax,
        "argmax",
        x.as_ptr(),
        small(K, "values", x.len() / rows)?,
        small(K, "rows", rows)?,
        token.as_mut_ptr(),
        device,
        stream.as_raw(),
    )
}

/// `x[at[i]] += values[i]` for every entry: a sparse addition (logit biases). The
/// indices are the caller's to keep within `x` and distinct (the forward pass checks
/// them on the host before it copies them over).
pub fn add_at(
    mut x: DeviceViewMut<'_, f32>,
    at: DeviceView<'_, i32>,
    values: DeviceView<'_, f32>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "add_at";
    expect(K, "the values", values.len(), at.len())?;
    expect_at_least(K, "entries", at.len(), 1)?;
    let device = on_device(
        stream,
        &[
            x.device_ordinal(),
            at.device_ordinal(),
            values.device_ordinal(),
        ],
    )?;
    launch!(
        rf_add_at,
        "add_at",
        x.as_mut_ptr(),
        at.as_ptr(),
        values.as_ptr(),
        small(K, "entries", at.len())?,
        device,
        stream.as_raw(),
    )
}

/// `dst` row `r` = `src` row `rows[r]`, rows of `dim` values. The row indices are the
/// caller's to keep within `src` (the forward pass checks them on the host before it
/// copies them over).
pub fn select_rows(
    src: DeviceView<'_, f32>,
    dim: usize,
    rows: DeviceView<'_, i32>,
    mut dst: DeviceViewMut<'_, f32>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "select_rows";
    expect(K, "the output", dst.len(), rows.len() * dim)?;
    expect(K, "the input modulo the width", src.len() % dim.max(1), 0)?;
    expect_at_least(K, "rows", rows.len(), 1)?;
    let device = on_device(
        stream,
        &[
            src.device_ordinal(),
            rows.device_ordinal(),
            dst.device_ordinal(),
        ],
    )?;
    launch!(
        rf_select_rows,
        "select_rows",
        src.as_ptr(),
        small(K, "width", dim)?,
        rows.as_ptr(),
        small(K, "rows", rows.len())?,
        dst.as_mut_ptr(),
        device,
        stream.as_raw(),
    )
}

/// `pos[0] += n`, on the stream (so a captured step advances itself).
pub fn advance(
    mut pos: DeviceViewMut<'_, i32>,
    n: usize,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "advance";
    expect(K, "the position", pos.len(), 1)?;
    let device = on_device(stream, &[pos.device_ordinal()])?;
    launch!(
        rf_advance,
        "advance",
        pos.as_mut_ptr(),
        small(K, "tokens", n)?,
        device,
        stream.as_raw(),
    )
}

mod experts;
pub use experts::{moe_combine, moe_route, moe_tiles, Gating};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_chunks_grow_with_the_context_up_to_the_kernel_limit() {
        assert_eq!(attention_chunk(1), 32);
        assert_eq!(attention_chunk(129), 32);
        assert_eq!(attention_chunk(2048), 32);
        assert_eq!(attention_chunk(2049), 64);
        assert_eq!(attention_chunk(4096), 64);
        assert_eq!(attention_chunk(8192), 128);
        assert_eq!(attention_chunk(16384), 256);
        assert_eq!(attention_chunk(1 << 20), MAX_ATTENTION_CHUNK);
        for capacity in [1, 100, 5000, 40000] {
            let chunk = attention_chunk(capacity);
            assert!(capacity.div_ceil(chunk) <= 64 || chunk == MAX_ATTENTION_CHUNK);
        }
    }
}
