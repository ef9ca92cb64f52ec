//! Splits a product into chunks of rows for rayon and tiles each chunk for the cache.

use gguf_format::GgmlType;
use rayon::prelude::*;

use super::activation::ActSet;
use super::formats::{self, Kernel};
use super::{Backend, MatmulError, QuantizedMatrix};

/// Weight bytes a task should at least cover, so that splitting never costs more than
/// the work it shares out.
const MIN_CHUNK_BYTES: usize = 32 * 1024;
/// Tasks per pool thread: enough to even out threads that start late or run slow.
const TASKS_PER_THREAD: usize = 4;
/// In a batch, weight bytes per task stay within this so the chunk is still in the
/// core's L2 cache when the next tile of tokens passes over it.
const MAX_BATCH_CHUNK_BYTES: usize = 256 * 1024;
/// Bytes of activations per token tile: they stay in L1 while a chunk's rows pass.
const TOKEN_TILE_BYTES: usize = 16 * 1024;

/// A backend this CPU is known to support.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Exec {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2(super::avx2::Avx2),
}

impl Exec {
    /// The backend's executor, or `None` when the CPU lacks its features.
    pub(crate) fn new(backend: Backend) -> Option<Exec> {
        match backend {
            Backend::Portable => Some(Exec::Portable),
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2 => super::avx2::Avx2::detect().map(Exec::Avx2),
            #[cfg(not(target_arch = "x86_64"))]
            Backend::Avx2 => None,
        }
    }
}

/// Rows per task for a matrix with `row_bytes` per row and a batch of `n_tokens`.
pub(crate) fn chunk_rows(rows: usize, row_bytes: usize, n_tokens: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let balanced = rows.div_ceil(threads * TASKS_PER_THREAD);
    let mut chunk = balanced.max(MIN_CHUNK_BYTES.div_ceil(row_bytes.max(1)));
    if n_tokens > 1 {
        chunk = chunk.min((MAX_BATCH_CHUNK_BYTES / row_bytes.max(1)).max(1));
    }
    chunk.clamp(1, rows.max(1))
}

/// Tokens per tile for activations of `act_row_bytes` per token: a multiple of 4, the
/// width of the batched kernels.
pub(crate) fn token_tile(act_row_bytes: usize) -> usize {
    (TOKEN_TILE_BYTES / act_row_bytes.max(1) / 4 * 4).max(4)
}

/// Computes `y` (token-major, `n_tokens × rows`) for validated, non-empty shapes.
pub(crate) fn run(
    m: &QuantizedMatrix<'_>,
    exec: Exec,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
) -> Result<(), MatmulError> {
    use formats::*;
    match m.ty() {
        GgmlType::F32 => run_kernel::<F32>(m, exec, x, n_tokens, y),
        GgmlType::F16 => run_kernel::<F16>(m, exec, x, n_tokens, y),
        GgmlType::BF16 => run_kernel::<BF16>(m, exec, x, n_tokens, y),
        GgmlType::Q4_0 => run_kernel::<Q4_0>(m, exec, x, n_tokens, y),
        GgmlType::Q4_1 => run_kernel::<Q4_1>(m, exec, x, n_tokens, y),
        GgmlType::Q5_0 => run_kernel::<Q5_0>(m, exec, x, n_tokens, y),
        GgmlType::Q5_1 => run_kernel::<Q5_1>(m, exec, x, n_tokens, y),
        GgmlType::Q8_0 => run_kernel::<Q8_0>(m, exec, x, n_tokens, y),
        GgmlType::Q4_K => run_kernel::<Q4_K>(m, exec, x, n_tokens, y),
        GgmlType::Q5_K => run_kernel::<Q5_K>(m, exec, x, n_tokens, y),
        GgmlType::Q6_K => run_kernel::<Q6_K>(m, exec, x, n_tokens, y),
        ty => return Err(MatmulError::UnsupportedType { ty }),
    }
    Ok(())
}

fn run_kernel<K: Kernel>(
    m: &QuantizedMatrix<'_>,
    exec: Exec,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
) {
    let acts = K::Acts::prepare(x, n_tokens, m.cols());
    let row_bytes = m.row_bytes();
    let chunk = chunk_rows(m.rows(), row_bytes, n_tokens);
    let weights = m.bytes();
    let task = |(c, out): (usize, &mut [f32])| {
        let first = c * chunk;
        let n_rows = out.len() / n_tokens;
        let w = &weights[first * row_bytes..(first + n_rows) * row_bytes];
        rows::<K>(exec, w, row_bytes, &acts, n_tokens, out);
    };
    if n_tokens == 1 {
        y.par_chunks_mut(chunk).enumerate().for_each(task);
        return;
    }
    // Tasks own whole rows, so they write a row-major (rows × n_tokens) scratch that is
    // transposed into the token-major output afterwards.
    let mut by_row = vec![0.0f32; y.len()];
    by_row
        .par_chunks_mut(chunk * n_tokens)
        .enumerate()
        .for_each(task);
    let rows = m.rows();
    y.par_chunks_mut(rows).enumerate().for_each(|(t, y_token)| {
        for (r, v) in y_token.iter_mut().enumerate() {
            *v = by_row[r * n_tokens + t];
        }
    });
}

/// `out[r * n_tokens + t]` = row `r` of `w` · token `t`, on the chosen backend.
fn rows<K: Kernel>(
    exec: Exec,
    w: &[u8],
    row_bytes: usize,
    acts: &K::Acts,
    n_tokens: usize,
    out: &mut [f32],
) {
    match exec {
        Exec::Portable => rows_portable::<K>(w, row_bytes, acts, n_tokens, out),
        #[cfg(target_arch = "x86_64")]
        Exec::Avx2(features) => features.rows::<K>(w, row_bytes, acts, n_tokens, out),
    }
}

fn rows_portable<K: Kernel>(
    w: &[u8],
    row_bytes: usize,
    acts: &K::Acts,
    n_tokens: usize,
    out: &mut [f32],
) {
    let tile = token_tile(acts.row_bytes());
    for t0 in (0..n_tokens).step_by(tile) {
        let t1 = (t0 + tile).min(n_tokens);
        for (row, out_row) in w
            .chunks_exact(row_bytes)
            .zip(out.chunks_exact_mut(n_tokens))
        {
            for (t, v) in out_row.iter_mut().enumerate().take(t1).skip(t0) {
                *v = K::dot(row, acts.row(t));
            }
        }
    }
}
