//! What precision a KV cache keeps keys and values at (llama.cpp's `--cache-type-k` and
//! `--cache-type-v`), the rows stored at it, and the rotation llama.cpp applies around a
//! quantized cache.
//!
//! - `f16`, the default: every value rounded to f16 (kept in f32 here, so the attention
//!   needs no conversion).
//! - `q8_0`, `q4_0`: rows in the GGUF block formats of those names, 32 values a block
//!   with an f16 scale: 34 and 18 bytes a block, against f16's 64. They are written as
//!   llama.cpp writes them and read by its kernels ([`dequant::matmul::rows`]).
//!
//! llama.cpp (as of the version the references come from) rotates what a quantized cache
//! holds: before attention, queries and keys are multiplied by a normalised
//! Walsh-Hadamard matrix (when keys are quantized and the key head size is a multiple of
//! 64; the matrix is the largest power of two from 64 that divides the head), values by
//! one of size 64 (when values are quantized and the value head size is a multiple of
//! 64), and the attention's output by that one again (the matrix is its own inverse).
//! Rotated rows spread an outlier over the whole block, so the blocks lose less to
//! quantization. [`fwht`] computes the product as ggml's CPU backend does.

use gguf_format::GgmlType;

use crate::config::ModelConfig;
use crate::ops::{round_f16, AttentionMethod, CacheRows};
use crate::ModelError;

/// The precision keys or values are stored at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvType {
    /// Rounded to f16 (llama.cpp's default cache).
    #[default]
    F16,
    /// `Q8_0` blocks: 8.5 bits a value.
    Q8_0,
    /// `Q4_0` blocks: 4.5 bits a value.
    Q4_0,
}

/// Values per block of the quantized types.
const BLOCK: usize = 32;

impl KvType {
    /// Every type, in the order the command line lists them.
    pub const ALL: [KvType; 3] = [KvType::F16, KvType::Q8_0, KvType::Q4_0];

    /// llama.cpp's name for the type (`f16`, `q8_0`, `q4_0`).
    pub fn name(self) -> &'static str {
        match self {
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
            KvType::Q4_0 => "q4_0",
        }
    }

    /// The type named `name` (llama.cpp's names), or an error listing those there are.
    pub fn parse(name: &str) -> Result<KvType, String> {
        KvType::ALL
            .into_iter()
            .find(|t| t.name() == name)
            .ok_or_else(|| format!("cache type {name:?} is not one of f16, q8_0, q4_0"))
    }

    /// Whether rows are stored in blocks.
    pub fn is_quantized(self) -> bool {
        self != KvType::F16
    }

    fn ggml(self) -> Option<GgmlType> {
        match self {
            KvType::F16 => None,
            KvType::Q8_0 => Some(GgmlType::Q8_0),
            KvType::Q4_0 => Some(GgmlType::Q4_0),
        }
    }

    /// Bytes a row of `dim` values takes at this precision (f16: two a value, as in
    /// llama.cpp; this CPU cache keeps f16 rows as f32, twice that).
    pub fn row_bytes(self, dim: usize) -> usize {
        match self {
            KvType::F16 => 2 * dim,
            KvType::Q8_0 => dim / BLOCK * 34,
            KvType::Q4_0 => dim / BLOCK * 18,
        }
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The precisions of a cache's keys and of its values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KvTypes {
    pub k: KvType,
    pub v: KvType,
}

impl KvTypes {
    /// Whether either is quantized.
    pub fn is_quantized(self) -> bool {
        self.k.is_quantized() || self.v.is_quantized()
    }

