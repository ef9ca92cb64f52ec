//! Splits a product into chunks of rows for rayon and tiles each chunk for the cache.

use std::ops::Range;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering::Relaxed;

use gguf_format::GgmlType;
use rayon::prelude::*;

use super::activation::ActSet;
#[cfg(target_arch = "x86_64")]
use super::avx2::RowKernels;
use super::formats::{self, Kernel};
use super::QuantizedMatrix;
use crate::{DecodePath, DequantError};

/// Work a task should at least cover (weight bytes, times tokens in a batch), so that
/// splitting never costs more than the work it shares out.
const MIN_CHUNK_BYTES: usize = 32 * 1024;
/// Called from outside the pool, a product hands its work to the pool's threads and
/// waits for them: measured at 10–20 µs on a 2-core VM, about what one core needs for
/// this many weight bytes. Smaller products run on the calling thread.
const SERIAL_BYTES_OUTSIDE_POOL: usize = 256 * 1024;
/// Tasks per pool thread: enough to even out threads that start late or run slow.
const TASKS_PER_THREAD: usize = 4;
/// In a batch, rows are taken in blocks of at most this many weight bytes, which stay
/// in the core's L2 cache while every tile of tokens passes over them.
const L2_BLOCK_BYTES: usize = 256 * 1024;
/// A batch is shared out by tokens when every task gets at least this many.
const TOKENS_PER_TASK: usize = 4;
/// Bytes of activations per token tile: they stay in L1 while a chunk's rows pass.
const TOKEN_TILE_BYTES: usize = 16 * 1024;

/// A path this CPU is known to support.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Exec {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2(super::avx2::Avx2),
    #[cfg(target_arch = "x86_64")]
    Avx512(super::avx512::Avx512),
}

impl Exec {
    /// The executor of `path`, or `None` when the CPU lacks its features.
    pub(crate) fn new(path: DecodePath) -> Option<Exec> {
        match path {
            DecodePath::Scalar => Some(Exec::Portable),
            #[cfg(target_arch = "x86_64")]
            DecodePath::Avx2 => super::avx2::Avx2::detect().map(Exec::Avx2),
            #[cfg(target_arch = "x86_64")]
            DecodePath::Avx512 => super::avx512::Avx512::detect().map(Exec::Avx512),
            #[cfg(not(target_arch = "x86_64"))]
            DecodePath::Avx2 | DecodePath::Avx512 => None,
        }
    }
}

/// How a product is shared out over rayon's pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Split {
    /// Too small to share: it runs on the calling thread.
    Serial,
    /// Tasks of this many rows (a multiple of 4, the single-token kernels' width), each
    /// against every token.
    Rows(usize),
    /// Tasks of this many tokens (a multiple of 4, the batched kernels' width), each
    /// against every row.
    Tokens(usize),
}

/// The split for `rows` rows of `row_bytes` against `n_tokens` tokens whose prepared
/// activations take `act_row_bytes` each.
pub(crate) fn split(rows: usize, row_bytes: usize, n_tokens: usize, act_row_bytes: usize) -> Split {
    let threads = rayon::current_num_threads();
    let weight_bytes = rows.saturating_mul(row_bytes);
    let work = weight_bytes.saturating_mul(n_tokens);
    let serial_limit = match rayon::current_thread_index() {
        Some(_) => 2 * MIN_CHUNK_BYTES,
        None => SERIAL_BYTES_OUTSIDE_POOL,
    };
    if threads <= 1 || work < serial_limit {
        return Split::Serial;
    }
    // Split by tokens, every task reading all the weights, or by rows, every task
    // reading all the activations: whichever reads fewer bytes.
    let act_bytes = n_tokens.saturating_mul(act_row_bytes);
    if n_tokens >= TOKENS_PER_TASK * TASKS_PER_THREAD * threads && weight_bytes <= act_bytes {
        let per_task = n_tokens
            .div_ceil(TASKS_PER_THREAD * threads)
            .next_multiple_of(4);
        return Split::Tokens(per_task);
    }
    let balanced = rows.div_ceil(threads * TASKS_PER_THREAD);
    // At least MIN_CHUNK_BYTES of work a task: a row of a batch is a row's bytes for
    // every token (a prompt's small matrices, a key or value projection of a few hundred
    // rows, would otherwise be cut into fewer tasks than threads).
    let row_work = row_bytes.max(1).saturating_mul(n_tokens.max(1));
    let chunk = balanced.max(MIN_CHUNK_BYTES.div_ceil(row_work));
    Split::Rows(chunk.next_multiple_of(4).min(rows.max(1)))
}

