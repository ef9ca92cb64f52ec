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
//! Two implementations exist: an AVX2+FMA+F16C path chosen at run time when the CPU has
//! those features, and a portable path. [`Backend::detect`] says which one
//! [`QuantizedMatrix::matvec`] and [`QuantizedMatrix::matmul`] use;
//! the `*_with` variants force one. Rows are split across rayon's global pool in chunks
//! of many rows. A batch of tokens is quantized once; each chunk of weight rows then
//! stays in cache while every token of the batch passes over it, so a batch reads its
//! weights from memory once.
//!
//! Supported weight types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and
//! Q6_K ([`is_supported`]).

mod activation;
#[cfg(target_arch = "x86_64")]
mod avx2;
mod driver;
mod formats;
mod portable;
#[cfg(test)]
mod tests;

use gguf_format::GgmlType;

/// Which implementation of the kernels runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// Plain Rust, on any CPU.
    Portable,
    /// x86-64 AVX2 with FMA and F16C, when the CPU has them.
    Avx2,
}

impl Backend {
    /// The fastest backend this CPU supports.
    pub fn detect() -> Backend {
        if Backend::Avx2.is_available() {
            Backend::Avx2
        } else {
            Backend::Portable
        }
    }

    /// Whether this CPU can run the backend.
    pub fn is_available(self) -> bool {
        match self {
            Backend::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2 => avx2::Avx2::detect().is_some(),
            #[cfg(not(target_arch = "x86_64"))]
            Backend::Avx2 => false,
        }
    }

    /// A short lower-case name (`"avx2"`, `"portable"`).
    pub fn name(self) -> &'static str {
        match self {
            Backend::Portable => "portable",
            Backend::Avx2 => "avx2",
        }
    }
}

/// What can go wrong when setting up or running a product.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MatmulError {
    /// The weight type has no product kernel.
    #[error("no matrix product kernel for weight type {ty}")]
    UnsupportedType { ty: GgmlType },
    /// A row is not a whole number of blocks.
    #[error("{cols} columns are not a whole number of {ty} blocks of {block_size}")]
    PartialBlock {
        ty: GgmlType,
        cols: usize,
        block_size: usize,
    },
    /// `rows × cols` elements of the type do not fit in memory's address range.
    #[error("a {rows}x{cols} {ty} matrix overflows the address space")]
    SizeOverflow {
        ty: GgmlType,
        rows: usize,
        cols: usize,
    },
    /// The byte slice does not hold exactly `rows × cols` elements.
    #[error("a {rows}x{cols} {ty} matrix takes {expected} bytes, got {actual}")]
    WeightBytes {
        ty: GgmlType,
        rows: usize,
        cols: usize,
        expected: usize,
        actual: usize,
    },
    /// The input has the wrong number of values.
    #[error(
        "input holds {actual} values, expected {n_tokens} tokens x {cols} columns = {expected}"
    )]
    InputLength {
        n_tokens: usize,
        cols: usize,
        expected: usize,
        actual: usize,
    },
    /// The output has the wrong number of values.
    #[error("output holds {actual} values, expected {n_tokens} tokens x {rows} rows = {expected}")]
    OutputLength {
        n_tokens: usize,
        rows: usize,
        expected: usize,
        actual: usize,
    },
    /// The requested backend cannot run on this CPU.
    #[error("backend {} is not available on this cpu", backend.name())]
    BackendUnavailable { backend: Backend },
}

/// Whether [`QuantizedMatrix`] has kernels for the weight type `ty`.
pub fn is_supported(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(
        ty,
        F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4_K | Q5_K | Q6_K
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
    ) -> Result<QuantizedMatrix<'a>, MatmulError> {
        if !is_supported(ty) {
            return Err(MatmulError::UnsupportedType { ty });
        }
        let block_size = ty.block_size() as usize;
        if cols % block_size != 0 {
            return Err(MatmulError::PartialBlock {
                ty,
                cols,
                block_size,
            });
        }
        let overflow = MatmulError::SizeOverflow { ty, rows, cols };
        let row_bytes = (cols / block_size)
            .checked_mul(ty.type_size() as usize)
            .ok_or(overflow.clone())?;
        let expected = row_bytes.checked_mul(rows).ok_or(overflow)?;
        if bytes.len() != expected {
            return Err(MatmulError::WeightBytes {
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
    pub fn matvec(&self, x: &[f32], y: &mut [f32]) -> Result<(), MatmulError> {
        self.matmul_with(Backend::detect(), x, 1, y)
    }

    /// [`QuantizedMatrix::matvec`] on a chosen backend.
    pub fn matvec_with(
        &self,
        backend: Backend,
        x: &[f32],
        y: &mut [f32],
    ) -> Result<(), MatmulError> {
        self.matmul_with(backend, x, 1, y)
    }

    /// `Y = X · Wᵀ` for a batch: `x` holds `n_tokens × cols` values (token-major), `y`
    /// receives `n_tokens × rows` values (token-major).
    pub fn matmul(&self, x: &[f32], n_tokens: usize, y: &mut [f32]) -> Result<(), MatmulError> {
        self.matmul_with(Backend::detect(), x, n_tokens, y)
    }

    /// [`QuantizedMatrix::matmul`] on a chosen backend.
    pub fn matmul_with(
        &self,
        backend: Backend,
        x: &[f32],
        n_tokens: usize,
        y: &mut [f32],
    ) -> Result<(), MatmulError> {
        let (rows, cols) = (self.rows, self.cols);
        let expected_x = n_tokens.checked_mul(cols);
        if expected_x != Some(x.len()) {
            return Err(MatmulError::InputLength {
                n_tokens,
                cols,
                expected: expected_x.unwrap_or(usize::MAX),
                actual: x.len(),
            });
        }
        let expected_y = n_tokens.checked_mul(rows);
        if expected_y != Some(y.len()) {
            return Err(MatmulError::OutputLength {
                n_tokens,
                rows,
                expected: expected_y.unwrap_or(usize::MAX),
                actual: y.len(),
            });
        }
        let exec = driver::Exec::new(backend).ok_or(MatmulError::BackendUnavailable { backend })?;
        if y.is_empty() {
            return Ok(());
        }
        if cols == 0 {
            y.fill(0.0);
            return Ok(());
        }
        driver::run(self, exec, x, n_tokens, y)
    }
}