    /// Refuses what llama.cpp refuses for `config`'s model computed by `method`, and
    /// what this engine does not compute: a quantized type needs head sizes that are
    /// whole blocks, and flash attention (llama.cpp allows quantized keys without it,
    /// through matrix-product kernels not reproduced here).
    pub fn check(self, config: &ModelConfig, method: AttentionMethod) -> Result<(), ModelError> {
        for (what, ty, dim) in [
            ("K", self.k, config.head_dim),
            ("V", self.v, config.head_dim_v),
        ] {
            if ty.is_quantized() && !dim.is_multiple_of(BLOCK) {
                return Err(ModelError::CacheType {
                    reason: format!(
                        "a {ty} {what} cache needs a head size that is a multiple of \
                         {BLOCK}; this model's is {dim}"
                    ),
                });
            }
            if ty.is_quantized() && method == AttentionMethod::Matmul {
                return Err(ModelError::CacheType {
                    reason: format!(
                        "a {ty} {what} cache is computed with flash attention; \
                         --flash-attn off takes an f16 cache"
                    ),
                });
            }
        }
        Ok(())
    }

    /// Bytes one position's keys and values take in every layer of `config`'s model
    /// at these types (f16 at two bytes a value, as llama.cpp counts it).
    pub fn bytes_per_position(self, config: &ModelConfig) -> usize {
        let (k_dim, v_dim) = (
            config.n_kv_heads * config.head_dim,
            config.n_kv_heads * config.head_dim_v,
        );
        config.n_layers * (self.k.row_bytes(k_dim) + self.v.row_bytes(v_dim))
    }

    /// The size of the rotation of queries and keys for a key head of `head_dim`, when
    /// there is one.
    pub(crate) fn k_rotation(self, head_dim: usize) -> Option<usize> {
        if !self.k.is_quantized() || !head_dim.is_multiple_of(64) {
            return None;
        }
        let mut n = 64;
        while head_dim.is_multiple_of(2 * n) {
            n *= 2;
        }
        Some(n)
    }

    /// The size of the rotation of values and outputs for a value head of
    /// `head_dim_v`, when there is one.
    pub(crate) fn v_rotation(self, head_dim_v: usize) -> Option<usize> {
        (self.v.is_quantized() && head_dim_v.is_multiple_of(64)).then_some(64)
    }
}

/// `x` (whole rows of `n` values, `n` a power of two) multiplied row by row by the
/// normalised `n × n` Walsh-Hadamard matrix, as ggml's CPU backend computes it: each
/// value scaled by `1/√n` first, then `log2 n` passes of sums and differences.
pub(crate) fn fwht(x: &mut [f32], n: usize) {
    debug_assert!(n.is_power_of_two() && x.len().is_multiple_of(n));
    let scale = 1.0 / (n as f32).sqrt();
    for row in x.chunks_exact_mut(n) {
        for v in row.iter_mut() {
            *v *= scale;
        }
        let mut len = 1;
        while len < n {
            for pair in row.chunks_exact_mut(2 * len) {
                let (a, b) = pair.split_at_mut(len);
                for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                    let (s, d) = (*u + *v, *u - *v);
                    *u = s;
                    *v = d;
                }
            }
            len *= 2;
        }
    }
}

/// Rows of one layer's keys or values at one precision.
#[derive(Clone, Debug)]
pub(crate) struct RowStore {
    ty: KvType,
    dim: usize,
    row_bytes: usize,
    /// f16 rows (as f32).
    floats: Vec<f32>,
    /// Quantized rows.
    bytes: Vec<u8>,
}

impl RowStore {
    /// An empty store of rows of `dim` values, with room reserved for `rows`.
    pub(crate) fn with_capacity(ty: KvType, dim: usize, rows: usize) -> RowStore {
        let mut s = RowStore {
            ty,
            dim,
            row_bytes: ty.row_bytes(dim),
            floats: Vec::new(),
            bytes: Vec::new(),
        };
        match ty.ggml() {
            None => s.floats.reserve_exact(rows * dim),
            Some(_) => s.bytes.reserve_exact(rows * s.row_bytes),
        }
        s
    }