/// The split [`run`] takes for `m` against `n_tokens` tokens.
#[cfg(test)]
pub(crate) fn split_for(m: &QuantizedMatrix<'_>, n_tokens: usize) -> Split {
    use formats::*;
    fn act_bytes<K: Kernel>(cols: usize) -> usize {
        K::Acts::row_bytes(cols)
    }
    let act_row_bytes = match m.ty().block_size() {
        1 => act_bytes::<F32>(m.cols()),
        32 => act_bytes::<Q8_0>(m.cols()),
        _ => act_bytes::<Q4_K>(m.cols()),
    };
    split(m.rows(), m.row_bytes(), n_tokens, act_row_bytes)
}

/// Rows per block whose weights stay in L2 while tiles of tokens pass over them.
pub(crate) fn rows_per_block(row_bytes: usize) -> usize {
    (L2_BLOCK_BYTES / row_bytes.max(1)).max(4) / 4 * 4
}

/// Tokens per tile for activations of `act_row_bytes` per token: a multiple of 4, the
/// width of the batched kernels.
pub(crate) fn token_tile(act_row_bytes: usize) -> usize {
    (TOKEN_TILE_BYTES / act_row_bytes.max(1) / 4 * 4).max(4)
}

/// Where a task's results go: the value of row `r` and token `t` (both counted from
/// the task's first) lands at `data[r * row_stride + t * token_stride]`.
///
/// The values are held as their bits in atomics, so that the tasks of a batch split by
/// rows can each write their rows of the shared token-major output in place (disjoint
/// elements, relaxed stores: plain stores on x86-64), with no buffer of their own to
/// allocate, zero and copy back.
pub(crate) struct Out<'o> {
    data: &'o [AtomicU32],
    row_stride: usize,
    token_stride: usize,
}

impl<'o> Out<'o> {
    /// Results written into `data`.
    pub(crate) fn new(data: &'o mut [f32], row_stride: usize, token_stride: usize) -> Self {
        Out::shared(as_atomic(data), row_stride, token_stride)
    }

    /// Results written into `data`, which other tasks may also write (elsewhere).
    fn shared(data: &'o [AtomicU32], row_stride: usize, token_stride: usize) -> Self {
        Out {
            data,
            row_stride,
            token_stride,
        }
    }

    /// Stores `v` as row `r`'s product with token `t`.
    #[inline(always)]
    pub(crate) fn set(&self, r: usize, t: usize, v: f32) {
        self.data[r * self.row_stride + t * self.token_stride].store(v.to_bits(), Relaxed);
    }
}

/// `y` as the atomics an [`Out`] writes through.
fn as_atomic(y: &mut [f32]) -> &[AtomicU32] {
    const {
        assert!(size_of::<AtomicU32>() == size_of::<f32>());
        assert!(align_of::<AtomicU32>() <= align_of::<f32>());
    };
    // SAFETY: same size, and an alignment `f32`'s satisfies; every bit pattern is a
    // valid `u32`; the exclusive borrow of `y` is held for the view's whole lifetime, so
    // nothing else reads or writes the values meanwhile.
    unsafe { std::slice::from_raw_parts(y.as_mut_ptr().cast::<AtomicU32>(), y.len()) }
}

