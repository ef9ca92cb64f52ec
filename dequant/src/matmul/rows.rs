//! Single rows of `Q8_0` and `Q4_0` written, read and multiplied one at a time, as
//! llama.cpp's CPU backend does for a quantized KV cache (`-ctk`/`-ctv q8_0|q4_0`).
//!
//! A cache row is quantized when it is stored (llama.cpp's `from_float` of the type:
//! its AVX2 `quantize_row_q8_0`, or the reference `quantize_row_q4_0`), a query is
//! quantized once to `Q8_0` ([`Q8Vector`]) and meets each cached key row in the type's
//! dot product (the same kernels as the weight products, so the same bits), and a value
//! row is decoded to f32 (`d · q`) before it is accumulated.

use gguf_format::GgmlType;

use super::activation::{quantize_q8_0_block, ActSet, Q8_0Acts, QK8};
use super::driver::Exec;
use super::formats::{Kernel, Q4_0, Q8_0};
use crate::{DecodePath, DequantError};

/// Bytes of one block of 32 values: an f16 scale and 32 signed bytes.
const Q8_0_BLOCK: usize = 34;
/// Bytes of one block of 32 values: an f16 scale and 32 four-bit values.
const Q4_0_BLOCK: usize = 18;

/// Whether rows of `ty` can be written, read and multiplied here.
pub fn is_row_type(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_0)
}

/// Bytes a row of `cols` values of `ty` takes, or an error naming what does not fit.
pub fn row_bytes(ty: GgmlType, cols: usize) -> Result<usize, DequantError> {
    let block = match ty {
        GgmlType::Q8_0 => Q8_0_BLOCK,
        GgmlType::Q4_0 => Q4_0_BLOCK,
        other => return Err(DequantError::NoProductKernel { ty: other }),
    };
    if !cols.is_multiple_of(QK8) {
        return Err(DequantError::PartialRow {
            ty,
            cols,
            block_size: QK8,
        });
    }
    Ok(cols / QK8 * block)
}

/// The error of a row of `cols` values of `ty` given `actual` bytes instead of `expected`.
fn row_length(ty: GgmlType, cols: usize, expected: usize, actual: usize) -> DequantError {
    DequantError::WeightBytes {
        ty,
        rows: 1,
        cols,
        expected,
        actual,
    }
}

/// Quantizes `x` (a whole number of blocks of 32) into `out` (exactly
/// [`row_bytes`]`(ty, x.len())` bytes) as llama.cpp stores a row of `ty`.
pub fn quantize_row(ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<(), DequantError> {
    let bytes = row_bytes(ty, x.len())?;
    if out.len() != bytes {
        return Err(row_length(ty, x.len(), bytes, out.len()));
    }
    match ty {
        GgmlType::Q8_0 => {
            for (xb, ob) in x.chunks_exact(QK8).zip(out.chunks_exact_mut(Q8_0_BLOCK)) {
                let mut qs = [0i8; QK8];
                let d = quantize_q8_0_block(xb, &mut qs);
                ob[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
                for (o, q) in ob[2..].iter_mut().zip(qs) {
                    *o = q as u8;
                }
            }
        }
        _ => {
            for (xb, ob) in x.chunks_exact(QK8).zip(out.chunks_exact_mut(Q4_0_BLOCK)) {
                quantize_q4_0_block(xb, ob);
            }
        }
    }
    Ok(())
}

/// llama.cpp's `quantize_row_q4_0_ref` for one block: the scale is the value of largest
/// magnitude (the first of equals) over −8, each value `x / d + 8.5` truncated, at most
/// 15.
fn quantize_q4_0_block(x: &[f32], out: &mut [u8]) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
    let half_block = QK8 / 2;
    for j in 0..half_block {
        // `as i8` truncates towards zero (and saturates, as C's conversion does for
        // every value it is defined for), then the minimum keeps 16 out.
        let q0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let q1 = ((x[half_block + j] * id + 8.5) as i8).min(15) as u8;
        out[2 + j] = q0 | (q1 << 4);
    }
}

/// Decodes a row of `ty` (whole blocks) into `out`, one value per element: `d · q`.
pub fn dequantize_row(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    let expected = row_bytes(ty, out.len())?;
    if bytes.len() != expected {
        return Err(row_length(ty, out.len(), expected, bytes.len()));
    }
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has AVX2 and F16C; the lengths were checked above.
        unsafe { avx2::dequantize(ty, bytes, out) };
        return Ok(());
    }
    dequantize_portable(ty, bytes, out);
    Ok(())
}

