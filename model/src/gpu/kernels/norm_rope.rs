//! The typed wrappers of `kernels/norm_rope.hip`'s launchers: RMSNorm, fused with the
//! quantization of its output, and the per-head Q/K norms, biases, RoPE and KV-cache
//! write.

#[cfg(hip_platform = "none")]
use hip_backend::HipError;
use hip_backend::{DeviceView, DeviceViewMut, Stream};

#[cfg(not(hip_platform = "none"))]
use super::sys;
use super::{
    cache_code, expect, expect_at_least, on_device, ptr_or_null, q8_bytes, small, CacheViewMut,
    KernelError, NormWeight, Pages,
};
use crate::kv_type::KvTypes;

/// `out (+)= rms_norm(x) · w` for `n_tokens` rows of `dim`; with `out_q8`, the normed
/// rows (before any add) are also quantized to Q8 blocks (`dim` a multiple of 32).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    x: DeviceView<'_, f32>,
    w: NormWeight<'_>,
    n_tokens: usize,
    dim: usize,
    eps: f32,
    out: Option<DeviceViewMut<'_, f32>>,
    add: bool,
    out_q8: Option<DeviceViewMut<'_, u8>>,
    stream: &Stream,
) -> Result<(), KernelError> {
    let norm = Norm::new(n_tokens, dim, eps, out, add, out_q8);
    // The kernel writes x only when given a sum to add.
    let x_ptr = x.as_ptr().cast_mut();
    norm.launch((x_ptr, x.len(), x.device_ordinal()), None, w, stream)
}

/// A mixture of experts' slot outputs and weights, whose weighted sum
/// [`rms_norm_summed`] adds to the residual stream before norming it.
#[derive(Clone, Copy)]
pub struct SlotSum<'a> {
    /// Row `t · used + r` is token `t`'s rank-`r` expert's output (`dim` values).
    pub outputs: DeviceView<'a, f32>,
    /// The slots' weights, `n_tokens · used`; a slot weighted 0 is skipped.
    pub weights: DeviceView<'a, f32>,
    pub used: usize,
}

/// [`rms_norm`] after `x[t] += Σ_r weights[t·used + r] · outputs[t·used + r]` (rank by
/// rank), which it writes back to `x`: the same bits as [`super::moe_combine`] (without
/// shared expert or biases) followed by [`rms_norm`], in one launch.
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_summed(
    mut x: DeviceViewMut<'_, f32>,
    sum: SlotSum<'_>,
    w: NormWeight<'_>,
    n_tokens: usize,
    dim: usize,
    eps: f32,
    out: Option<DeviceViewMut<'_, f32>>,
    add: bool,
    out_q8: Option<DeviceViewMut<'_, u8>>,
    stream: &Stream,
) -> Result<(), KernelError> {
    let norm = Norm::new(n_tokens, dim, eps, out, add, out_q8);
    let x_at = (x.as_mut_ptr(), x.len(), x.device_ordinal());
    norm.launch(x_at, Some(sum), w, stream)
}

/// A mixture of experts' router behind its norm, in one launch: `logits[t · n_experts +
/// e] = router[e] · rms_norm(x[t]) · w` for `n_tokens` rows of `dim`, the router's rows
/// F32 (`router`: their bytes). `out` and `out_q8` get the normed rows as [`rms_norm`]
/// gives them (the same bits).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_router(
    x: DeviceView<'_, f32>,
    w: NormWeight<'_>,
    n_tokens: usize,
    dim: usize,
    eps: f32,
    router: DeviceView<'_, u8>,
    n_experts: usize,
    mut logits: DeviceViewMut<'_, f32>,
    out: Option<DeviceViewMut<'_, f32>>,
    out_q8: Option<DeviceViewMut<'_, u8>>,
    stream: &Stream,
) -> Result<(), KernelError> {
    const K: &str = "rms_norm_router";
    let mut norm = Norm::new(n_tokens, dim, eps, out, false, out_q8);
    let mut devices = norm.check(K, (x.len(), x.device_ordinal()), None, w)?;
    expect(K, "the router's bytes", router.len(), n_experts * dim * 4)?;
    expect(K, "the logits", logits.len(), n_tokens * n_experts)?;
    devices.extend([router.device_ordinal(), logits.device_ordinal()]);
    let device = on_device(stream, &devices)?;
    let (n, d) = (small(K, "tokens", n_tokens)?, small(K, "width", dim)?);
    let (out_ptr, q8_ptr) = norm.out_ptrs();
    launch!(
        rf_rms_norm_router,
        "rms_norm_router",
        x.as_ptr(),
        w.bytes.as_ptr(),
        w.type_code,
        n,
        d,
        eps,
        router.as_ptr(),
        small(K, "experts", n_experts)?,
        logits.as_mut_ptr(),
        out_ptr,
        q8_ptr,
        device,
        stream.as_raw(),
    )
}

/// What both norms' launches share.
struct Norm<'a> {
    n_tokens: usize,
    dim: usize,
    eps: f32,
    out: Option<DeviceViewMut<'a, f32>>,
    add: bool,
    out_q8: Option<DeviceViewMut<'a, u8>>,
}