/// `$call::<K>$args` for `K` the kernel of `$m`'s type, in the repacked layout where
/// [`repacked`] says so; returns `NoProductKernel` for a type without one.
macro_rules! with_kernel {
    ($m:expr, $call:ident $args:tt) => {
        with_kernel!(
            $m, $call $args,
            repacked: [Q4_0 => Q4_0Packed, Q4_K => Q4_KPacked, IQ4_NL => IQ4_NLPacked,
                       MXFP4 => MXFP4Packed],
            plain: [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K,
                    Q6_K, IQ4_XS, IQ3_S, IQ3_XXS, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M,
                    TQ1_0, TQ2_0, IQ4_NL, MXFP4]
        )
    };
    ($m:expr, $call:ident $args:tt,
     repacked: [$($packed_ty:ident => $packed:ident),*], plain: [$($ty:ident),*]) => {{
        use formats::*;
        let m: &QuantizedMatrix<'_> = $m;
        let packed = repacked(m);
        match m.ty() {
            $(GgmlType::$packed_ty if packed => $call::<$packed> $args,)*
            $(GgmlType::$ty => $call::<$ty> $args,)*
            ty => return Err(DequantError::NoProductKernel { ty }),
        }
    }};
}

/// Computes `y` (token-major, `n_tokens × rows`) for validated, non-empty shapes.
/// With `routed`, the tokens are the ones a mixture-of-experts router sent to this
/// matrix (see [`QuantizedMatrix::matmul_routed`]).
pub(crate) fn run(
    m: &QuantizedMatrix<'_>,
    exec: Exec,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
    routed: bool,
) -> Result<(), DequantError> {
    with_kernel!(m, run_kernel(m, exec, x, n_tokens, y, routed));
    Ok(())
}

fn run_kernel<K: Kernel>(
    m: &QuantizedMatrix<'_>,
    exec: Exec,
    x: &[f32],
    n_tokens: usize,
    y: &mut [f32],
    routed: bool,
) {
    let mut acts = K::Acts::prepare(x, n_tokens, m.cols());
    acts.for_product(m.rows(), routed);
    let (weights, row_bytes, n_rows) = (m.bytes(), m.row_bytes(), m.rows());
    match split(n_rows, row_bytes, n_tokens, K::Acts::row_bytes(m.cols())) {
        Split::Serial => {
            let out = Out::new(y, 1, n_rows);
            rows::<K>(exec, weights, row_bytes, &acts, 0..n_tokens, out);
        }
        Split::Tokens(per_task) => {
            y.par_chunks_mut(per_task * n_rows)
                .enumerate()
                .for_each(|(c, data)| {
                    let first = c * per_task;
                    let tokens = first..first + data.len() / n_rows;
                    let out = Out::new(data, 1, n_rows);
                    rows::<K>(exec, weights, row_bytes, &acts, tokens, out);
                })
        }
        Split::Rows(per_task) if n_tokens == 1 => {
            y.par_chunks_mut(per_task)
                .enumerate()
                .for_each(|(c, data)| {
                    let w =
                        &weights[c * per_task * row_bytes..(c * per_task + data.len()) * row_bytes];
                    rows::<K>(exec, w, row_bytes, &acts, 0..1, Out::new(data, 1, 0));
                })
        }
        Split::Rows(per_task) => {
            // Each task writes its rows of every token's row of `y` in place.
            let y = as_atomic(y);
            weights
                .par_chunks(per_task * row_bytes)
                .enumerate()
                .for_each(|(c, w)| {
                    let out = Out::shared(&y[c * per_task..], 1, n_rows);
                    rows::<K>(exec, w, row_bytes, &acts, 0..n_tokens, out);
                });
        }
    }
}

/// Whether llama.cpp would repack `m` on an AVX2 machine (a `Q4_0`, `Q4_K`, `IQ4_NL` or
/// `MXFP4` matrix whose row count is a multiple of 8) and multiply it with its repacked
/// kernels.
pub(crate) fn repacked(m: &QuantizedMatrix<'_>) -> bool {
    use GgmlType::*;
    matches!(m.ty(), Q4_0 | Q4_K | IQ4_NL | MXFP4) && m.rows().is_multiple_of(8)
}