    /// A store of `rows` zeroed rows.
    pub(crate) fn zeroed(ty: KvType, dim: usize, rows: usize) -> RowStore {
        let mut s = RowStore::with_capacity(ty, dim, 0);
        match ty.ggml() {
            None => s.floats = vec![0.0; rows * dim],
            Some(_) => s.bytes = vec![0; rows * s.row_bytes],
        }
        s
    }

    /// Appends whole rows.
    pub(crate) fn push(&mut self, x: &[f32]) {
        match self.ty.ggml() {
            None => self.floats.extend(x.iter().map(|&v| round_f16(v))),
            Some(ty) => {
                let start = self.bytes.len();
                self.bytes
                    .resize(start + x.len() / self.dim * self.row_bytes, 0);
                quantize(ty, x, self.dim, &mut self.bytes[start..]);
            }
        }
    }

    /// Overwrites row `row` (which exists) with `x`.
    pub(crate) fn write(&mut self, row: usize, x: &[f32]) {
        match self.ty.ggml() {
            None => {
                let dst = &mut self.floats[row * self.dim..(row + 1) * self.dim];
                for (d, &s) in dst.iter_mut().zip(x) {
                    *d = round_f16(s);
                }
            }
            Some(ty) => {
                let rb = self.row_bytes;
                quantize(ty, x, self.dim, &mut self.bytes[row * rb..(row + 1) * rb]);
            }
        }
    }

    /// Removes rows `range`, moving the later ones down.
    pub(crate) fn remove_rows(&mut self, range: std::ops::Range<usize>) {
        match self.ty.ggml() {
            None => {
                self.floats
                    .drain(range.start * self.dim..range.end * self.dim);
            }
            Some(_) => {
                let rb = self.row_bytes;
                self.bytes.drain(range.start * rb..range.end * rb);
            }
        }
    }

    /// Row `row`'s values into `out` (`dim` of them), decoded when quantized.
    pub(crate) fn read(&self, row: usize, out: &mut [f32]) {
        match self.view() {
            CacheRows::F16(f) => out.copy_from_slice(&f[row * self.dim..(row + 1) * self.dim]),
            CacheRows::Quant {
                ty,
                bytes,
                row_bytes,
            } => dequant::matmul::rows::dequantize_row(
                ty,
                &bytes[row * row_bytes..(row + 1) * row_bytes],
                out,
            )
            .expect("whole blocks"),
        }
    }

    /// Keeps the first `rows` rows.
    pub(crate) fn truncate(&mut self, rows: usize) {
        self.floats.truncate(rows * self.dim);
        self.bytes.truncate(rows * self.row_bytes);
    }

    /// Forgets every row, keeping the memory.
    pub(crate) fn clear(&mut self) {
        self.truncate(0);
    }

    /// The rows, to read.
    pub(crate) fn view(&self) -> CacheRows<'_> {
        match self.ty.ggml() {
            None => CacheRows::F16(&self.floats),
            Some(ty) => CacheRows::Quant {
                ty,
                bytes: &self.bytes,
                row_bytes: self.row_bytes,
            },
        }
    }

    /// Row `row`'s values (decoded when quantized), appended to `out`.
    #[cfg(test)]
    pub(crate) fn extend_row(&self, row: usize, out: &mut Vec<f32>) {
        match self.view() {
            CacheRows::F16(f) => out.extend_from_slice(&f[row * self.dim..(row + 1) * self.dim]),
            CacheRows::Quant {
                ty,
                bytes,
                row_bytes,
            } => {
                let start = out.len();
                out.resize(start + self.dim, 0.0);
                dequant::matmul::rows::dequantize_row(
                    ty,
                    &bytes[row * row_bytes..(row + 1) * row_bytes],
                    &mut out[start..],
                )
                .expect("whole blocks");
            }
        }
    }
}