/// [`dequantize_row`] in plain Rust.
fn dequantize_portable(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    match ty {
        GgmlType::Q8_0 => {
            for (b, o) in bytes
                .chunks_exact(Q8_0_BLOCK)
                .zip(out.chunks_exact_mut(QK8))
            {
                let d = f16(b);
                for (o, &q) in o.iter_mut().zip(&b[2..]) {
                    *o = f32::from(q as i8) * d;
                }
            }
        }
        _ => {
            for (b, o) in bytes
                .chunks_exact(Q4_0_BLOCK)
                .zip(out.chunks_exact_mut(QK8))
            {
                let d = f16(b);
                let (lo, hi) = o.split_at_mut(QK8 / 2);
                for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..]) {
                    *l = f32::from(i16::from(q & 0x0f) as i8 - 8) * d;
                    *h = f32::from((q >> 4) as i8 - 8) * d;
                }
            }
        }
    }
}

/// The decoders on eight lanes: the same products `q · d`, rounded once each.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use gguf_format::GgmlType;

    use super::{Q4_0_BLOCK, Q8_0_BLOCK, QK8};

    /// Whether the CPU has AVX2 and F16C (the standard library caches the detection).
    #[inline(always)]
    pub(super) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("f16c")
    }

    /// Eight signed bytes at `p` as f32, times `d`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn eight(p: *const u8, d: __m256) -> __m256 {
        // SAFETY: the caller has eight bytes at `p`.
        let q = unsafe { _mm_loadl_epi64(p.cast()) };
        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), d)
    }

    /// # Safety
    /// The CPU must have AVX2 and F16C; `bytes` must hold the whole blocks of `out`
    /// (`ty` is `Q8_0` or `Q4_0`).
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) {
        let block = if ty == GgmlType::Q8_0 {
            Q8_0_BLOCK
        } else {
            Q4_0_BLOCK
        };
        for (b, o) in bytes.chunks_exact(block).zip(out.chunks_exact_mut(QK8)) {
            let h = u16::from_le_bytes([b[0], b[1]]);
            let d = _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h)))));
            let o = o.as_mut_ptr();
            if ty == GgmlType::Q8_0 {
                for k in 0..4 {
                    // SAFETY: a block holds 32 values after its scale; `o` 32 lanes.
                    unsafe { _mm256_storeu_ps(o.add(8 * k), eight(b.as_ptr().add(2 + 8 * k), d)) };
                }
            } else {
                // The low nibbles are values 0..16, the high ones 16..32, each less 8.
                let mut q = [0u8; QK8];
                for (j, &x) in b[2..2 + QK8 / 2].iter().enumerate() {
                    q[j] = (x & 0x0f).wrapping_sub(8);
                    q[j + QK8 / 2] = (x >> 4).wrapping_sub(8);
                }
                for k in 0..4 {
                    // SAFETY: `q` holds 32 values; `o` 32 lanes.
                    unsafe { _mm256_storeu_ps(o.add(8 * k), eight(q.as_ptr().add(8 * k), d)) };
                }
            }
        }
    }
}

/// A vector quantized once to `Q8_0` blocks (llama.cpp's `quantize_row_q8_0`) for many
/// dot products with single rows of `Q8_0` or `Q4_0`, each computed as llama.cpp's
/// `ggml_vec_dot_q8_0_q8_0` / `ggml_vec_dot_q4_0_q8_0` computes it.
pub struct Q8Vector {
    acts: Q8_0Acts,
    exec: Exec,
}

impl Q8Vector {
    /// `x` quantized, for products on the fastest path this CPU has.
    pub fn new(x: &[f32]) -> Result<Q8Vector, DequantError> {
        Q8Vector::with_path(x, super::best_path())
    }

    /// `x` quantized, for products on `path` (every path gives the same bits).
    pub fn with_path(x: &[f32], path: DecodePath) -> Result<Q8Vector, DequantError> {
        if !x.len().is_multiple_of(QK8) {
            return Err(DequantError::PartialRow {
                ty: GgmlType::Q8_0,
                cols: x.len(),
                block_size: QK8,
            });
        }
        let exec = Exec::new(path).ok_or(DequantError::PathUnavailable { path })?;
        Ok(Q8Vector {
            acts: Q8_0Acts::prepare(x, 1, x.len()),
            exec,
        })
    }

    /// Values in the vector.
    pub fn len(&self) -> usize {
        self.acts.cols()
    }

    /// Whether the vector is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The dot product of `row` (a row of `ty` with as many values as the vector) and
    /// the vector.
    pub fn dot(&self, ty: GgmlType, row: &[u8]) -> Result<f32, DequantError> {
        let expected = row_bytes(ty, self.len())?;
        if row.len() != expected {
            return Err(row_length(ty, self.len(), expected, row.len()));
        }
        Ok(match ty {
            GgmlType::Q8_0 => self.dot_as::<Q8_0>(row),
            _ => self.dot_as::<Q4_0>(row),
        })
    }