/// One token against several matrices of one type and width (validated, non-empty),
/// `ys[i]` receiving matrix `i`'s rows: the activations are prepared once and every
/// matrix's row chunks share one parallel loop. Each row gets the bits it gets from
/// [`run`] alone.
pub(crate) fn run_many(
    ms: &[QuantizedMatrix<'_>],
    exec: Exec,
    x: &[f32],
    ys: &mut [&mut [f32]],
) -> Result<(), DequantError> {
    if ms.iter().any(|m| repacked(m) != repacked(&ms[0])) {
        // Different arithmetic per matrix: one product each.
        for (m, y) in ms.iter().zip(ys.iter_mut()) {
            run(m, exec, x, 1, y, false)?;
        }
        return Ok(());
    }
    with_kernel!(&ms[0], run_many_kernel(ms, exec, x, ys));
    Ok(())
}

fn run_many_kernel<K: Kernel>(
    ms: &[QuantizedMatrix<'_>],
    exec: Exec,
    x: &[f32],
    ys: &mut [&mut [f32]],
) {
    let acts = K::Acts::prepare(x, 1, ms[0].cols());
    let act_row_bytes = K::Acts::row_bytes(ms[0].cols());
    let total_bytes: usize = ms.iter().map(|m| m.rows() * m.row_bytes()).sum();
    // Chunks as `split` would cut all the rows if they were one matrix.
    let (per_task_bytes, parallel) = match split(total_bytes, 1, 1, act_row_bytes) {
        Split::Rows(bytes) => (bytes, true),
        _ => (total_bytes, false),
    };
    let mut tasks: Vec<(&[u8], usize, &mut [f32])> = Vec::new();
    for (m, y) in ms.iter().zip(ys.iter_mut()) {
        let row_bytes = m.row_bytes();
        let per_task = per_task_bytes
            .div_ceil(row_bytes)
            .next_multiple_of(4)
            .max(1);
        for (c, data) in y.chunks_mut(per_task).enumerate() {
            let first = c * per_task;
            let w = &m.bytes()[first * row_bytes..(first + data.len()) * row_bytes];
            tasks.push((w, row_bytes, data));
        }
    }
    let work = |(w, row_bytes, data): (&[u8], usize, &mut [f32])| {
        rows::<K>(exec, w, row_bytes, &acts, 0..1, Out::new(data, 1, 0));
    };
    if !parallel || tasks.len() == 1 {
        tasks.into_iter().for_each(work);
    } else {
        tasks.into_par_iter().for_each(work);
    }
}

/// Every row of `w` against `tokens` of `acts`, on the chosen path.
fn rows<K: Kernel>(
    exec: Exec,
    w: &[u8],
    row_bytes: usize,
    acts: &K::Acts,
    tokens: Range<usize>,
    out: Out<'_>,
) {
    match exec {
        Exec::Portable => rows_portable::<K>(w, row_bytes, acts, tokens, out),
        #[cfg(target_arch = "x86_64")]
        Exec::Avx2(features) => features.rows::<K>(w, row_bytes, acts, tokens, out),
        #[cfg(target_arch = "x86_64")]
        Exec::Avx512(features) => features.rows::<K>(w, row_bytes, acts, tokens, out),
    }
}

/// The portable loops: blocks of rows that stay in L2, tiles of tokens that stay in L1.
fn rows_portable<K: Kernel>(
    w: &[u8],
    row_bytes: usize,
    acts: &K::Acts,
    tokens: Range<usize>,
    out: Out<'_>,
) {
    let n_rows = w.len() / row_bytes.max(1);
    let (block, tile) = (
        rows_per_block(row_bytes),
        token_tile(K::Acts::row_bytes(acts.cols())),
    );
    for r0 in (0..n_rows).step_by(block) {
        for t0 in tokens.clone().step_by(tile) {
            let t1 = (t0 + tile).min(tokens.end);
            for r in r0..(r0 + block).min(n_rows) {
                let row = &w[r * row_bytes..(r + 1) * row_bytes];
                for t in t0..t1 {
                    out.set(r, t - tokens.start, K::dot(row, acts.row(t)));
                }
            }
        }
    }
}
