//! The element-wise and attention operations of the CPU forward pass.
//!
//! Activations are token-major: a batch of `n` tokens of width `d` is `n * d` values,
//! token `t` at `t * d .. (t + 1) * d`.

mod attention;
mod expf;
pub mod route;

pub use attention::{
    attention_in, AttentionMethod, AttentionShape, CacheRows, FlashContext, Layout, KV_PAD,
};
pub use expf::expf;

use crate::config::{RopeStyle, Yarn};

/// `out = x / rms(x) * weight`, row by row (`weight.len()` is the row width). As in
/// ggml, each square is rounded to f32 and the squares are summed in f64.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (row, out_row) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let sum_sq: f64 = row.iter().map(|&v| f64::from(v * v)).sum();
        let scale = 1.0 / ((sum_sq / d as f64) as f32 + eps).sqrt();
        for ((o, &v), &w) in out_row.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// [`rms_norm`] in place.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    for row in x.chunks_exact_mut(d) {
        let sum_sq: f64 = row.iter().map(|&v| f64::from(v * v)).sum();
        let scale = 1.0 / ((sum_sq / d as f64) as f32 + eps).sqrt();
        for (v, &w) in row.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    }
}

/// Cosines and sines of the rotary angles for `positions`, `rope_dims / 2` pairs each,
/// computed as ggml does: `theta_i = pos · base^(-2i / rope_dims)` by repeated products,
/// divided by pair `i`'s frequency factor when the model has them (Llama 3's
/// `rope_freqs.weight`, Phi-3's long or short factors), then divided by the linear
/// scaling factor `scale`; the cosine and sine are multiplied by `attn_factor`. With
/// `yarn`, each angle mixes the scaled and unscaled angles by YaRN's ramp and the
/// cosines and sines are multiplied by its magnitude factor instead ([`Yarn`]).
pub fn rope_table(
    positions: impl Iterator<Item = usize>,
    rope_dims: usize,
    base: f32,
    scale: f32,
    freq_factors: Option<&[f32]>,
    attn_factor: f32,
    yarn: Option<&Yarn>,
) -> Vec<(f32, f32)> {
    let theta_scale = base.powf(-2.0 / rope_dims as f32);
    let freq_scale = 1.0 / scale;
    let half = rope_dims / 2;
    let (mix, mscale) = yarn_mix(rope_dims, base, scale, attn_factor, yarn);
    let mut table = Vec::new();
    for pos in positions {
        let mut theta = pos as f32;
        for i in 0..half {
            let factor = freq_factors.map_or(1.0, |f| f[i]);
            let extrap = theta / factor;
            let interp = freq_scale * extrap;
            let angle = match &mix {
                // ggml's C fuses the first product into the sum.
                Some(mix) => {
                    let m = mix.weight(i);
                    interp.mul_add(1.0 - m, extrap * m)
                }
                None => interp,
            };
            table.push((angle.cos() * mscale, angle.sin() * mscale));
            theta *= theta_scale;
        }
    }
    table
}

/// YaRN's ramp over the rotary pairs: pair `i`'s angle mixes its extrapolated
/// (unscaled) angle, with weight [`RopeMix::weight`], and its interpolated one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeMix {
    /// The correction dimensions ([`yarn_corr_dims`]).
    pub low: f32,
    pub high: f32,
    /// The extrapolated angle's weight below `low`.
    pub ext_factor: f32,
}

impl RopeMix {
    /// The weight of pair `i`'s extrapolated angle.
    pub fn weight(&self, i: usize) -> f32 {
        let ramp = (i as f32 - self.low) / f32::max(0.001, self.high - self.low);
        (1.0 - ramp.clamp(0.0, 1.0)) * self.ext_factor
    }
}

/// The mix of angles of a layer's RoPE (with YaRN and a non-zero extrapolation factor)
/// and the magnitude of its cosines and sines: `attn_factor`, or with YaRN its own
/// factor times `1 + 0.1 ln scale` (where it extrapolates).
pub fn yarn_mix(
    rope_dims: usize,
    base: f32,
    scale: f32,
    attn_factor: f32,
    yarn: Option<&Yarn>,
) -> (Option<RopeMix>, f32) {
    match yarn {
        None => (None, attn_factor),
        Some(y) if y.ext_factor == 0.0 => (None, y.attn_factor),
        Some(y) => {
            let [low, high] = yarn_corr_dims(rope_dims, y, base);
            let freq_scale = 1.0 / scale;
            let mscale = y.attn_factor * 0.1f32.mul_add((1.0 / freq_scale).ln(), 1.0);
            let mix = RopeMix {
                low,
                high,
                ext_factor: y.ext_factor,
            };
            (Some(mix), mscale)
        }
    }
}