impl<'a> Norm<'a> {
    fn new(
        n_tokens: usize,
        dim: usize,
        eps: f32,
        out: Option<DeviceViewMut<'a, f32>>,
        add: bool,
        out_q8: Option<DeviceViewMut<'a, u8>>,
    ) -> Norm<'a> {
        Norm {
            n_tokens,
            dim,
            eps,
            out,
            add,
            out_q8,
        }
    }

    /// Checks the lengths of x (its length and device), the weights, the outputs and any
    /// sum; returns the devices they live on.
    fn check(
        &self,
        kernel: &'static str,
        (x_len, x_device): (usize, usize),
        sum: Option<SlotSum<'_>>,
        w: NormWeight<'_>,
    ) -> Result<Vec<usize>, KernelError> {
        let (n_tokens, dim) = (self.n_tokens, self.dim);
        expect(kernel, "the input", x_len, n_tokens * dim)?;
        w.check(kernel, dim)?;
        let mut devices = vec![x_device, w.bytes.device_ordinal()];
        if let Some(o) = &self.out {
            expect(kernel, "the output", o.len(), n_tokens * dim)?;
            devices.push(o.device_ordinal());
        }
        if let Some(q) = &self.out_q8 {
            expect(kernel, "the Q8 output", q.len(), q8_bytes(n_tokens, dim))?;
            expect(kernel, "the width modulo 32", dim % 32, 0)?;
            devices.push(q.device_ordinal());
        }
        if let Some(s) = &sum {
            expect_at_least(kernel, "the experts used", s.used, 1)?;
            expect(
                kernel,
                "the experts' outputs",
                s.outputs.len(),
                n_tokens * s.used * dim,
            )?;
            expect(
                kernel,
                "the experts' weights",
                s.weights.len(),
                n_tokens * s.used,
            )?;
            devices.extend([s.outputs.device_ordinal(), s.weights.device_ordinal()]);
        }
        Ok(devices)
    }

    /// The outputs' pointers, null where not asked for.
    fn out_ptrs(&mut self) -> (*mut std::ffi::c_void, *mut std::ffi::c_void) {
        let out = self
            .out
            .as_mut()
            .map_or(std::ptr::null_mut(), |o| o.as_mut_ptr());
        let q8 = self
            .out_q8
            .as_mut()
            .map_or(std::ptr::null_mut(), |o| o.as_mut_ptr());
        (out, q8)
    }

    /// Checks every length and device, then launches on `x` (its pointer, length and
    /// device).
    fn launch(
        mut self,
        (x, x_len, x_device): (*mut std::ffi::c_void, usize, usize),
        sum: Option<SlotSum<'_>>,
        w: NormWeight<'_>,
        stream: &Stream,
    ) -> Result<(), KernelError> {
        const K: &str = "rms_norm";
        let devices = self.check(K, (x_len, x_device), sum, w)?;
        let device = on_device(stream, &devices)?;
        let (n, d) = (
            small(K, "tokens", self.n_tokens)?,
            small(K, "width", self.dim)?,
        );
        let used = small(K, "experts used", sum.map_or(0, |s| s.used))?;
        let (out_ptr, q8_ptr) = self.out_ptrs();
        launch!(
            rf_rms_norm,
            "rms_norm",
            x,
            w.bytes.as_ptr(),
            w.type_code,
            n,
            d,
            self.eps,
            out_ptr,
            i32::from(self.add),
            q8_ptr,
            ptr_or_null(sum.map(|s| s.outputs)),
            ptr_or_null(sum.map(|s| s.weights)),
            used,
            device,
            stream.as_raw(),
        )
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
    /// Multiplies the rotary cosines and sines (`rope.scaling.attn_factor`, usually 1;
    /// with YaRN, its magnitude: [`crate::ops::yarn_mix`]).
    pub attn_factor: f32,
    /// YaRN's mix of each pair's extrapolated and interpolated angles.
    pub yarn: Option<crate::ops::RopeMix>,
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
/// place) and `k`; keys and values (with bias) written to the caches at their
/// positions, and quantized there as llama.cpp's CPU backend quantizes a cache row
/// when the caches are: a quantized key cache holds keys rotated as
/// [`KvTypes::k_rotation`] says (and the queries are rotated alike), a quantized value
/// cache values rotated as [`KvTypes::v_rotation`] says (the attention's output must be
/// turned back: [`hadamard64`](super::hadamard64)). The caches must hold those positions.
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
    mut k_cache: CacheViewMut<'_>,
    mut v_cache: CacheViewMut<'_>,
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
    expect(K, "the key cache's row", k_cache.dim, kv_dim)?;
    expect(K, "the value cache's row", v_cache.dim, v_dim)?;
    expect(
        K,
        "positions in the value cache",
        v_cache.positions,
        k_cache.positions,
    )?;
    k_cache.check(K, "the key cache")?;
    v_cache.check(K, "the value cache")?;
    let types = KvTypes {
        k: k_cache.ty,
        v: v_cache.ty,
    };
    let mut devices = vec![
        q.device_ordinal(),
        k.device_ordinal(),
        v.device_ordinal(),
        pos.device_ordinal(),
        k_cache.bytes.device_ordinal(),
        v_cache.bytes.device_ordinal(),
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
        s.yarn.map_or(0.0, |y| y.low),
        s.yarn.map_or(0.0, |y| y.high),
        s.yarn.map_or(0.0, |y| y.ext_factor),
        pos.as_ptr(),
        Pages::raw(pages)[0],
        Pages::raw(pages)[1],
        Pages::raw(pages)[2],
        pages.map_or(0, |p| p.block_shift as i32),
        k_cache.bytes.as_mut_ptr(),
        v_cache.bytes.as_mut_ptr(),
        cache_code(k_cache.ty),
        cache_code(v_cache.ty),
        c("cache positions", k_cache.positions)?,
        types.k_rotation(s.head_dim).unwrap_or(0) as i32,
        types.v_rotation(s.head_dim_v).unwrap_or(0) as i32,
        device,
        stream.as_raw(),
    )
}
