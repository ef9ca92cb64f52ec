//! From a type and its bytes to values: picks the block layout and the kernel, checks
//! lengths, and splits large inputs across rayon's pool.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[rustfmt::skip]
pub mod grids;
pub(crate) mod scalar;
#[cfg(test)]
mod tests;

use bytemuck::Pod;
use gguf_format::GgmlType;
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use crate::blocks::*;
use crate::DequantError;
#[cfg(target_arch = "x86_64")]
use avx2::Avx2;

/// Values decoded by one rayon task: 64 Ki values, 256 KiB of f32 output, so a task
/// amortizes its scheduling and its output stays in L2.
const TASK_VALUES: usize = 1 << 16;

/// Stand-in for the AVX2 proof where the architecture has no AVX2: it cannot exist.
#[cfg(not(target_arch = "x86_64"))]
#[derive(Clone, Copy, Debug)]
pub(crate) enum Avx2 {}

/// Which kernels run and whether large inputs are split across threads.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Plan {
    pub(crate) avx2: Option<Avx2>,
    pub(crate) parallel: bool,
}

/// Where decoded values go: the driver is generic over the output element type.
trait Sink {
    /// Decodes every block of the input with `kernel`, which turns a slice of blocks
    /// into as many arrays of `N` values.
    fn run<B, const N: usize, K>(self, kernel: K) -> Result<(), DequantError>
    where
        B: Pod + Sync,
        K: Fn(&[B], &mut [[f32; N]]) + Sync;
}

/// The input as blocks, or the error naming the partial block.
fn input<B: Pod>(ty: GgmlType, bytes: &[u8]) -> Result<&[B], DequantError> {
    bytemuck::try_cast_slice(bytes).map_err(|_| DequantError::PartialBlock {
        ty,
        bytes: bytes.len(),
        block_bytes: std::mem::size_of::<B>(),
    })
}

/// Checks that `out_len` values is what `blocks` blocks of `N` decode to.
fn check_output<const N: usize>(
    ty: GgmlType,
    blocks: usize,
    out_len: usize,
) -> Result<(), DequantError> {
    let expected = blocks.saturating_mul(N);
    if out_len != expected {
        return Err(DequantError::OutputLength {
            ty,
            blocks,
            expected,
            actual: out_len,
        });
    }
    Ok(())
}

/// Blocks per rayon task for blocks of `n` values.
fn task_blocks(n: usize) -> usize {
    (TASK_VALUES / n).max(1)
}

struct F32Sink<'a> {
    ty: GgmlType,
    bytes: &'a [u8],
    out: &'a mut [f32],
    parallel: bool,
}

impl Sink for F32Sink<'_> {
    fn run<B, const N: usize, K>(self, kernel: K) -> Result<(), DequantError>
    where
        B: Pod + Sync,
        K: Fn(&[B], &mut [[f32; N]]) + Sync,
    {
        let blocks = input::<B>(self.ty, self.bytes)?;
        let out_len = self.out.len();
        check_output::<N>(self.ty, blocks.len(), out_len)?;
        // Cannot fail after the check above; mapped to the same error all the same.
        let out: &mut [[f32; N]] =
            bytemuck::try_cast_slice_mut(self.out).map_err(|_| DequantError::OutputLength {
                ty: self.ty,
                blocks: blocks.len(),
                expected: blocks.len().saturating_mul(N),
                actual: out_len,
            })?;
        let per_task = task_blocks(N);
        if self.parallel && blocks.len() >= 2 * per_task {
            blocks
                .par_chunks(per_task)
                .zip(out.par_chunks_mut(per_task))
                .for_each(|(blocks, out)| kernel(blocks, out));
        } else {
            kernel(blocks, out);
        }
        Ok(())
    }
}

struct F16Sink<'a> {
    ty: GgmlType,
    bytes: &'a [u8],
    out: &'a mut [f16],
    parallel: bool,
}

impl Sink for F16Sink<'_> {
    fn run<B, const N: usize, K>(self, kernel: K) -> Result<(), DequantError>
    where
        B: Pod + Sync,
        K: Fn(&[B], &mut [[f32; N]]) + Sync,
    {
        let blocks = input::<B>(self.ty, self.bytes)?;
        check_output::<N>(self.ty, blocks.len(), self.out.len())?;
        let per_task = task_blocks(N);
        // Each task decodes to f32 in a scratch buffer of its own, then rounds to f16
        // (to nearest, ties to even).
        let task = |(blocks, out): (&[B], &mut [f16])| {
            let mut scratch = vec![[0f32; N]; blocks.len()];
            kernel(blocks, &mut scratch);
            out.convert_from_f32_slice(scratch.as_flattened());
        };
        let values = per_task * N;
        if self.parallel && blocks.len() >= 2 * per_task {
            blocks
                .par_chunks(per_task)
                .zip(self.out.par_chunks_mut(values))
                .for_each(task);
        } else {
            blocks
                .chunks(per_task)
                .zip(self.out.chunks_mut(values))
                .for_each(task);
        }
        Ok(())
    }
}