/// YaRN's correction dimensions for `rope_dims` rotated dimensions at `base`: the pair
/// below which angles keep their original value and the one from which they are fully
/// interpolated, as ggml computes them (f32, no fused operations).
pub fn yarn_corr_dims(rope_dims: usize, yarn: &Yarn, base: f32) -> [f32; 2] {
    let dim = |rotations: f32| {
        let turns = yarn.original_context as f32 / (rotations * 2.0 * std::f32::consts::PI);
        rope_dims as f32 * turns.ln() / (2.0 * base.ln())
    };
    let start = dim(yarn.beta_fast).floor();
    let end = dim(yarn.beta_slow).ceil();
    let low = if 0.0 > start { 0.0 } else { start };
    let last = (rope_dims as f32) - 1.0;
    let high = if last < end { last } else { end };
    [low, high]
}

/// Whether this CPU has fused multiply-add instructions. The operations below use
/// `mul_add` as ggml's compiled C does; with the instructions it is one, without them a
/// library call with the same result.
pub(crate) fn has_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // The standard library caches the detection.
        std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Calls `$plain(args)` (a function inlined into its callers) or, where the CPU has FMA,
/// the same function compiled with FMA instructions.
macro_rules! dispatch_fma {
    ($plain:ident($($arg:ident: $ty:ty),*)) => {{
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "fma")]
        fn with_fma($($arg: $ty),*) {
            $plain($($arg),*)
        }
        #[cfg(target_arch = "x86_64")]
        if has_fma() {
            // SAFETY: the CPU supports FMA, the only feature `with_fma` is compiled for.
            return unsafe { with_fma($($arg),*) };
        }
        $plain($($arg),*)
    }};
}

/// Rotates the first `rope_dims` dimensions of every head of every token.
/// `x` is `n_tokens × n_heads × head_dim`; `table` comes from [`rope_table`].
pub fn apply_rope(
    x: &mut [f32],
    head_dim: usize,
    rope_dims: usize,
    style: RopeStyle,
    table: &[(f32, f32)],
) {
    dispatch_fma!(apply_rope_impl(
        x: &mut [f32],
        head_dim: usize,
        rope_dims: usize,
        style: RopeStyle,
        table: &[(f32, f32)]
    ))
}

#[inline(always)]
fn apply_rope_impl(
    x: &mut [f32],
    head_dim: usize,
    rope_dims: usize,
    style: RopeStyle,
    table: &[(f32, f32)],
) {
    let half = rope_dims / 2;
    let per_token = table.len() / half.max(1);
    let token_width = x.len() / per_token.max(1);
    for (t, token) in x.chunks_exact_mut(token_width).enumerate() {
        let angles = &table[t * half..(t + 1) * half];
        for head in token.chunks_exact_mut(head_dim) {
            for (i, &(cos, sin)) in angles.iter().enumerate() {
                let (a, b) = match style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Halves => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                // ggml's C is compiled with floating-point contraction, so its
                // `x0·cos − x1·sin` is a fused multiply-add onto the rounded second
                // product; the same here gives the same bits.
                head[a] = x0.mul_add(cos, -(x1 * sin));
                head[b] = x0.mul_add(sin, x1 * cos);
            }
        }
    }
}

/// `silu(gate) * up`, into `gate`, for rows of `width` values, evaluated as ggml's CPU
/// backend does: `x / (1 + e^-x)` with its vectorised [`expf`] for each full group of
/// eight values of a row, with the C library's `exp` for the rest.
pub fn swiglu(gate: &mut [f32], up: &[f32], width: usize) {
    dispatch_fma!(swiglu_impl(gate: &mut [f32], up: &[f32], width: usize))
}

#[inline(always)]
fn swiglu_impl(gate: &mut [f32], up: &[f32], width: usize) {
    for (g_row, u_row) in gate.chunks_exact_mut(width).zip(up.chunks_exact(width)) {
        let vectorised = width / 8 * 8;
        let (g_head, g_tail) = g_row.split_at_mut(vectorised);
        for (g, &u) in g_head.iter_mut().zip(u_row) {
            *g = *g / (1.0 + expf(0.0 - *g)) * u;
        }
        for (g, &u) in g_tail.iter_mut().zip(&u_row[vectorised..]) {
            *g = *g / (1.0 + (-*g).exp()) * u;
        }
    }
}

