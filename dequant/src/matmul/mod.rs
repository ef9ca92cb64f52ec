//! Matrix-vector and matrix-matrix products computed directly on quantized GGUF blocks.
//!
//! A [`QuantizedMatrix`] borrows a weight tensor's bytes exactly as the file stores them
//! (a zero-copy slice of the mapping): `rows` rows of `cols` values, each row a whole
//! number of blocks. Nothing is dequantized ahead of time. Instead the activations are
//! quantized once per call to 8-bit blocks, 32 values per f32 scale for the legacy
//! formats and 256 values per scale with sums per 16 for the k-quants, and each weight
//! block meets them in an integer dot product whose result is scaled and accumulated in
//! f32. Float weights (F32, F16, BF16) are multiplied with f32 activations.
//!
//! Three implementations exist, chosen by [`DecodePath`], and all give the same bits:
//! AVX2 (with FMA and F16C) when the CPU has those features, AVX-512 with VNNI for the
//! `Q4_K`, `Q5_K` and `Q6_K` kernels (and AVX2 for the rest) when it has those, and plain Rust
//! ([`DecodePath::Scalar`]) everywhere. [`QuantizedMatrix::matvec`] and
//! [`QuantizedMatrix::matmul`] use [`best_path`]; the `*_with` variants force one.
//!
//! Work is shared out over rayon's global pool: a single token by chunks of rows (four
//! rows per kernel call, the next rows prefetched), a batch by rows or by tokens,
//! whichever makes the tasks read fewer bytes. A batch is quantized once and, within a
//! task, blocks of rows small enough to stay in L2 meet tiles of tokens small enough to
//! stay in L1, so each task reads its weights from memory once. Call the
//! products from one of the pool's threads (run the forward pass inside
//! `ThreadPool::install` or `rayon::scope`): from any other thread each call hands its
//! work to the pool and waits, which costs 10–20 µs on a small VM, as much as a
//! 576×576 product; products too small to pay for that run on the calling thread.
//!
//! Supported weight types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K,
//! Q5_K, Q6_K, IQ4_NL, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M,
//! TQ1_0, TQ2_0 and MXFP4 ([`is_supported`]).

mod activation;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod driver;
mod formats;
mod grids;
mod portable;
pub mod rows;
#[cfg(test)]
mod tests;

use gguf_format::GgmlType;
use rayon::prelude::*;

use crate::{DecodePath, DequantError};

/// Whether [`best_path`] may choose [`DecodePath::Avx512`]: see [`set_avx512_allowed`].
static AVX512_ALLOWED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether [`best_path`] may choose the AVX-512 kernels (it may unless told otherwise);
/// `false` keeps the products on the AVX2 ones, to time them on the same machine. The
/// choice is made once per process, at the first product (or call of [`best_path`]):
/// call this before, once, from the program's `main`; later calls change nothing.
pub fn set_avx512_allowed(allowed: bool) {
    AVX512_ALLOWED.store(allowed, std::sync::atomic::Ordering::Relaxed);
}

/// The fastest path the products can take on this CPU: [`DecodePath::Avx512`] when it
/// has AVX-512 F, BW, VL and VNNI (unless [`set_avx512_allowed`] said otherwise), else
/// [`DecodePath::Avx2`] when it has AVX2, FMA and F16C, else [`DecodePath::Scalar`].
/// Every path gives the same bits. Decided once per process.
pub fn best_path() -> DecodePath {
    static BEST: std::sync::OnceLock<DecodePath> = std::sync::OnceLock::new();
    *BEST.get_or_init(|| {
        let avx512_allowed = AVX512_ALLOWED.load(std::sync::atomic::Ordering::Relaxed);
        if avx512_allowed && is_path_available(DecodePath::Avx512) {
            DecodePath::Avx512
        } else if is_path_available(DecodePath::Avx2) {
            DecodePath::Avx2
        } else {
            DecodePath::Scalar
        }
    })
}

/// Whether the products can take `path` on this CPU (AVX2 also needs FMA here, AVX-512
/// VNNI besides F, BW and VL).
pub fn is_path_available(path: DecodePath) -> bool {
    driver::Exec::new(path).is_some()
}