/// Decodes `bytes` of type `ty` into `out` as f32.
pub(crate) fn to_f32(
    plan: Plan,
    ty: GgmlType,
    bytes: &[u8],
    out: &mut [f32],
) -> Result<(), DequantError> {
    let sink = F32Sink {
        ty,
        bytes,
        out,
        parallel: plan.parallel,
    };
    dispatch(ty, plan.avx2, sink)
}

/// Decodes `bytes` of type `ty` into `out` as f16 (F16 input is copied as is).
pub(crate) fn to_f16(
    plan: Plan,
    ty: GgmlType,
    bytes: &[u8],
    out: &mut [f16],
) -> Result<(), DequantError> {
    if ty == GgmlType::F16 {
        let input = input::<F16Le>(ty, bytes)?;
        check_output::<1>(ty, input.len(), out.len())?;
        for (y, x) in out.iter_mut().zip(input) {
            *y = x.to_f16();
        }
        return Ok(());
    }
    let sink = F16Sink {
        ty,
        bytes,
        out,
        parallel: plan.parallel,
    };
    dispatch(ty, plan.avx2, sink)
}

/// The one place that maps a type to its block layout and kernels.
fn dispatch<S: Sink>(ty: GgmlType, avx2: Option<Avx2>, sink: S) -> Result<(), DequantError> {
    use scalar::each;
    use GgmlType as T;

    // With an AVX2 proof, the AVX2 kernel `$fast`; otherwise the reference decoder.
    macro_rules! fast {
        ($scalar:path, $fast:ident) => {{
            #[cfg(target_arch = "x86_64")]
            if let Some(x) = avx2 {
                return sink.run(move |b, o| x.$fast(b, o));
            }
            sink.run(each($scalar))
        }};
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = avx2;

    match ty {
        // A plain little-endian load: the reference loop compiles to a copy.
        T::F32 => sink.run(each(scalar::f32_)),
        T::F16 => fast!(scalar::f16_, f16_),
        T::BF16 => fast!(scalar::bf16_, bf16_),
        T::F64 => sink.run(each(scalar::f64_)),
        T::I8 => sink.run(each(scalar::i8_)),
        T::I16 => sink.run(each(scalar::i16_)),
        T::I32 => sink.run(each(scalar::i32_)),
        T::I64 => sink.run(each(scalar::i64_)),
        T::Q4_0 => fast!(scalar::q4_0, q4_0),
        T::Q4_1 => fast!(scalar::q4_1, q4_1),
        T::Q5_0 => fast!(scalar::q5_0, q5_0),
        T::Q5_1 => fast!(scalar::q5_1, q5_1),
        T::Q8_0 => fast!(scalar::q8_0, q8_0),
        T::Q8_1 => sink.run(each(scalar::q8_1)),
        T::Q2_K => fast!(scalar::q2_k, q2_k),
        T::Q3_K => fast!(scalar::q3_k, q3_k),
        T::Q4_K => fast!(scalar::q4_k, q4_k),
        T::Q5_K => fast!(scalar::q5_k, q5_k),
        T::Q6_K => fast!(scalar::q6_k, q6_k),
        T::Q8_K => sink.run(each(scalar::q8_k)),
        T::IQ2_XXS => fast!(scalar::iq2_xxs, iq2_xxs),
        T::IQ2_XS => fast!(scalar::iq2_xs, iq2_xs),
        T::IQ2_S => fast!(scalar::iq2_s, iq2_s),
        T::IQ3_XXS => fast!(scalar::iq3_xxs, iq3_xxs),
        T::IQ3_S => fast!(scalar::iq3_s, iq3_s),
        T::IQ1_S => fast!(scalar::iq1_s, iq1_s),
        T::IQ1_M => fast!(scalar::iq1_m, iq1_m),
        T::IQ4_NL => fast!(scalar::iq4_nl, iq4_nl),
        T::IQ4_XS => fast!(scalar::iq4_xs, iq4_xs),
        T::TQ1_0 => sink.run(each(scalar::tq1_0)),
        T::TQ2_0 => fast!(scalar::tq2_0, tq2_0),
        T::MXFP4 => fast!(scalar::mxfp4, mxfp4),
    }
}