    #[inline(always)]
    fn dot_as<K: Kernel<Acts = Q8_0Acts>>(&self, row: &[u8]) -> f32 {
        let act = self.acts.row(0);
        match self.exec {
            Exec::Portable => K::dot(row, act),
            #[cfg(target_arch = "x86_64")]
            Exec::Avx2(e) => {
                use super::avx2::RowKernels;
                e.dot::<K, 1, 1>([row], [act])[0][0]
            }
            #[cfg(target_arch = "x86_64")]
            Exec::Avx512(e) => {
                use super::avx2::RowKernels;
                e.dot::<K, 1, 1>([row], [act])[0][0]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed);
                (h % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn rows_round_trip_within_half_a_step() {
        let x = sample(96, 7);
        for (ty, steps) in [(GgmlType::Q8_0, 127.0f32), (GgmlType::Q4_0, 8.0)] {
            let mut bytes = vec![0; row_bytes(ty, x.len()).unwrap()];
            quantize_row(ty, &x, &mut bytes).unwrap();
            let mut back = vec![0.0; x.len()];
            dequantize_row(ty, &bytes, &mut back).unwrap();
            for (block, (xb, bb)) in x.chunks(32).zip(back.chunks(32)).enumerate() {
                let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let step = amax / steps;
                for (a, b) in xb.iter().zip(bb) {
                    // Q4_0's positive end is 7 steps, so the largest positive values of a
                    // block led by a negative one are clipped by up to one step.
                    assert!(
                        (a - b).abs() <= step * 1.01,
                        "{ty:?} block {block}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn q4_0_takes_the_first_value_of_largest_magnitude_as_minus_eight() {
        let mut x = vec![0.0f32; 32];
        x[3] = -2.0;
        x[5] = 2.0;
        let mut bytes = [0u8; 18];
        quantize_row(GgmlType::Q4_0, &x, &mut bytes).unwrap();
        let d = half::f16::from_le_bytes([bytes[0], bytes[1]]).to_f32();
        assert_eq!(d, 0.25);
        // x[3] = -2 → -8 → nibble 0; x[5] = 2 → 8 → 16, kept at 15; zeros → 8.
        assert_eq!(bytes[2 + 3] & 0x0f, 0);
        assert_eq!(bytes[2 + 5] & 0x0f, 15);
        assert_eq!(bytes[2] & 0x0f, 8);
    }

    #[test]
    fn every_path_gives_the_same_dot_products() {
        let x = sample(128, 1);
        for ty in [GgmlType::Q8_0, GgmlType::Q4_0] {
            let mut row = vec![0; row_bytes(ty, 128).unwrap()];
            quantize_row(ty, &sample(128, 99), &mut row).unwrap();
            let portable = Q8Vector::with_path(&x, DecodePath::Scalar)
                .unwrap()
                .dot(ty, &row)
                .unwrap();
            for path in [DecodePath::Avx2, DecodePath::Avx512] {
                if let Ok(v) = Q8Vector::with_path(&x, path) {
                    assert_eq!(v.dot(ty, &row).unwrap().to_bits(), portable.to_bits());
                }
            }
            let mut decoded = vec![0.0; 128];
            dequantize_row(ty, &row, &mut decoded).unwrap();
            let exact: f32 = decoded.iter().zip(&x).map(|(a, b)| a * b).sum();
            assert!((portable - exact).abs() < 0.05 * exact.abs().max(1.0));
        }
    }

    #[test]
    fn the_avx2_decoders_give_the_portable_bits() {
        #[cfg(target_arch = "x86_64")]
        if avx2::available() {
            for ty in [GgmlType::Q8_0, GgmlType::Q4_0] {
                let n = 96;
                let mut bytes = vec![0u8; row_bytes(ty, n).unwrap()];
                for (i, b) in bytes.iter_mut().enumerate() {
                    *b = (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3];
                }
                let block = bytes.len() / (n / 32);
                // Scales: ordinary, subnormal, and the largest f16.
                for (k, d) in [0x3555u16, 0x0003, 0x7bff].into_iter().enumerate() {
                    bytes[k * block..k * block + 2].copy_from_slice(&d.to_le_bytes());
                }
                let (mut a, mut b) = (vec![0.0; n], vec![0.0; n]);
                dequantize_portable(ty, &bytes, &mut a);
                // SAFETY: checked above; the lengths match.
                unsafe { avx2::dequantize(ty, &bytes, &mut b) };
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&a), bits(&b), "{ty:?}");
            }
        }
    }

    #[test]
    fn bad_lengths_are_errors() {
        assert!(row_bytes(GgmlType::Q8_0, 33).is_err());
        assert!(row_bytes(GgmlType::Q4_K, 256).is_err());
        let mut out = [0u8; 10];
        assert!(quantize_row(GgmlType::Q8_0, &[0.0; 32], &mut out).is_err());
        let v = Q8Vector::new(&[0.5; 64]).unwrap();
        assert!(v.dot(GgmlType::Q8_0, &[0u8; 34]).is_err());
        assert!(Q8Vector::new(&[0.5; 40]).is_err());
    }
}
