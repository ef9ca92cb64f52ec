//! The products of a layer's matrices: decode products for a few tokens, batch products
//! (on the matrix units) for more, one launch per run of matrices of one type and width;
//! and the residual products that add into the residual stream.

use dequant::gpu::matmul;
use dequant::gpu::matmul_q8k;
use dequant::gpu::matvec::{self, takes_q8, GpuActivations, GpuMatrix};
use half::f16;
use hip_backend::{ArenaBuffer, DeviceView, DeviceViewMut, Stream};

use super::{view, view_mut};
use crate::gpu::kernels;
use crate::gpu::weights::Matrix;
use crate::gpu::{gpu, MAX_BATCH};
use crate::ModelError;

fn gpu_matrix<'a>(m: &'a Matrix) -> Result<GpuMatrix<'a>, ModelError> {
    GpuMatrix::new(m.ty, m.rows, m.cols, m.bytes()?).map_err(|source| ModelError::Matmul {
        name: m.name().to_owned(),
        source,
    })
}

pub(super) fn matvec_error<'a>(
    mats: &'a [&'a Matrix],
) -> impl Fn(dequant::gpu::GpuDequantError) -> ModelError + 'a {
    product_error("matrix product", move || {
        mats.iter()
            .map(|m| m.name())
            .collect::<Vec<_>>()
            .join(" + ")
    })
}

/// A product's failure as the model's error: a layout refused names the matrices
/// (`name()`), a runtime failure says it came during `op`.
pub(in crate::gpu) fn product_error<'a>(
    op: &'static str,
    name: impl Fn() -> String + 'a,
) -> impl Fn(dequant::gpu::GpuDequantError) -> ModelError + 'a {
    move |error| match error {
        dequant::gpu::GpuDequantError::Layout(source) => ModelError::Matmul {
            name: name(),
            source,
        },
        dequant::gpu::GpuDequantError::Hip(source) => ModelError::Gpu { op, source },
    }
}

/// Whether `n` tokens are a prompt's chunk (tiled attention, batch products for every
/// matrix) rather than a few tokens (split attention, decode products where
/// [`BatchInput::takes`] says so).
pub(super) fn batched(n: usize) -> bool {
    n > MAX_BATCH
}

/// The fewest tokens whose products take the skinny batch products rather than the
/// decode products, for the types the skinny products take: at 2 tokens the decode
/// products are as fast or faster on every type measured, from 3 on the skinny ones are
/// faster (ARCHITECTURE.md, `dequant`).
pub(super) const SKINNY_FROM: usize = 3;

/// The smallest matrix whose products of a few tokens take the skinny batch products:
/// their shortest launch takes 5.7-9 µs, where the decode products multiply a matrix of
/// about a megabyte (a SmolLM2-135M's) by 8 tokens in 2.7-4.5 µs (H200). A 135M's
/// output matrix (18 MB in Q4_1) is already faster in the skinny products from 3 tokens,
/// a 7B's (9 MB and more) from 3 as well.
pub(super) const SKINNY_MIN_BYTES: usize = 4 << 20;

/// The most rows of a float matrix (a router, a shared expert's gate) whose products
/// take the decode products at any count of tokens, [`dequant::gpu::matvec::MAX_TOKENS`]
/// at a time in one launch: the batch products cut so few rows into so few tiles that
/// most of the device idles (a 128-expert F32 router at 32 tokens ran in 16 workgroups).
pub(super) const FLOAT_FEW_ROWS: usize = 512;

/// Whether `m` is a float matrix of at most [`FLOAT_FEW_ROWS`] rows.
pub(super) fn float_rows_few(m: &Matrix) -> bool {
    !takes_q8(m.ty) && m.rows <= FLOAT_FEW_ROWS
}

/// The fewest rows of a run of `Q4_K` matrices (one launch) whose products on up to
/// [`matmul::SKINNY_MAX_TOKENS`] tokens, a batch of decoding sequences, take the int8
/// tiles rather than the skinny products. A workgroup of the int8 tiles takes 128 rows ×
/// 64 tokens, so a 4,096-row matrix is 32 of them: on the H200, a 7B's attention output
/// (4,096 × 4,096) at 9-64 tokens took 12.7-25.8 µs in the skinny products against
/// 25.8-29.8 µs in the int8 tiles split by columns, its `Q4_K` down (4,096 × 11,008)
/// 24-52 µs against 40-50; its q, k and v in one launch (12,288 rows) 30.7-61.3 µs against
/// 30.2-41.2 unsplit, its gate and up (22,016 rows) 45.8-116 against 45-69.
pub(super) const INT8_FEW_TOKENS_ROWS: usize = 8192;