/// Whether [`QuantizedMatrix`] has kernels for the weight type `ty`.
pub fn is_supported(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16
            | BF16
            | Q4_0
            | Q4_1
            | Q5_0
            | Q5_1
            | Q8_0
            | Q2_K
            | Q3_K
            | Q4_K
            | Q5_K
            | Q6_K
            | IQ4_NL
            | IQ4_XS
            | IQ3_S
            | IQ3_XXS
            | IQ2_XXS
            | IQ2_XS
            | IQ2_S
            | IQ1_S
            | IQ1_M
            | TQ1_0
            | TQ2_0
            | MXFP4
    )
}

/// A weight matrix of `rows × cols` elements borrowed in its GGUF block layout.
///
/// Row `r` holds output feature `r`: GGUF's `ne0` is `cols`, `ne1` is `rows`.
#[derive(Clone, Copy, Debug)]
pub struct QuantizedMatrix<'a> {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    row_bytes: usize,
    bytes: &'a [u8],
}

impl<'a> QuantizedMatrix<'a> {
    /// Wraps `bytes` as a `rows × cols` matrix of type `ty`, checking that the type has
    /// kernels, that rows are whole blocks, and that `bytes` holds exactly the matrix.
    pub fn new(
        ty: GgmlType,
        rows: usize,
        cols: usize,
        bytes: &'a [u8],
    ) -> Result<QuantizedMatrix<'a>, DequantError> {
        if !is_supported(ty) {
            return Err(DequantError::NoProductKernel { ty });
        }
        let block_size = ty.block_size() as usize;
        if !cols.is_multiple_of(block_size) {
            return Err(DequantError::PartialRow {
                ty,
                cols,
                block_size,
            });
        }
        let overflow = DequantError::MatrixTooLarge { ty, rows, cols };
        let row_bytes = (cols / block_size)
            .checked_mul(ty.type_size() as usize)
            .ok_or(overflow.clone())?;
        let expected = row_bytes.checked_mul(rows).ok_or(overflow)?;
        if bytes.len() != expected {
            return Err(DequantError::WeightBytes {
                ty,
                rows,
                cols,
                expected,
                actual: bytes.len(),
            });
        }
        Ok(QuantizedMatrix {
            ty,
            rows,
            cols,
            row_bytes,
            bytes,
        })
    }

    /// The weight type.
    pub fn ty(&self) -> GgmlType {
        self.ty
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// The borrowed weight bytes.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// `y = W · x` for one token: `x` holds `cols` values, `y` receives `rows`.
    pub fn matvec(&self, x: &[f32], y: &mut [f32]) -> Result<(), DequantError> {
        self.matmul_with(best_path(), x, 1, y)
    }

    /// [`QuantizedMatrix::matvec`] on a chosen path.
    pub fn matvec_with(
        &self,
        path: DecodePath,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<(), DequantError> {
        self.matmul_with(path, x, 1, y)
    }

    /// `y_i = W_i · x` for one token and several matrices of the same type and width
    /// (the query, key and value projections of a layer, say): the activations are
    /// prepared once and all the rows share one parallel loop, which saves a small
    /// model more than the products' own time at decode. Each `ys[i]` receives exactly
    /// what `matrices[i].matvec(x, ys[i])` would.
    pub fn matvec_many(
        matrices: &[QuantizedMatrix<'_>],
        x: &[f32],
        ys: &mut [&mut [f32]],
    ) -> Result<(), DequantError> {
        let Some(first) = matrices.first() else {
            return Ok(());
        };
        if matrices.len() != ys.len() {
            return Err(DequantError::ProductCount {
                matrices: matrices.len(),
                outputs: ys.len(),
            });
        }
        for (m, y) in matrices.iter().zip(ys.iter()) {
            if m.ty() != first.ty() || m.cols() != first.cols() {
                return Err(DequantError::MixedProducts {
                    first: (first.ty(), first.cols()),
                    other: (m.ty(), m.cols()),
                });
            }
            m.check_lengths(x, 1, y)?;
        }
        let path = best_path();
        let exec = driver::Exec::new(path).ok_or(DequantError::PathUnavailable { path })?;
        if first.cols() == 0 {
            ys.iter_mut().for_each(|y| y.fill(0.0));
            return Ok(());
        }
        driver::run_many(matrices, exec, x, ys)
    }

    /// `Y = X · Wᵀ` for a batch: `x` holds `n_tokens × cols` values (token-major), `y`
    /// receives `n_tokens × rows` values (token-major).
    pub fn matmul(&self, x: &[f32], n_tokens: usize, y: &mut [f32]) -> Result<(), DequantError> {
        self.matmul_with(best_path(), x, n_tokens, y)
    }

    /// [`QuantizedMatrix::matmul`] on a chosen path.
    pub fn matmul_with(
        &self,
        path: DecodePath,
        x: &[f32],
        n_tokens: usize,
        y: &mut [f32],
    ) -> Result<(), DequantError> {
        self.run(path, x, n_tokens, y, false)
    }

    /// The product on `path`, of routed tokens with `routed` (see
    /// [`QuantizedMatrix::matmul_routed`]).
    fn run(
        &self,
        path: DecodePath,
        x: &[f32],
        n_tokens: usize,
        y: &mut [f32],
        routed: bool,
    ) -> Result<(), DequantError> {
        self.check_lengths(x, n_tokens, y)?;
        let exec = driver::Exec::new(path).ok_or(DequantError::PathUnavailable { path })?;
        if y.is_empty() {
            return Ok(());
        }
        if self.cols == 0 {
            y.fill(0.0);
            return Ok(());
        }
        driver::run(self, exec, x, n_tokens, y, routed)
    }

    /// `Y = X · Wᵀ` for the tokens a mixture-of-experts router sent to this matrix (one
    /// expert's slice of a 3-D expert tensor), with the arithmetic llama.cpp's
    /// `MUL_MAT_ID` gives them on the CPU: each token's own dot products (its GEMV for a
    /// repacked matrix), except that a group of 8 tokens or more meets a k-quant or
    /// i-quant matrix it does not repack in its tiled GEMM, as a dense batch does. Shapes
    /// as for [`QuantizedMatrix::matmul`].
    pub fn matmul_routed(
        &self,
        x: &[f32],
        n_tokens: usize,
        y: &mut [f32],
    ) -> Result<(), DequantError> {
        self.check_lengths(x, n_tokens, y)?;
        if n_tokens <= 1 || self.routed_batch_is_dense() {
            return self.matmul(x, n_tokens, y);
        }
        if self.ty == GgmlType::Q4_K {
            // Repacked: the batched kernels give each token its GEMV when told.
            return self.run(best_path(), x, n_tokens, y, true);
        }
        // Each token's GEMV, the tokens side by side: a row's dot product is the same
        // whichever thread computes it.
        let (cols, rows) = (self.cols, self.rows);
        x.par_chunks_exact(cols)
            .zip(y.par_chunks_exact_mut(rows))
            .try_for_each(|(xt, yt)| self.matvec(xt, yt))
    }

    /// Whether llama.cpp multiplies a group of routed tokens with this matrix as it does
    /// a dense batch of as many tokens: the formats whose activations are 256-value
    /// super-blocks, unless repacked (their batches go to the tiled GEMM from 8 tokens
    /// on, for dense and routed tokens alike). The float and legacy formats' batches take
    /// llamafile's GEMM, which `MUL_MAT_ID` never calls, and repacked matrices the
    /// repacked GEMM, which it never calls either.
    fn routed_batch_is_dense(&self) -> bool {
        use GgmlType::*;
        match self.ty {
            Q2_K | Q3_K | Q5_K | Q6_K | IQ4_XS | IQ3_S | IQ3_XXS | IQ2_XXS | IQ2_XS | IQ2_S
            | IQ1_S | IQ1_M | TQ1_0 | TQ2_0 => true,
            Q4_K => !driver::repacked(self),
            _ => false,
        }
    }

    /// That `x` holds `n_tokens` rows of `cols` values and `y` `n_tokens` of `rows`.
    fn check_lengths(&self, x: &[f32], n_tokens: usize, y: &[f32]) -> Result<(), DequantError> {
        DequantError::check_input(x.len(), n_tokens, self.cols)?;
        DequantError::check_output(y.len(), n_tokens, self.rows)
    }
}