/// Rows of `dim` values quantized into `out` (whole rows, whole blocks: checked when the
/// cache was made).
fn quantize(ty: GgmlType, x: &[f32], dim: usize, out: &mut [u8]) {
    let rb = out.len() / (x.len() / dim.max(1)).max(1);
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(rb)) {
        dequant::matmul::rows::quantize_row(ty, xr, or).expect("whole blocks");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The normalised Walsh-Hadamard matrix of size `n`, built by doubling as llama.cpp
    /// builds it.
    fn hadamard(n: usize) -> Vec<f32> {
        let mut h = vec![0.0f32; n * n];
        h[0] = 1.0 / (n as f32).sqrt();
        let mut s = 1;
        while s < n {
            for i in 0..s {
                for j in 0..s {
                    let v = h[i * n + j];
                    h[(i + s) * n + j] = v;
                    h[i * n + j + s] = v;
                    h[(i + s) * n + j + s] = -v;
                }
            }
            s *= 2;
        }
        h
    }

    #[test]
    fn fwht_is_the_hadamard_product_and_its_own_inverse() {
        for n in [64, 128, 256] {
            let x: Vec<f32> = (0..2 * n)
                .map(|i| ((i * 7919) % 113) as f32 / 50.0 - 1.1)
                .collect();
            let mut y = x.clone();
            fwht(&mut y, n);
            let h = hadamard(n);
            for (row, (xr, yr)) in x.chunks(n).zip(y.chunks(n)).enumerate() {
                for i in 0..n {
                    let expected: f64 = (0..n)
                        .map(|j| f64::from(h[i * n + j]) * f64::from(xr[j]))
                        .sum();
                    assert!(
                        (f64::from(yr[i]) - expected).abs() < 1e-5,
                        "n {n} row {row} {i}"
                    );
                }
            }
            fwht(&mut y, n);
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn rotations_follow_llama_cpp_s_sizes() {
        let q8 = KvTypes {
            k: KvType::Q8_0,
            v: KvType::Q8_0,
        };
        assert_eq!(q8.k_rotation(64), Some(64));
        assert_eq!(q8.k_rotation(128), Some(128));
        assert_eq!(q8.k_rotation(192), Some(64));
        assert_eq!(q8.k_rotation(256), Some(256));
        assert_eq!(q8.k_rotation(96), None);
        assert_eq!(q8.v_rotation(256), Some(64));
        assert_eq!(q8.v_rotation(32), None);
        assert_eq!(KvTypes::default().k_rotation(128), None);
        assert_eq!(KvTypes::default().v_rotation(128), None);
    }

    #[test]
    fn names_parse_and_sizes_count_blocks() {
        for t in KvType::ALL {
            assert_eq!(KvType::parse(t.name()), Ok(t));
        }
        assert!(KvType::parse("q5_1").unwrap_err().contains("q5_1"));
        assert_eq!(KvType::F16.row_bytes(128), 256);
        assert_eq!(KvType::Q8_0.row_bytes(128), 136);
        assert_eq!(KvType::Q4_0.row_bytes(128), 72);
    }

    #[test]
    fn stores_append_overwrite_and_truncate_rows() {
        let row = |seed: f32| (0..64).map(|i| (i as f32 * seed).sin()).collect::<Vec<_>>();
        for ty in KvType::ALL {
            let mut s = RowStore::with_capacity(ty, 64, 4);
            s.push(&[row(0.1), row(0.2)].concat());
            s.write(0, &row(0.3));
            let (mut r0, mut r1) = (Vec::new(), Vec::new());
            s.extend_row(0, &mut r0);
            s.extend_row(1, &mut r1);
            let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 0.3);
            assert!(close(&r0, &row(0.3)) && close(&r1, &row(0.2)), "{ty}");
            s.truncate(1);
            match s.view() {
                CacheRows::F16(f) => assert_eq!(f.len(), 64),
                CacheRows::Quant {
                    bytes, row_bytes, ..
                } => assert_eq!(bytes.len(), row_bytes),
            }
        }
    }
}