/// The batch products' input: per-token scales (the first `scales_bytes`), then the
/// tokens' activations divided by them, in f16; and the room their products split
/// their columns in (partial sums, and tile counters that hold zeros between products).
pub(super) struct BatchInput {
    pub(super) buf: ArenaBuffer,
    pub(super) scales_bytes: usize,
    pub(super) partials: ArenaBuffer,
    pub(super) counters: ArenaBuffer,
    /// The input of the int8 products (`matmul_q8k`), where they run.
    pub(super) q8k: ArenaBuffer,
    /// Whether a prompt's `Q4_K` products take the int8 matrix units
    /// (`GpuTuning::int8_prompts`, where the device runs them).
    pub(super) int8: bool,
    /// Whether the device runs the skinny batch products
    /// ([`matmul::skinny_available`]).
    pub(super) skinny: bool,
}

impl BatchInput {
    /// Whether the products of `m` on `n` tokens take the batch products ([`matmul`],
    /// f32 input) rather than the decode products (Q8 blocks for quantized weights): past
    /// [`MAX_BATCH`] tokens but for float matrices of few rows ([`float_rows_few`]); from [`SKINNY_FROM`] tokens where the device runs the
    /// skinny products, they take the type (`matmul::skinny_prefers`) and the matrix holds
    /// at least [`SKINNY_MIN_BYTES`], where they are faster (ARCHITECTURE.md says by how
    /// much).
    pub(super) fn takes(&self, m: &Matrix, n: usize) -> bool {
        (batched(n) && !float_rows_few(m))
            || (self.skinny
                && n >= SKINNY_FROM
                && matmul::skinny_prefers(m.ty)
                && m.byte_len() >= SKINNY_MIN_BYTES)
    }

    /// Whether the batch products of `m` on `n` tokens take the int8 matrix units: more
    /// than [`MAX_BATCH`] tokens (a prompt's chunk or a batch of decoding sequences),
    /// `Q4_K` of whole super-blocks, where they run.
    pub(super) fn int8_takes(&self, m: &Matrix, n: usize) -> bool {
        self.int8
            && batched(n)
            && m.ty == gguf_format::GgmlType::Q4_K
            && m.cols.is_multiple_of(matmul_q8k::Q8K_BLOCK)
    }

    /// How the products of `m` on `n` tokens run.
    fn kind(&self, m: &Matrix, n: usize) -> Kind {
        if self.int8_takes(m, n) {
            Kind::Int8
        } else if self.takes(m, n) {
            Kind::Tiles
        } else {
            Kind::Decode
        }
    }

    /// Gives the skinny products the int8 runs of `kinds` (over `mats` on `n` tokens) of
    /// fewer than [`INT8_FEW_TOKENS_ROWS`] rows in all, where the skinny products take
    /// `n` tokens of their type: a batch of a few dozen decoding sequences leaves their
    /// tiles too few workgroups to fill the device.
    fn few_rows_skinny(&self, mats: &[&Matrix], kinds: &mut [Kind], n: usize) {
        if !self.skinny || n > matmul::SKINNY_MAX_TOKENS {
            return;
        }
        let mut start = 0;
        while start < mats.len() {
            let end = run_end(mats, kinds, start);
            let rows: usize = mats[start..end].iter().map(|m| m.rows).sum();
            if kinds[start] == Kind::Int8
                && matmul::skinny_prefers(mats[start].ty)
                && rows < INT8_FEW_TOKENS_ROWS
            {
                kinds[start..end].fill(Kind::Tiles);
            }
            start = end;
        }
    }