/// gpt-oss's clamped SwiGLU, into `gate`, as ggml's CPU backend computes it: the gate
/// `x` capped at `limit`, the up projection `y` clamped to `±limit`, then
/// `x / (1 + e^(alpha · -x)) · (y + 1)` with the C library's `exp`.
pub fn swiglu_oai(gate: &mut [f32], up: &[f32], alpha: f32, limit: f32) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = if limit < *g { limit } else { *g };
        let y = if u < -limit {
            -limit
        } else if limit < u {
            limit
        } else {
            u
        };
        let glu = x / (1.0 + (alpha * -x).exp());
        *g = glu * (y + 1.0);
    }
}

/// `gelu_tanh(gate) * up`, into `gate`, evaluated as ggml's CPU backend does: the input
/// rounded to f16 and looked up in a table of GELU over every f16 value, rounded to
/// f16; 0 at -10 and below, the identity from 10 on.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    let table = gelu_table();
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = if x <= -10.0 {
            0.0
        } else if x >= 10.0 {
            x * u
        } else {
            let i = usize::from(half::f16::from_f32(x).to_bits());
            half::f16::from_bits(table[i]).to_f32() * u
        };
    }
}

/// GELU (tanh form) of every f16 value, as f16 bits, built on first use as ggml builds
/// its table: in f32, with the multiply-add that its compiled C fuses.
fn gelu_table() -> &'static [u16] {
    static TABLE: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        const COEF: f32 = 0.044_715;
        (0..=u16::MAX)
            .map(|bits| {
                let x = half::f16::from_bits(bits).to_f32();
                let inner = (COEF * x).mul_add(x, 1.0);
                let gelu = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * inner).tanh());
                half::f16::from_f32(gelu).to_bits()
            })
            .collect()
    })
}

/// `x` rounded to the nearest f16 and back.
pub fn round_f16(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// `acc[i] = f16(fma(x[i], s, acc[i]))` for every `i`: ggml's `ggml_vec_mad_f16` on an
/// accumulator held at f16 precision. Eight lanes at a time with F16C's conversions
/// where the CPU has them (the same rounding, to nearest even, as [`round_f16`]).
#[inline(always)]
pub fn fma_round_f16(acc: &mut [f32], x: &[f32], s: f32) {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: the CPU has AVX2, FMA and F16C, the features the function needs.
        unsafe { f16c::fma_round(acc, x, s) };
        return;
    }
    for (a, &v) in acc.iter_mut().zip(x) {
        *a = round_f16(v.mul_add(s, *a));
    }
}

/// `acc[i] = f16(acc[i] · s)` for every `i`: ggml's `ggml_vec_scale_f16`, as
/// [`fma_round_f16`] computes it.
#[inline(always)]
pub fn scale_round_f16(acc: &mut [f32], s: f32) {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: as in `fma_round_f16`.
        unsafe { f16c::scale_round(acc, s) };
        return;
    }
    for a in acc.iter_mut() {
        *a = round_f16(*a * s);
    }
}

