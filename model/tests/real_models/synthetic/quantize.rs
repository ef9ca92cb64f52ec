//! A seeded random source and plain reference quantizers for every weight type the
//! synthetic models use.
//!
//! Everything here is bit-reproducible on any IEEE-754 machine: the generator draws
//! integers from SplitMix64 and builds approximately normal values from sums of uniform
//! draws (additions and multiplications only, no library transcendentals), and the
//! quantizers use only `+ - * /`, `abs`, `round` and comparisons. So the same spec always
//! yields the same file bytes, whose SHA-256 the references record.
//!
//! The quantizers follow the block layouts of ggml (which llama.cpp and our kernels both
//! decode): each picks its block scale from the block's range and rounds every value to
//! the nearest level (the nearest entry of the table, for the non-linear `IQ4_NL` and
//! `IQ4_XS`; for the grid formats the signs of the values and the grid entry nearest to
//! their magnitudes, found by trying every entry). They do not search for the error-minimizing scale as llama.cpp's
//! quantizers do; that changes which levels are chosen, not how the blocks decode.

use gguf_format::GgmlType;
use half::{bf16, f16};

#[path = "quantize/grids.rs"]
mod grids;

use grids::{iq1_m, iq1_s, iq2_s, iq2_xs, iq2_xxs, iq3_s, iq3_xxs};

/// SplitMix64: a tiny, well-mixed 64-bit generator.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// A generator for one named tensor of a model: independent of the order in which
    /// tensors are generated, so adding a tensor does not change the others.
    pub fn for_tensor(model_seed: u64, name: &str) -> Rng {
        // FNV-1a of the name, mixed with the model's seed.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for &b in name.as_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        let mut rng = Rng(h ^ model_seed.rotate_left(17));
        rng.next_u64();
        rng
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1), a multiple of 2^-23 (exact in f32).
    pub fn uniform(&mut self) -> f32 {
        let bits = (self.next_u64() >> 40) as u32; // 24 random bits
        bits as f32 * (1.0 / 8_388_608.0) - 1.0
    }

    /// Approximately standard normal: the sum of four uniforms, scaled to unit variance
    /// (each uniform on [-1, 1) has variance 1/3).
    pub fn normal(&mut self) -> f32 {
        const UNIT: f32 = 0.866_025_4; // sqrt(3/4)
        (self.uniform() + self.uniform() + self.uniform() + self.uniform()) * UNIT
    }

    /// `n` values `mean + std * normal()`.
    pub fn normals(&mut self, n: usize, mean: f32, std: f32) -> Vec<f32> {
        (0..n).map(|_| mean + std * self.normal()).collect()
    }
}