    /// The inputs of a layer's runs from `n` tokens of `input` (f32): for the f16 tiles
    /// of `tiles` (where there are any) the f16 activations and their per-token scales
    /// ([`matmul::row_scales`]); for the int8 tiles of `int8` the `Q8_K` blocks
    /// ([`matmul_q8k::quantize_q8k`]); and the room both split their products in.
    fn prepare(
        &mut self,
        input: DeviceView<'_, f32>,
        n: usize,
        tiles: &[&Matrix],
        int8: &[&Matrix],
        stream: &Stream,
    ) -> Result<Prepared<'_>, ModelError> {
        let BatchInput {
            buf,
            scales_bytes,
            partials,
            counters,
            q8k,
            ..
        } = self;
        let xq = match int8.first() {
            Some(first) => {
                let bytes = matmul_q8k::q8k_bytes(n, first.cols).unwrap_or(usize::MAX);
                let out = view_mut::<u8>(q8k, bytes)?;
                matmul_q8k::quantize_q8k(input, n, first.cols, out, stream)
                    .map_err(matvec_error(int8))?;
                Some(view::<u8>(q8k, bytes)?)
            }
            None => None,
        };
        let room = matmul::SplitScratch {
            partials: view_mut::<f32>(partials, matmul::SPLIT_PARTIALS)?,
            counters: view_mut::<u32>(counters, matmul::SPLIT_COUNTERS)?,
        };
        let Some(first) = tiles.first() else {
            return Ok(Prepared {
                f16: None,
                xq,
                room,
            });
        };
        let (split, cols) = (*scales_bytes, first.cols);
        let cut = gpu("viewing the batch input");
        let whole = buf.view_mut::<u8>().map_err(&cut)?;
        let (s, x16) = whole.split_at_mut(split).map_err(&cut)?;
        let s = s
            .cast_mut::<f32>()
            .and_then(|v| v.slice_mut(0..n))
            .map_err(&cut)?;
        let x16 = x16
            .cast_mut::<f16>()
            .and_then(|v| v.slice_mut(0..n * cols))
            .map_err(&cut)?;
        matmul::row_scales(input, n, cols, s, x16, stream).map_err(matvec_error(tiles))?;
        let whole = buf.view::<u8>().map_err(&cut)?;
        let s = whole
            .slice(0..split)
            .and_then(|v| v.cast::<f32>())
            .and_then(|v| v.slice(0..n))
            .map_err(&cut)?;
        let x16 = whole
            .slice(split..split + 2 * n * cols)
            .and_then(|v| v.cast::<f16>())
            .map_err(&cut)?;
        Ok(Prepared {
            f16: Some((x16, s)),
            xq,
            room,
        })
    }
}

/// The batch products' inputs for one call of [`products`]: the f16 tiles' activations
/// and per-token scales, the int8 tiles' `Q8_K` blocks (each where some run takes them),
/// and the room both split their columns in.
struct Prepared<'a> {
    f16: Option<(DeviceView<'a, f16>, DeviceView<'a, f32>)>,
    xq: Option<DeviceView<'a, u8>>,
    room: matmul::SplitScratch<'a>,
}

/// How a run of matrices multiplies: the decode products, the f16 tiles ([`matmul`]) or
/// the int8 tiles ([`matmul_q8k`]).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Decode,
    Tiles,
    Int8,
}

/// Whether the products of `m` on `n` tokens take Q8 blocks.
pub(super) fn takes_q8_for(m: &Matrix, n: usize, batch_in: &BatchInput) -> bool {
    takes_q8(m.ty) && !batch_in.takes(m, n)
}

/// What the products of some matrices on `n` tokens need from a norm: f32 rows, Q8
/// blocks, or both.
pub(super) fn needs(mats: &[&Matrix], n: usize, batch_in: &BatchInput) -> (bool, bool) {
    let q8 = mats.iter().any(|m| takes_q8_for(m, n, batch_in));
    let f32 = mats.iter().any(|m| !takes_q8_for(m, n, batch_in));
    (f32, q8)
}

/// The end of the run of matrices from `start` that share its type, its width and its
/// kind of product (at most three, what one product launch takes).
fn run_end(mats: &[&Matrix], kinds: &[Kind], start: usize) -> usize {
    let mut end = start + 1;
    while end < mats.len()
        && end - start < matvec::MAX_MATRICES
        && mats[end].ty == mats[start].ty
        && mats[end].cols == mats[start].cols
        && kinds[end] == kinds[start]
    {
        end += 1;
    }
    end
}