/// Whether the CPU has AVX2, FMA and F16C (the standard library caches the detection).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn has_f16c() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// The f16 accumulator's loops on eight lanes.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::*;

    /// Rounds eight lanes to f16 (to nearest even) and back.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    fn round8(v: __m256) -> __m256 {
        _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
    }

    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn fma_round(acc: &mut [f32], x: &[f32], s: f32) {
        let n = acc.len().min(x.len());
        let whole = n / 8 * 8;
        let sv = _mm256_set1_ps(s);
        let (a, b) = (acc.as_mut_ptr(), x.as_ptr());
        let mut i = 0;
        while i < whole {
            // SAFETY: `i + 8 <= n`, within both slices.
            unsafe {
                let r = _mm256_fmadd_ps(_mm256_loadu_ps(b.add(i)), sv, _mm256_loadu_ps(a.add(i)));
                _mm256_storeu_ps(a.add(i), round8(r));
            }
            i += 8;
        }
        for j in whole..n {
            acc[j] = super::round_f16(x[j].mul_add(s, acc[j]));
        }
    }

    /// # Safety
    /// The CPU must have AVX2, FMA and F16C.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scale_round(acc: &mut [f32], s: f32) {
        let whole = acc.len() / 8 * 8;
        let sv = _mm256_set1_ps(s);
        let a = acc.as_mut_ptr();
        let mut i = 0;
        while i < whole {
            // SAFETY: `i + 8 <= acc.len()`.
            unsafe {
                _mm256_storeu_ps(
                    a.add(i),
                    round8(_mm256_mul_ps(_mm256_loadu_ps(a.add(i)), sv)),
                )
            };
            i += 8;
        }
        for v in &mut acc[whole..] {
            *v = super::round_f16(*v * s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_f16_accumulator_loops_round_as_one_value_at_a_time() {
        let x: Vec<f32> = (0..67)
            .map(|i| ((i * 37) % 101) as f32 * 0.731 - 30.0)
            .collect();
        let mut acc: Vec<f32> = (0..67).map(|i| round_f16(i as f32 * 1.37 - 40.0)).collect();
        acc[5] = 65_000.0;
        for s in [0.3f32, 1.0, 7.5e-5, 3.0] {
            let mut expected = acc.clone();
            for (a, &v) in expected.iter_mut().zip(&x) {
                *a = round_f16(v.mul_add(s, *a));
            }
            let mut got = acc.clone();
            fma_round_f16(&mut got, &x, s);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "fma, s = {s}"
            );
            let mut expected = acc.clone();
            expected.iter_mut().for_each(|a| *a = round_f16(*a * s));
            let mut got = acc.clone();
            scale_round_f16(&mut got, s);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "scale, s = {s}"
            );
        }
    }

    #[test]
    fn rms_norm_matches_the_definition() {
        let x = [1.0, -2.0, 3.0, -4.0];
        let w = [1.0, 2.0, 0.5, 1.0];
        let mut out = [0.0; 4];
        rms_norm(&x, &w, 0.0, &mut out);
        let rms = (30.0f32 / 4.0).sqrt();
        for i in 0..4 {
            assert!((out[i] - x[i] / rms * w[i]).abs() < 1e-6);
        }
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let mut x: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 - 0.5).collect();
        let orig = x.clone();
        let table = rope_table([0usize].into_iter(), 8, 10_000.0, 1.0, None, 1.0, None);
        apply_rope(&mut x, 8, 8, RopeStyle::Halves, &table);
        assert_eq!(x, orig);
        let table = rope_table([7usize].into_iter(), 8, 10_000.0, 1.0, None, 1.0, None);
        for style in [RopeStyle::Halves, RopeStyle::Interleaved] {
            let mut y = orig.clone();
            apply_rope(&mut y, 8, 8, style, &table);
            let n0: f32 = orig.iter().map(|v| v * v).sum();
            let n1: f32 = y.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-4);
            assert_ne!(y, orig);
        }
    }

    #[test]
    fn rope_frequency_factors_divide_each_pairs_angle() {
        // Llama 3 files carry per-pair divisors of the rotary angles; ignoring them
        // rotated the slow pairs of every Llama 3.1/3.2 head too far.
        let (pos, dims, base) = (9usize, 8, 10_000.0f32);
        let factors = [1.0, 2.0, 4.0, 8.0];
        let plain = rope_table([pos].into_iter(), dims, base, 1.0, None, 1.0, None);
        let scaled = rope_table(
            [pos].into_iter(),
            dims,
            base,
            1.0,
            Some(&factors),
            1.0,
            None,
        );
        for i in 0..dims / 2 {
            let theta = pos as f32 * base.powf(-2.0 * i as f32 / dims as f32);
            let expected = theta / factors[i];
            assert!((plain[i].0 - theta.cos()).abs() < 1e-5);
            assert!((scaled[i].0 - expected.cos()).abs() < 1e-5, "pair {i}");
            assert!((scaled[i].1 - expected.sin()).abs() < 1e-5, "pair {i}");
        }
        assert_eq!(scaled[0], plain[0]);
        assert_ne!(scaled[1], plain[1]);
    }

    #[test]
    fn geglu_reads_gelu_from_the_f16_table_and_clamps_outside_ten() {
        let gelu = |x: f64| {
            0.5 * x * (1.0 + (0.797_884_560_802_865_4 * x * (1.0 + 0.044_715 * x * x)).tanh())
        };
        let xs = [
            -12.0f32, -10.0, -3.3, -0.5, 0.0, 0.25, 1.0, 2.7, 9.99, 10.0, 14.0,
        ];
        let mut gate = xs.to_vec();
        geglu(&mut gate, &[2.0; 11]);
        for (&x, &g) in xs.iter().zip(&gate) {
            let expected = if x <= -10.0 {
                0.0
            } else if x >= 10.0 {
                2.0 * f64::from(x)
            } else {
                2.0 * gelu(f64::from(round_f16(x)))
            };
            // One f16 rounding of the input and one of the result.
            let tolerance = 2.0 * (expected.abs() + 1e-3) / 1024.0;
            assert!(
                (f64::from(g) - expected).abs() <= tolerance,
                "gelu({x}) = {g}, expected {expected}"
            );
        }
        assert_eq!(gate[0], 0.0);
        assert_eq!(gate[10], 28.0);
    }
}
