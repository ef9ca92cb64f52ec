//! Activations prepared for the dot products: quantized to 8-bit blocks for the
//! quantized weight formats, copied as f32 for the float ones.
//!
//! Every set holds `n_tokens` rows of `cols` values, token-major. Quantization is
//! symmetric: a block's scale is `max|x| / 127` and each value is `x / scale` rounded to
//! the nearest integer, ties to even, so every value lies in `-127..=127`.

/// Elements per block of the legacy formats (`Q4_0` … `Q8_0`) and of [`Q8Acts`].
pub(crate) const QK8: usize = 32;
/// Elements per super-block of the k-quants and of [`Q8KActs`].
pub(crate) const QK_K: usize = 256;
/// Elements summed into one entry of [`Q8KRow::bsums`].
pub(crate) const BSUM_GROUP: usize = 16;

/// A set of prepared activations, one row per token.
pub(crate) trait ActSet: Sync + 'static {
    /// A borrowed view of one token's row.
    type Row<'a>: Copy
    where
        Self: 'a;

    /// Prepares `n_tokens` rows of `cols` values from `x` (`x.len() == n_tokens * cols`,
    /// `cols` a multiple of the set's block).
    fn prepare(x: &[f32], n_tokens: usize, cols: usize) -> Self;

    /// Token `t`'s row.
    fn row(&self, t: usize) -> Self::Row<'_>;

    /// Values per row.
    fn cols(&self) -> usize;

    /// Bytes one row of `cols` values occupies, to size tiles and splits.
    fn row_bytes(cols: usize) -> usize;
}

/// Values from which quantization is shared out over rayon's pool, by blocks.
const PARALLEL_VALUES: usize = 1 << 16;

/// Adding and subtracting 1.5 · 2^23 rounds an f32 of magnitude below 2^22 to the
/// nearest integer, ties to even (the default rounding mode), as `round_ties_even`
/// does; unlike it, this needs no SSE4.1 and no library call on baseline x86-64.
const ROUNDER: f32 = 12_582_912.0;

/// Quantizes one block into `qs`, returning its scale (`max|x| / 127`, 0 for a zero block).
fn quantize_block(x: &[f32], qs: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (q, v) in qs.iter_mut().zip(x) {
        // |v · id| ≤ 127 (up to rounding) for finite input; `as` saturates and maps NaN
        // to 0, so non-finite input cannot wrap around.
        *q = ((v * id + ROUNDER) - ROUNDER) as i8;
    }
    d
}

/// Runs `each` over matching chunks of `x` (`n` values each), of `qs` and of `out` (one
/// per chunk), on rayon's pool when `x` is large.
fn for_each_block<A: Send>(
    x: &[f32],
    n: usize,
    qs: &mut [i8],
    out: &mut [A],
    each: impl Fn(&[f32], &mut [i8], &mut A) + Sync,
) {
    use rayon::prelude::*;
    if x.len() < PARALLEL_VALUES {
        for ((xb, qb), a) in x.chunks_exact(n).zip(qs.chunks_exact_mut(n)).zip(out) {
            each(xb, qb, a);
        }
    } else {
        let blocks = x.par_chunks_exact(n).zip(qs.par_chunks_exact_mut(n));
        blocks
            .zip(out.par_iter_mut())
            .with_min_len(256)
            .for_each(|((xb, qb), a)| each(xb, qb, a));
    }
}

fn isum(qs: &[i8]) -> i32 {
    qs.iter().map(|&q| i32::from(q)).sum()
}

/// Activations in blocks of 32 with an f32 scale each, for the legacy formats.
pub(crate) struct Q8Acts {
    cols: usize,
    qs: Vec<i8>,
    ds: Vec<[f32; 2]>,
}

/// One token's row of [`Q8Acts`].
#[derive(Clone, Copy)]
pub(crate) struct Q8Row<'a> {
    /// `cols` quantized values.
    pub qs: &'a [i8],
    /// Per block, its scale `d` and its sum as the integer kernels see it (`d` times the
    /// sum of the quantized values); side by side so that one 8-byte load fetches both.
    pub ds: &'a [[f32; 2]],
}

impl ActSet for Q8Acts {
    type Row<'a> = Q8Row<'a>;

    fn prepare(x: &[f32], n_tokens: usize, cols: usize) -> Self {
        debug_assert_eq!(x.len(), n_tokens * cols);
        debug_assert_eq!(cols % QK8, 0);
        let n_blocks = x.len() / QK8;
        let mut acts = Q8Acts {
            cols,
            qs: vec![0; x.len()],
            ds: vec![[0.0; 2]; n_blocks],
        };
        for_each_block(x, QK8, &mut acts.qs, &mut acts.ds, |xb, qb, ds| {
            let d = quantize_block(xb, qb);
            *ds = [d, d * isum(qb) as f32];
        });
        acts
    }

    fn row(&self, t: usize) -> Q8Row<'_> {
        let nb = self.cols / QK8;
        Q8Row {
            qs: &self.qs[t * self.cols..(t + 1) * self.cols],
            ds: &self.ds[t * nb..(t + 1) * nb],
        }
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn row_bytes(cols: usize) -> usize {
        cols + cols / QK8 * 12
    }
}