/// Encodes `values` (a whole number of rows of whole blocks) as `ty`.
pub fn quantize(ty: GgmlType, values: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    match ty {
        GgmlType::F32 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => values
            .iter()
            .for_each(|&v| out.extend_from_slice(&f16::from_f32(v).to_le_bytes())),
        GgmlType::BF16 => values
            .iter()
            .for_each(|&v| out.extend_from_slice(&bf16::from_f32(v).to_le_bytes())),
        GgmlType::Q4_0 => values.chunks_exact(32).for_each(|b| q4_0(b, &mut out)),
        GgmlType::Q4_1 => values.chunks_exact(32).for_each(|b| q4_1(b, &mut out)),
        GgmlType::Q5_0 => values.chunks_exact(32).for_each(|b| q5_0(b, &mut out)),
        GgmlType::Q5_1 => values.chunks_exact(32).for_each(|b| q5_1(b, &mut out)),
        GgmlType::Q8_0 => values.chunks_exact(32).for_each(|b| q8_0(b, &mut out)),
        GgmlType::Q2_K => values.chunks_exact(256).for_each(|b| q2_k(b, &mut out)),
        GgmlType::Q3_K => values.chunks_exact(256).for_each(|b| q3_k(b, &mut out)),
        GgmlType::Q4_K => values.chunks_exact(256).for_each(|b| q4_k(b, &mut out)),
        GgmlType::Q5_K => values.chunks_exact(256).for_each(|b| q5_k(b, &mut out)),
        GgmlType::Q6_K => values.chunks_exact(256).for_each(|b| q6_k(b, &mut out)),
        GgmlType::IQ4_XS => values.chunks_exact(256).for_each(|b| iq4_xs(b, &mut out)),
        GgmlType::IQ4_NL => values.chunks_exact(32).for_each(|b| iq4_nl(b, &mut out)),
        GgmlType::MXFP4 => values.chunks_exact(32).for_each(|b| mxfp4(b, &mut out)),
        GgmlType::IQ3_S => values.chunks_exact(256).for_each(|b| iq3_s(b, &mut out)),
        GgmlType::IQ3_XXS => values.chunks_exact(256).for_each(|b| iq3_xxs(b, &mut out)),
        GgmlType::IQ2_XXS => values.chunks_exact(256).for_each(|b| iq2_xxs(b, &mut out)),
        GgmlType::IQ2_XS => values.chunks_exact(256).for_each(|b| iq2_xs(b, &mut out)),
        GgmlType::IQ2_S => values.chunks_exact(256).for_each(|b| iq2_s(b, &mut out)),
        GgmlType::IQ1_S => values.chunks_exact(256).for_each(|b| iq1_s(b, &mut out)),
        GgmlType::IQ1_M => values.chunks_exact(256).for_each(|b| iq1_m(b, &mut out)),
        GgmlType::TQ1_0 => values.chunks_exact(256).for_each(|b| tq1_0(b, &mut out)),
        GgmlType::TQ2_0 => values.chunks_exact(256).for_each(|b| tq2_0(b, &mut out)),
        other => panic!("no reference quantizer for {other}"),
    }
    out
}

fn push_f16(out: &mut Vec<u8>, v: f32) -> f32 {
    let h = f16::from_f32(v);
    out.extend_from_slice(&h.to_le_bytes());
    h.to_f32()
}

