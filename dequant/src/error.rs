//! The errors of decoding and of the matrix products.

use gguf_format::GgmlType;

use crate::DecodePath;

/// What can go wrong when decoding a tensor's bytes or multiplying by them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    /// The input is not a whole number of blocks.
    #[error("{bytes} bytes are not a whole number of {ty} blocks of {block_bytes} bytes")]
    PartialBlock {
        ty: GgmlType,
        bytes: usize,
        block_bytes: usize,
    },
    /// The output slice does not hold exactly as many values as the input decodes to.
    #[error("{blocks} blocks of {ty} decode to {expected} values, the output holds {actual}")]
    OutputLength {
        ty: GgmlType,
        blocks: usize,
        expected: usize,
        actual: usize,
    },
    /// The requested decode path cannot run on this CPU.
    #[error("decode path {} is not available on this cpu", path.name())]
    PathUnavailable { path: DecodePath },
    /// The weight type has no matrix product kernel.
    #[error("no matrix product kernel for weight type {ty}")]
    NoProductKernel { ty: GgmlType },
    /// A weight row is not a whole number of blocks.
    #[error("{cols} columns are not a whole number of {ty} blocks of {block_size} values")]
    PartialRow {
        ty: GgmlType,
        cols: usize,
        block_size: usize,
    },
    /// `rows × cols` weights do not fit in the address space.
    #[error("a {rows}x{cols} {ty} matrix overflows the address space")]
    MatrixTooLarge {
        ty: GgmlType,
        rows: usize,
        cols: usize,
    },
    /// The weight bytes do not hold exactly `rows × cols` values.
    #[error("a {rows}x{cols} {ty} matrix takes {expected} bytes, got {actual}")]
    WeightBytes {
        ty: GgmlType,
        rows: usize,
        cols: usize,
        expected: usize,
        actual: usize,
    },
    /// A product's input has the wrong number of values.
    #[error(
        "input holds {actual} values, expected {n_tokens} tokens x {cols} columns = {expected}"
    )]
    InputLength {
        n_tokens: usize,
        cols: usize,
        expected: usize,
        actual: usize,
    },
    /// A product's output has the wrong number of values.
    #[error("output holds {actual} values, expected {n_tokens} tokens x {rows} rows = {expected}")]
    ProductOutputLength {
        n_tokens: usize,
        rows: usize,
        expected: usize,
        actual: usize,
    },
    /// A decode product asked for a number of tokens it does not take.
    #[error("a decode product takes 1 to {max} tokens, not {n_tokens}")]
    ProductTokens { n_tokens: usize, max: usize },
    /// A fused product got a different number of matrices and outputs.
    #[error("{matrices} matrices but {outputs} outputs in one fused product")]
    ProductCount { matrices: usize, outputs: usize },
    /// A fused product's matrices differ in type or width.
    #[error(
        "a fused product needs one type and width: {} x {} columns against {} x {} columns",
        first.0, first.1, other.0, other.1
    )]
    MixedProducts {
        first: (GgmlType, usize),
        other: (GgmlType, usize),
    },
    /// Experts placed by a table of addresses in a product that reads them packed (only
    /// the decode products take a table), or mixed with packed ones in one launch.
    #[error(
        "experts placed by a table of addresses take the decode products alone (Q8 input, \
         tiles of one slot), all of them placed that way; not tiles of {tile_tokens}"
    )]
    TableExperts { tile_tokens: usize },
}

impl DequantError {
    /// Refuses `actual` activations unless they are `n_tokens` rows of `cols` values.
    pub(crate) fn check_input(actual: usize, n_tokens: usize, cols: usize) -> Result<(), Self> {
        Self::check_input_of(actual, n_tokens, cols, n_tokens.saturating_mul(cols))
    }

    /// Refuses `actual` units of the input of `n_tokens` rows of `cols` values unless
    /// they are the `expected` (bytes of Q8 blocks, say).
    pub(crate) fn check_input_of(
        actual: usize,
        n_tokens: usize,
        cols: usize,
        expected: usize,
    ) -> Result<(), Self> {
        if actual != expected {
            return Err(DequantError::InputLength {
                n_tokens,
                cols,
                expected,
                actual,
            });
        }
        Ok(())
    }

    /// Refuses an output of `actual` values unless it holds `n_tokens` rows of `rows`.
    pub(crate) fn check_output(actual: usize, n_tokens: usize, rows: usize) -> Result<(), Self> {
        let expected = n_tokens.saturating_mul(rows);
        if actual != expected {
            return Err(DequantError::ProductOutputLength {
                n_tokens,
                rows,
                expected,
                actual,
            });
        }
        Ok(())
    }
}