/// `outs[i] (+)= input · mats[i]ᵀ`, one launch per run of matrices of one type, width
/// and kind: decode products for a few tokens, batch products (f16 or int8 tiles) for
/// more. `f32_in`/`q8_in` hold the input in the two forms (each present when some
/// matrix takes it); the tiles' inputs are made from `f32_in` once for all their runs.
#[allow(clippy::too_many_arguments)]
pub(super) fn products(
    mats: &[&Matrix],
    f32_in: Option<DeviceView<'_, f32>>,
    q8_in: Option<DeviceView<'_, u8>>,
    n: usize,
    mut outs: Vec<DeviceViewMut<'_, f32>>,
    accumulate: bool,
    batch_in: &mut BatchInput,
    stream: &Stream,
) -> Result<(), ModelError> {
    let mut kinds: Vec<Kind> = mats.iter().map(|m| batch_in.kind(m, n)).collect();
    batch_in.few_rows_skinny(mats, &mut kinds, n);
    let of = |kind: Kind| -> Vec<&Matrix> {
        mats.iter()
            .zip(&kinds)
            .filter_map(|(m, &k)| (k == kind).then_some(*m))
            .collect()
    };
    let (tiles, int8) = (of(Kind::Tiles), of(Kind::Int8));
    let mut prepared = if tiles.is_empty() && int8.is_empty() {
        None
    } else {
        let input = f32_in.expect("f32 input prepared for the batch products");
        Some(batch_in.prepare(input, n, &tiles, &int8, stream)?)
    };
    let mut start = 0;
    while start < mats.len() {
        let end = run_end(mats, &kinds, start);
        let group = &mats[start..end];
        let gms = group
            .iter()
            .map(|m| gpu_matrix(m))
            .collect::<Result<Vec<_>, _>>()?;
        let mut group_outs: Vec<DeviceViewMut<'_, f32>> = outs.drain(..end - start).collect();
        match kinds[start] {
            Kind::Int8 => {
                let p = prepared.as_mut().expect("batch input prepared");
                matmul_q8k::matmul_q8k(
                    &gms,
                    p.xq.expect("Q8_K input prepared for the int8 tiles"),
                    n,
                    &mut group_outs,
                    accumulate,
                    Some(p.room.reborrow()),
                    stream,
                )
            }
            Kind::Tiles => {
                let p = prepared.as_mut().expect("batch input prepared");
                let (x16, s) = p.f16.expect("f16 input prepared for the tiles");
                matmul::matmul(
                    &gms,
                    x16,
                    s,
                    n,
                    &mut group_outs,
                    accumulate,
                    Some(p.room.reborrow()),
                    stream,
                )
            }
            Kind::Decode => {
                let x = if takes_q8(group[0].ty) {
                    GpuActivations::Q8(q8_in.expect("Q8 input prepared for quantized weights"))
                } else {
                    GpuActivations::F32(f32_in.expect("f32 input prepared for float weights"))
                };
                matvec::matvec(&gms, x, n, &mut group_outs, accumulate, stream)
            }
        }
        .map_err(matvec_error(group))?;
        start = end;
    }
    Ok(())
}

/// Where a residual product writes: the residual stream `x`, `proj` for a post-norm's
/// input, and the batch products' input; split by tensors, the devices' communicator.
pub(super) struct Residual<'a> {
    pub(super) x: &'a mut ArenaBuffer,
    pub(super) proj: &'a mut ArenaBuffer,
    pub(super) batch_in: &'a mut BatchInput,
    pub(super) team: Option<&'a hip_backend::Communicator>,
}

/// `x += input · mᵀ + bias`, or with a post-norm `x += rms_norm(input · mᵀ + bias)`
/// (through `proj`).
///
/// Split by tensors, `m` is this device's columns and `input` its part of the input:
/// the devices' products are partial sums, added up by an all-reduce before the
/// post-norm (or, without one, of the residual stream itself: the leading device adds
/// its product and the bias to the stream, the others write theirs over it). Every
/// device then holds the same stream.
#[allow(clippy::too_many_arguments)]
pub(super) fn residual(
    m: &Matrix,
    bias: Option<DeviceView<'_, f32>>,
    f32_in: Option<DeviceView<'_, f32>>,
    q8_in: Option<DeviceView<'_, u8>>,
    post_norm: Option<kernels::NormWeight<'_>>,
    into: Residual<'_>,
    n: usize,
    eps: f32,
    stream: &Stream,
) -> Result<(), ModelError> {
    let d = m.rows;
    let Residual {
        x,
        proj,
        batch_in,
        team,
    } = into;
    let leads = team.is_none_or(|t| t.rank() == 0);
    let out = if post_norm.is_some() {
        &mut *proj
    } else {
        &mut *x
    };
    products(
        &[m],
        f32_in,
        q8_in,
        n,
        vec![view_mut::<f32>(out, n * d)?],
        post_norm.is_none() && leads,
        batch_in,
        stream,
    )?;
    if let Some(bias) = bias {
        kernels::add_bias(view_mut::<f32>(out, n * d)?, d, bias, stream)?;
    }
    if let Some(team) = team {
        team.all_reduce_sum(view_mut::<f32>(out, n * d)?, stream)
            .map_err(gpu("adding up the devices' partial products"))?;
    }
    if let Some(norm) = post_norm {
        kernels::rms_norm(
            view(proj, n * d)?,
            norm,
            n,
            d,
            eps,
            Some(view_mut::<f32>(x, n * d)?),
            true,
            None,
            stream,
        )?;
    }
    Ok(())
}