/// The value of largest magnitude, with its sign.
fn signed_max(block: &[f32]) -> f32 {
    block
        .iter()
        .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

fn min_max(block: &[f32]) -> (f32, f32) {
    block
        .iter()
        .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

/// `round(v * inv) + offset`, clamped to `0..=max`.
fn level(v: f32, inv: f32, offset: f32, max: u8) -> u8 {
    (v * inv + offset).round().clamp(0.0, f32::from(max)) as u8
}

fn inverse(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// Symmetric 4-bit: `x = d * (q - 8)`, the extreme value mapped to level 0.
fn q4_0(block: &[f32], out: &mut Vec<u8>) {
    let d = push_f16(out, signed_max(block) / -8.0);
    let inv = inverse(d);
    let q: Vec<u8> = block.iter().map(|&v| level(v, inv, 8.0, 15)).collect();
    pack_nibbles(&q, out);
}

/// Affine 4-bit: `x = d * q + m`.
fn q4_1(block: &[f32], out: &mut Vec<u8>) {
    let (lo, hi) = min_max(block);
    let d = push_f16(out, (hi - lo) / 15.0);
    let m = push_f16(out, lo);
    let inv = inverse(d);
    let q: Vec<u8> = block.iter().map(|&v| level(v - m, inv, 0.0, 15)).collect();
    pack_nibbles(&q, out);
}

/// Symmetric 5-bit: `x = d * (q - 16)`.
fn q5_0(block: &[f32], out: &mut Vec<u8>) {
    let d = push_f16(out, signed_max(block) / -16.0);
    let inv = inverse(d);
    let q: Vec<u8> = block.iter().map(|&v| level(v, inv, 16.0, 31)).collect();
    pack_five_bits(&q, out);
}

/// Affine 5-bit: `x = d * q + m`.
fn q5_1(block: &[f32], out: &mut Vec<u8>) {
    let (lo, hi) = min_max(block);
    let d = push_f16(out, (hi - lo) / 31.0);
    let m = push_f16(out, lo);
    let inv = inverse(d);
    let q: Vec<u8> = block.iter().map(|&v| level(v - m, inv, 0.0, 31)).collect();
    pack_five_bits(&q, out);
}

/// 8-bit: `x = d * q`, q in -127..=127.
fn q8_0(block: &[f32], out: &mut Vec<u8>) {
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = push_f16(out, amax / 127.0);
    let inv = inverse(d);
    out.extend(
        block
            .iter()
            .map(|&v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8),
    );
}

/// Value `j` in the low nibble of byte `j`, value `j + 16` in its high nibble.
fn pack_nibbles(q: &[u8], out: &mut Vec<u8>) {
    out.extend((0..16).map(|j| (q[j] & 0xF) | ((q[j + 16] & 0xF) << 4)));
}

/// The fifth bits of all 32 values in one little-endian u32, then the nibbles.
fn pack_five_bits(q: &[u8], out: &mut Vec<u8>) {
    let high = q
        .iter()
        .enumerate()
        .fold(0u32, |h, (j, &v)| h | (u32::from(v >> 4) << j));
    out.extend_from_slice(&high.to_le_bytes());
    pack_nibbles(q, out);
}

/// 2-bit: sixteen groups of 16, `x = d * sc * q - dmin * m` with 4-bit `sc` and `m` and
/// `q` in `0..=3`.
fn q2_k(block: &[f32], out: &mut Vec<u8>) {
    let mut scales = [0f32; 16];
    let mut mins = [0f32; 16];
    for (g, group) in block.chunks_exact(16).enumerate() {
        let (lo, hi) = min_max(group);
        let lo = lo.min(0.0);
        scales[g] = (hi - lo) / 3.0;
        mins[g] = -lo;
    }
    let max_scale = scales.iter().fold(0f32, |m, &v| m.max(v));
    let max_min = mins.iter().fold(0f32, |m, &v| m.max(v));
    let d = f16::from_f32(max_scale / 15.0).to_f32();
    let dmin = f16::from_f32(max_min / 15.0).to_f32();
    let (inv_d, inv_dmin) = (inverse(d), inverse(dmin));
    let mut q = [0u8; 256];
    for (g, group) in block.chunks_exact(16).enumerate() {
        let sc = level(scales[g], inv_d, 0.0, 15);
        let m = level(mins[g], inv_dmin, 0.0, 15);
        out.push(sc | (m << 4));
        let (scale, min) = (d * f32::from(sc), dmin * f32::from(m));
        let inv = inverse(scale);
        for (l, &v) in group.iter().enumerate() {
            q[g * 16 + l] = level(v + min, inv, 0.0, 3);
        }
    }
    // Values l, l + 32, l + 64, l + 96 of each 128 in the four crumbs of one byte.
    for half in q.chunks_exact(128) {
        out.extend(
            (0..32)
                .map(|l| half[l] | (half[l + 32] << 2) | (half[l + 64] << 4) | (half[l + 96] << 6)),
        );
    }
    push_f16(out, d);
    push_f16(out, dmin);
}

/// 3-bit: sixteen groups of 16 with 6-bit signed scales, `x = d * sc * q`, `sc` in
/// `-32..=31` and `q` in `-4..=3` (each group's extreme value mapped to -4, the scale of
/// largest magnitude to -32).
fn q3_k(block: &[f32], out: &mut Vec<u8>) {
    let group_scales: Vec<f32> = block
        .chunks_exact(16)
        .map(|g| signed_max(g) / -4.0)
        .collect();
    let d = f16::from_f32(signed_max(&group_scales) / -32.0).to_f32();
    let inv_d = inverse(d);
    let sc: Vec<i8> = group_scales
        .iter()
        .map(|&s| (s * inv_d).round().clamp(-32.0, 31.0) as i8)
        .collect();
    // Levels 0..=7 (q + 4).
    let mut q = [0u8; 256];
    for (g, group) in block.chunks_exact(16).enumerate() {
        let inv = inverse(d * f32::from(sc[g]));
        for (l, &v) in group.iter().enumerate() {
            q[g * 16 + l] = level(v, inv, 4.0, 7);
        }
    }
    // The third bit of value j in bit j / 32 of hmask[j % 32]; the low two bits of values
    // l, l + 32, l + 64, l + 96 of each 128 in the four crumbs of one byte.
    let mut hmask = [0u8; 32];
    for (j, &v) in q.iter().enumerate() {
        hmask[j % 32] |= (v >> 2) << (j / 32);
    }
    out.extend_from_slice(&hmask);
    for half in q.chunks_exact(128) {
        out.extend((0..32).map(|l| {
            (half[l] & 3)
                | ((half[l + 32] & 3) << 2)
                | ((half[l + 64] & 3) << 4)
                | ((half[l + 96] & 3) << 6)
        }));
    }
    // Scale k (stored + 32, six bits): its low nibble in byte k % 8 (high nibble for
    // k >= 8), its top two bits in byte 8 + k % 4 at bits 2 (k / 4).
    let mut packed = [0u8; 12];
    for (k, &s) in sc.iter().enumerate() {
        let l = (s + 32) as u8;
        packed[k % 8] |= (l & 0xF) << (4 * (k / 8));
        packed[8 + k % 4] |= (l >> 4) << (2 * (k / 4));
    }
    out.extend_from_slice(&packed);
    push_f16(out, d);
}

/// 6-bit sub-block scales and minimums of the 4- and 5-bit k-quants, quantized against
/// the super-block's `d` and `dmin`: returns (d, dmin, scales, mins) as stored.
fn k_scales(block: &[f32], max_level: f32, out: &mut Vec<u8>) -> (f32, f32, [u8; 8], [u8; 8]) {
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    for (s, sub) in block.chunks_exact(32).enumerate() {
        let (lo, hi) = min_max(sub);
        let lo = lo.min(0.0);
        scales[s] = (hi - lo) / max_level;
        mins[s] = -lo;
    }
    let max_scale = scales.iter().fold(0f32, |m, &v| m.max(v));
    let max_min = mins.iter().fold(0f32, |m, &v| m.max(v));
    let d = push_f16(out, max_scale / 63.0);
    let dmin = push_f16(out, max_min / 63.0);
    let (inv_d, inv_dmin) = (inverse(d), inverse(dmin));
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for s in 0..8 {
        sc[s] = level(scales[s], inv_d, 0.0, 63);
        mn[s] = level(mins[s], inv_dmin, 0.0, 63);
    }
    // Twelve bytes: sub-blocks 0-3 in the low six bits of bytes 0-3 (scales) and 4-7
    // (minimums); sub-blocks 4-7 as nibbles in bytes 8-11 with their top two bits in the
    // spare high bits of bytes 0-7.
    let mut packed = [0u8; 12];
    packed[..4].copy_from_slice(&sc[..4]);
    packed[4..8].copy_from_slice(&mn[..4]);
    for j in 4..8 {
        packed[j + 4] = (sc[j] & 0xF) | ((mn[j] & 0xF) << 4);
        packed[j - 4] |= (sc[j] >> 4) << 6;
        packed[j] |= (mn[j] >> 4) << 6;
    }
    out.extend_from_slice(&packed);
    (d, dmin, sc, mn)
}

/// Levels of a 4- or 5-bit k-quant super-block: `x = d * sc * q - dmin * m`.
fn k_levels(block: &[f32], d: f32, dmin: f32, sc: &[u8; 8], mn: &[u8; 8], max: u8) -> Vec<u8> {
    let mut q = Vec::with_capacity(256);
    for (s, sub) in block.chunks_exact(32).enumerate() {
        let scale = d * f32::from(sc[s]);
        let min = dmin * f32::from(mn[s]);
        let inv = inverse(scale);
        q.extend(sub.iter().map(|&v| level(v + min, inv, 0.0, max)));
    }
    q
}

fn q4_k(block: &[f32], out: &mut Vec<u8>) {
    let (d, dmin, sc, mn) = k_scales(block, 15.0, out);
    let q = k_levels(block, d, dmin, &sc, &mn, 15);
    // Each 64 values: 32 bytes, the first 32 values in the low nibbles.
    for chunk in q.chunks_exact(64) {
        out.extend((0..32).map(|l| chunk[l] | (chunk[l + 32] << 4)));
    }
}

fn q5_k(block: &[f32], out: &mut Vec<u8>) {
    let (d, dmin, sc, mn) = k_scales(block, 31.0, out);
    let q = k_levels(block, d, dmin, &sc, &mn, 31);
    // 32 bytes of fifth bits: bit 2i of byte l is value l of chunk i's first half,
    // bit 2i+1 value l of its second half; then the nibbles as in Q4_K.
    let mut high = [0u8; 32];
    for (i, chunk) in q.chunks_exact(64).enumerate() {
        for l in 0..32 {
            high[l] |= ((chunk[l] >> 4) << (2 * i)) | ((chunk[l + 32] >> 4) << (2 * i + 1));
        }
    }
    out.extend_from_slice(&high);
    for chunk in q.chunks_exact(64) {
        out.extend((0..32).map(|l| (chunk[l] & 0xF) | ((chunk[l + 32] & 0xF) << 4)));
    }
}

/// 6-bit: sixteen sub-blocks of 16 with signed 8-bit scales, `x = d * sc * (q - 32)`.
fn q6_k(block: &[f32], out: &mut Vec<u8>) {
    let sub_scales: Vec<f32> = block
        .chunks_exact(16)
        .map(|sub| signed_max(sub) / -32.0)
        .collect();
    let max_abs = sub_scales.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = f16::from_f32(max_abs / 127.0).to_f32();
    let inv_d = inverse(d);
    let sc: Vec<i8> = sub_scales
        .iter()
        .map(|&s| (s * inv_d).round().clamp(-127.0, 127.0) as i8)
        .collect();
    let mut q = [0u8; 256];
    for (s, sub) in block.chunks_exact(16).enumerate() {
        let inv = inverse(d * f32::from(sc[s]));
        for (l, &v) in sub.iter().enumerate() {
            q[s * 16 + l] = level(v, inv, 32.0, 63);
        }
    }
    // Per 128 values: 64 bytes of low nibbles (values l and l+64 share byte l, values
    // l+32 and l+96 byte l+32) and 32 bytes of high bit pairs (value l+32k in bits 2k).
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for half in 0..2 {
        let q = &q[half * 128..][..128];
        let (ql, qh) = (&mut ql[half * 64..][..64], &mut qh[half * 32..][..32]);
        for l in 0..32 {
            ql[l] = (q[l] & 0xF) | ((q[l + 64] & 0xF) << 4);
            ql[l + 32] = (q[l + 32] & 0xF) | ((q[l + 96] & 0xF) << 4);
            qh[l] = (q[l] >> 4)
                | ((q[l + 32] >> 4) << 2)
                | ((q[l + 64] >> 4) << 4)
                | ((q[l + 96] >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    push_f16(out, d);
}

/// The non-linear 4-bit levels of `IQ4_NL` and `IQ4_XS` (ggml's `kvalues_iq4nl`).
const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The index of the entry of [`KVALUES_IQ4NL`] times `scale` nearest to `v` (the lower
/// index on a tie).
fn nearest_iq4(v: f32, scale: f32) -> u8 {
    let mut best = 0;
    for (k, &level) in KVALUES_IQ4NL.iter().enumerate() {
        let err = (v - scale * f32::from(level)).abs();
        if err < (v - scale * f32::from(KVALUES_IQ4NL[best])).abs() {
            best = k;
        }
    }
    best as u8
}

/// Non-linear 4-bit with 6-bit group scales: eight groups of 32, `x = d * (ls - 32) *
/// kvalues[q]`, each group's extreme value mapped to -127 and the scale of largest
/// magnitude to -32.
fn iq4_xs(block: &[f32], out: &mut Vec<u8>) {
    let group_scales: Vec<f32> = block
        .chunks_exact(32)
        .map(|g| signed_max(g) / -127.0)
        .collect();
    let d = push_f16(out, signed_max(&group_scales) / -32.0);
    let inv_d = inverse(d);
    let ls: Vec<u8> = group_scales
        .iter()
        .map(|&s| ((s * inv_d).round().clamp(-32.0, 31.0) + 32.0) as u8)
        .collect();
    let scales_h = ls
        .iter()
        .enumerate()
        .fold(0u16, |h, (g, &l)| h | (u16::from(l >> 4) << (2 * g)));
    out.extend_from_slice(&scales_h.to_le_bytes());
    out.extend((0..4).map(|k| (ls[2 * k] & 0xF) | ((ls[2 * k + 1] & 0xF) << 4)));
    for (g, group) in block.chunks_exact(32).enumerate() {
        let scale = d * (f32::from(ls[g]) - 32.0);
        let q: Vec<u8> = group.iter().map(|&v| nearest_iq4(v, scale)).collect();
        pack_nibbles(&q, out);
    }
}

/// Non-linear 4-bit: `x = d * kvalues[q]`, the extreme value mapped to -127.
fn iq4_nl(block: &[f32], out: &mut Vec<u8>) {
    let d = push_f16(out, signed_max(block) / -127.0);
    let q: Vec<u8> = block.iter().map(|&v| nearest_iq4(v, d)).collect();
    pack_nibbles(&q, out);
}

/// `MXFP4`: 32 values `2^(e - 128) · kvalues[q]` (the FP4 values doubled, the E8M0
/// exponent `e` the smallest whose largest value 12 covers the block), each the nearest
/// level (the lower index on a tie).
fn mxfp4(block: &[f32], out: &mut Vec<u8>) {
    let levels = dequant::grids::KVALUES_MXFP4;
    let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
    let (mut e, mut scale) = (128u8, 1.0f32);
    while e > 2 && 12.0 * scale * 0.5 >= amax {
        e -= 1;
        scale *= 0.5;
    }
    while e < 254 && 12.0 * scale < amax {
        e += 1;
        scale *= 2.0;
    }
    out.push(e);
    let q: Vec<u8> = block
        .iter()
        .map(|&v| {
            let mut best = 0;
            for (k, &level) in levels.iter().enumerate() {
                let err = (v - scale * f32::from(level)).abs();
                if err < (v - scale * f32::from(levels[best])).abs() {
                    best = k;
                }
            }
            best as u8
        })
        .collect();
    pack_nibbles(&q, out);
}

/// The ternary formats' scale and stored values: `x = d * (q - 1)`, `q` in `0..=2`,
/// with `d` the block's mean magnitude (as ternary-trained models scale their weights),
/// each value rounded to the nearest of `-d, 0, d`.
fn ternary(block: &[f32]) -> (f16, Vec<u8>) {
    let mean = block.iter().map(|v| v.abs()).sum::<f32>() / block.len() as f32;
    let d = f16::from_f32(mean);
    let inv = inverse(d.to_f32());
    (d, block.iter().map(|&v| level(v, inv, 1.0, 2)).collect())
}

/// Ternary, 1.6 bits a value: five values a byte in base 3 (the first the most
/// significant digit), stored as `ceil(n · 256 / 243)`: bytes `m < 32` hold values
/// `m + 32k`, the next 16 bytes values `160 + m + 16k`, and `qh[j]` the four values
/// `240 + j + 4k` (times 3, a fifth digit of 0); then `d`.
fn tq1_0(block: &[f32], out: &mut Vec<u8>) {
    let (d, q) = ternary(block);
    let pack = |digits: &mut dyn Iterator<Item = u8>| -> u8 {
        let n = digits.fold(0u16, |n, t| 3 * n + u16::from(t));
        (n * 256).div_ceil(243) as u8
    };
    for m in 0..32 {
        out.push(pack(&mut (0..5).map(|k| q[m + 32 * k])));
    }
    for m in 0..16 {
        out.push(pack(&mut (0..5).map(|k| q[160 + m + 16 * k])));
    }
    for j in 0..4 {
        out.push(pack(&mut (0..5).map(|k| {
            if k < 4 {
                q[240 + j + 4 * k]
            } else {
                0
            }
        })));
    }
    out.extend_from_slice(&d.to_le_bytes());
}

/// Ternary in two bits a value: value `128c + 32s + l` in bits `2s, 2s + 1` of byte
/// `32c + l`; then `d`.
fn tq2_0(block: &[f32], out: &mut Vec<u8>) {
    let (d, q) = ternary(block);
    for c in 0..2 {
        out.extend(
            (0..32).map(|l| (0..4).fold(0u8, |b, s| b | (q[128 * c + 32 * s + l] << (2 * s)))),
        );
    }
    out.extend_from_slice(&d.to_le_bytes());
}

/// `n` values of `ty` as blocks random in every field: every byte drawn from `rng`, then
/// each block's scales set to one value chosen so that the decoded weights have root mean
/// square about `rms`.
///
/// The quantizers above write only what quantizing a smooth draw gives (each grid entry
/// the nearest one, the scales fitted to the block's range); these blocks hold all 256
/// values of every grid-index, sign, high-bit and sub-scale byte, as files from other
/// writers may. Only the f16 scales are fixed (MXFP4's exponent byte, IQ1_M's scale
/// nibbles), so that every value is finite and of a useful size.
pub fn random_blocks(ty: GgmlType, n: usize, rms: f32, rng: &mut Rng) -> Vec<u8> {
    let (values, size) = (ty.block_size() as usize, ty.type_size() as usize);
    assert!(
        ty.is_quantized() && n.is_multiple_of(values),
        "{n} values of {ty}"
    );
    let mut bytes = Vec::with_capacity(n / values * size);
    while bytes.len() < n / values * size {
        let word = rng.next_u64().to_le_bytes();
        let take = word.len().min(n / values * size - bytes.len());
        bytes.extend_from_slice(&word[..take]);
    }
    // The weights' size at a unit scale; every decoded value is linear in the scale.
    set_scales(ty, &mut bytes, 1.0);
    let mut decoded = vec![0f32; n];
    dequant::decode_f32(ty, &bytes, &mut decoded).expect("whole blocks decode");
    let unit = (decoded
        .iter()
        .map(|&v| f64::from(v) * f64::from(v))
        .sum::<f64>()
        / n as f64)
        .sqrt() as f32;
    set_scales(ty, &mut bytes, rms / unit);
    bytes
}

/// Byte offsets of the f16 scales in one block of `ty` (ggml-common.h's layouts).
fn f16_scale_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 | IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S | IQ1_S | IQ4_NL
        | IQ4_XS => &[0],
        // d and the minimum's scale.
        Q4_1 | Q5_1 | Q4_K | Q5_K => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        TQ1_0 => &[52],
        TQ2_0 => &[64],
        other => panic!("no f16 scale offsets for {other}"),
    }
}

/// Sets every block's scales to `scale`: the f16 fields to it; MXFP4's E8M0 exponent to
/// the power of two nearest it (in ratio); IQ1_M's f16, whose four nibbles are the top
/// bits of the block's four 16-bit sub-scale words, to it.
fn set_scales(ty: GgmlType, bytes: &mut [u8], scale: f32) {
    let size = ty.type_size() as usize;
    let h = f16::from_f32(scale);
    // Q6_K's int8 sub-scales make its unit-scale weights large, so its f16 scale comes
    // out subnormal, as in real files: a case for the f16 conversions too.
    assert!(
        h.is_finite() && h.to_f32() > 0.0,
        "scale {scale} of {ty} is not a positive f16"
    );
    for block in bytes.chunks_exact_mut(size) {
        match ty {
            GgmlType::MXFP4 => {
                // The exponent e of 2^(e - 127): the nearest in ratio, found exactly.
                let (mut e, mut r) = (127i32, scale);
                while r >= std::f32::consts::SQRT_2 {
                    r /= 2.0;
                    e += 1;
                }
                while r < std::f32::consts::FRAC_1_SQRT_2 {
                    r *= 2.0;
                    e -= 1;
                }
                block[0] = e.clamp(1, 254) as u8;
            }
            GgmlType::IQ1_M => {
                let bits = h.to_bits();
                for k in 0..4 {
                    let at = 48 + 2 * k;
                    let word = u16::from_le_bytes([block[at], block[at + 1]]);
                    let nibble = (bits >> (4 * k)) & 0xF;
                    let word = (word & 0x0FFF) | (nibble << 12);
                    block[at..at + 2].copy_from_slice(&word.to_le_bytes());
                }
            }
            _ => {
                for &at in f16_scale_offsets(ty) {
                    block[at..at + 2].copy_from_slice(&h.to_le_bytes());
                }
            }
        }
    }
}