/// Activations in super-blocks of 256 with one f32 scale and sums per 16 values, for
/// the k-quants.
pub(crate) struct Q8KActs {
    cols: usize,
    qs: Vec<i8>,
    d: Vec<f32>,
    bsums: Vec<[i16; QK_K / BSUM_GROUP]>,
}

/// One token's row of [`Q8KActs`].
#[derive(Clone, Copy)]
pub(crate) struct Q8KRow<'a> {
    /// `cols` quantized values.
    pub qs: &'a [i8],
    /// One scale per super-block of 256.
    pub d: &'a [f32],
    /// The sum of each group of 16 quantized values (16 per super-block).
    pub bsums: &'a [i16],
}

impl ActSet for Q8KActs {
    type Row<'a> = Q8KRow<'a>;

    fn prepare(x: &[f32], n_tokens: usize, cols: usize) -> Self {
        debug_assert_eq!(x.len(), n_tokens * cols);
        debug_assert_eq!(cols % QK_K, 0);
        let n_blocks = x.len() / QK_K;
        let mut qs = vec![0; x.len()];
        let mut sums = vec![(0.0f32, [0i16; QK_K / BSUM_GROUP]); n_blocks];
        for_each_block(x, QK_K, &mut qs, &mut sums, |xb, qb, (d, bsums)| {
            *d = quantize_block(xb, qb);
            for (sum, group) in bsums.iter_mut().zip(qb.chunks_exact(BSUM_GROUP)) {
                // 16 values of at most 127 in magnitude: the sum fits in an i16.
                *sum = isum(group) as i16;
            }
        });
        Q8KActs {
            cols,
            qs,
            d: sums.iter().map(|s| s.0).collect(),
            bsums: sums.iter().map(|s| s.1).collect(),
        }
    }

    fn row(&self, t: usize) -> Q8KRow<'_> {
        let nb = self.cols / QK_K;
        Q8KRow {
            qs: &self.qs[t * self.cols..(t + 1) * self.cols],
            d: &self.d[t * nb..(t + 1) * nb],
            bsums: self.bsums[t * nb..(t + 1) * nb].as_flattened(),
        }
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn row_bytes(cols: usize) -> usize {
        cols + cols / QK_K * 4 + cols / BSUM_GROUP * 2
    }
}

/// Activations kept as f32, for float weights.
pub(crate) struct F32Acts {
    cols: usize,
    x: Vec<f32>,
}

impl ActSet for F32Acts {
    type Row<'a> = &'a [f32];

    fn prepare(x: &[f32], _n_tokens: usize, cols: usize) -> Self {
        F32Acts {
            cols,
            x: x.to_vec(),
        }
    }

    fn row(&self, t: usize) -> &[f32] {
        &self.x[t * self.cols..(t + 1) * self.cols]
    }

    fn cols(&self) -> usize {
        self.cols
    }

    fn row_bytes(cols: usize) -> usize {
        cols * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_blocks_round_trip_within_half_a_step() {
        let x: Vec<f32> = (0..128)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let acts = Q8Acts::prepare(&x, 2, 64);
        for t in 0..2 {
            let row = acts.row(t);
            for (i, &q) in row.qs.iter().enumerate() {
                let d = row.ds[i / QK8][0];
                let err = (f32::from(q) * d - x[t * 64 + i]).abs();
                assert!(
                    err <= d * 0.5 + 1e-7,
                    "value {i}: error {err} with scale {d}"
                );
            }
            for b in 0..2 {
                let block = &row.qs[b * QK8..(b + 1) * QK8];
                assert_eq!(row.ds[b][1], row.ds[b][0] * isum(block) as f32);
                assert_eq!(block.iter().map(|q| q.unsigned_abs()).max(), Some(127));
            }
        }
    }

    #[test]
    fn q8k_bsums_sum_each_group_of_sixteen() {
        let x: Vec<f32> = (0..512)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) * 0.7)
            .collect();
        let acts = Q8KActs::prepare(&x, 1, 512);
        let row = acts.row(0);
        assert_eq!(row.d.len(), 2);
        assert_eq!(row.bsums.len(), 32);
        for (g, &s) in row.bsums.iter().enumerate() {
            let expected = isum(&row.qs[g * 16..(g + 1) * 16]);
            assert_eq!(i32::from(s), expected, "group {g}");
        }
    }

    #[test]
    fn zero_block_gets_zero_scale_and_values() {
        let acts = Q8Acts::prepare(&[0.0; 32], 1, 32);
        let row = acts.row(0);
        assert_eq!(row.ds[0], [0.0, 0.0]);
        assert!(row.qs.iter().all(|&q| q == 0));
    }

    #[test]
    fn ties_round_to_even() {
        // With max 127 the scale is exactly 1, so 2.5 and -3.5 are ties.
        let mut x = [0.0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        let acts = Q8Acts::prepare(&x, 1, 32);
        assert_eq!(&acts.row(0).qs[..3], &[127, 2, -4]);
    }
}
