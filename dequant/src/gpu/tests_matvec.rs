//! The GPU products against a plain f64 reference built from the CPU decoders, on random
//! blocks of every type the products take: one token and batches, several matrices in
//! one launch, accumulation, row counts that are not a multiple of a workgroup's rows,
//! one row, narrow and wide rows, and the largest vocabulary. The CPU products'
//! own error against the same reference is the yardstick: the GPU quantizes activations
//! differently (blocks of 32 for every type) and sums in another order, so the two agree
//! to rounding, not bit for bit.

use gguf_format::GgmlType;
use half::f16;
use hip_backend::{Device, DeviceBuffer, Stream};

use super::tests::gpu_or_skip;
use crate::gpu::matmul;
use crate::gpu::matvec::{self, q8_bytes, takes_q8, GpuActivations, GpuMatrix};
use crate::matmul::QuantizedMatrix;

mod batch;
mod q8k;

pub(super) use batch::rounded_bound;

/// Every type the GPU multiplies, so that a type made supported is tested here at once.
fn types() -> impl Iterator<Item = GgmlType> {
    GgmlType::ALL
        .into_iter()
        .filter(|&ty| matvec::is_supported_on_gpu(ty))
}

pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [-1, 1).
    pub(super) fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Offsets of the f16 scale fields in a block of `ty`.
fn f16_fields(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 => &[0],
        IQ4_NL | IQ4_XS | IQ3_XXS | IQ3_S | IQ2_XXS | IQ2_XS | IQ2_S | IQ1_S => &[0],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q4_1 | Q5_1 | Q4_K | Q5_K => &[0, 2],
        Q6_K => &[208],
        _ => &[],
    }
}

/// Sets the scales of a random block of `ty` that has no plain f16 field: IQ1_M's f16,
/// spread over the top nibbles of its four u16 scales, and MXFP4's power of two.
fn set_other_scales(ty: GgmlType, block: &mut [u8], rng: &mut Rng) {
    match ty {
        GgmlType::IQ1_M => {
            let bits = f16::from_f32(rng.unit() * 0.01).to_bits();
            for (i, at) in [49, 51, 53, 55].into_iter().enumerate() {
                let nibble = ((bits >> (4 * i)) & 0x0F) as u8;
                block[at] = (block[at] & 0x0F) | (nibble << 4);
            }
        }
        // 2^(e - 128): 2^-10 to 2^1.
        GgmlType::MXFP4 => block[0] = 118 + (rng.next() % 12) as u8,
        _ => {}
    }
}

/// `rows × cols` weights of `ty`: random quantized bits with small finite scales, or
/// random floats.
pub(super) fn random_matrix(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let n = rows * cols;
    match ty {
        GgmlType::F32 => (0..n)
            .flat_map(|_| (rng.unit() * 0.1).to_le_bytes())
            .collect(),
        GgmlType::F16 => (0..n)
            .flat_map(|_| f16::from_f32(rng.unit() * 0.1).to_le_bytes())
            .collect(),
        GgmlType::BF16 => (0..n)
            .flat_map(|_| half::bf16::from_f32(rng.unit() * 0.1).to_le_bytes())
            .collect(),
        _ => {
            let (size, values) = (ty.type_size() as usize, ty.block_size() as usize);
            let mut bytes: Vec<u8> = (0..n / values * size).map(|_| rng.next() as u8).collect();
            for block in bytes.chunks_exact_mut(size) {
                for &at in f16_fields(ty) {
                    let scale = f16::from_f32(rng.unit() * 0.01);
                    block[at..at + 2].copy_from_slice(&scale.to_le_bytes());
                }
                set_other_scales(ty, block, rng);
            }
            bytes
        }
    }
}

/// `x · Wᵀ` in f64 from the decoded weights.
fn reference(ty: GgmlType, w: &[u8], rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f64> {
    reference_rounded(ty, w, rows, cols, x, n, |v| v)
}

/// `x · Wᵀ` in f64 with every weight and activation first passed through `round`.
pub(super) fn reference_rounded(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    round: fn(f32) -> f32,
) -> Vec<f64> {
    let mut decoded = vec![0f32; rows * cols];
    crate::decode_f32(ty, w, &mut decoded).expect("weights decode");
    let decoded: Vec<f32> = decoded.into_iter().map(round).collect();
    let x: Vec<f32> = x.iter().map(|&v| round(v)).collect();
    let mut out = vec![0f64; n * rows];
    for t in 0..n {
        for r in 0..rows {
            let row = &decoded[r * cols..(r + 1) * cols];
            let xs = &x[t * cols..(t + 1) * cols];
            out[t * rows + r] = row
                .iter()
                .zip(xs)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
        }
    }
    out
}

/// `x` through the GPU's Q8 activation blocks: per 32 values, d = amax / 127 and each
/// value round(x / d)·d, rounding ties to even as the kernel does.
fn as_q8_blocks(x: &[f32]) -> Vec<f32> {
    x.chunks(32)
        .flat_map(|block| {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            block.iter().map(move |v| (v * id).round_ties_even() * d)
        })
        .collect()
}

pub(super) fn relative_error(got: &[f32], want: &[f64]) -> f64 {
    let num: f64 = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (f64::from(g) - w).powi(2))
        .sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    (num / den.max(1e-30)).sqrt()
}

pub(super) fn upload<T: bytemuck::Pod>(
    device: &Device,
    stream: &Stream,
    host: &[T],
) -> DeviceBuffer<T> {
    let mut buf = device.alloc::<T>(host.len()).expect("device buffer");
    stream
        .write_from_host(host, buf.view_mut())
        .expect("upload");
    buf
}

/// The values of `buf`, read back once the stream's work is done.
pub(super) fn download(stream: &Stream, buf: &DeviceBuffer<f32>) -> Vec<f32> {
    let mut host = vec![0f32; buf.len()];
    stream
        .read_to_host(buf.view(), &mut host)
        .expect("read back");
    host
}

/// The f16 input of the matrix units' products for `n` rows of `x`, and its row scales.
pub(super) fn f16_input(
    device: &Device,
    stream: &Stream,
    x: &[f32],
    n: usize,
    cols: usize,
) -> (DeviceBuffer<f16>, DeviceBuffer<f32>) {
    let x_dev = upload(device, stream, x);
    let mut scales = upload(device, stream, &vec![f32::NAN; n]);
    let mut x16 = upload(device, stream, &vec![f16::NAN; n * cols]);
    matmul::row_scales(
        x_dev.view(),
        n,
        cols,
        scales.view_mut(),
        x16.view_mut(),
        stream,
    )
    .expect("scales");
    (x16, scales)
}

/// The blocks of `weights` (each a matrix's blocks and rows) on the device.
pub(super) fn upload_matrices<W: AsRef<[u8]>>(
    device: &Device,
    stream: &Stream,
    weights: &[(W, usize)],
) -> Vec<DeviceBuffer<u8>> {
    weights
        .iter()
        .map(|(w, _)| upload(device, stream, w.as_ref()))
        .collect()
}

/// The matrices of `ty`, `cols` wide, of `weights` uploaded as `bufs`.
pub(super) fn gpu_matrices<'a, W>(
    ty: GgmlType,
    cols: usize,
    weights: &[(W, usize)],
    bufs: &'a [DeviceBuffer<u8>],
) -> Vec<GpuMatrix<'a>> {
    bufs.iter()
        .zip(weights)
        .map(|(b, &(_, rows))| GpuMatrix::new(ty, rows, cols, b.view()).expect("matrix"))
        .collect()
}

/// Runs `mats` (one type, one width) on `n` tokens on the GPU and returns each output.
#[allow(clippy::too_many_arguments)]
pub(super) fn gpu_products(
    device: &Device,
    stream: &Stream,
    ty: GgmlType,
    weights: &[(Vec<u8>, usize)],
    cols: usize,
    x: &[f32],
    n: usize,
    initial: Option<&[Vec<f32>]>,
) -> Vec<Vec<f32>> {
    let bufs = upload_matrices(device, stream, weights);
    let mats = gpu_matrices(ty, cols, weights, &bufs);
    let x_dev = upload(device, stream, x);
    let mut q8 = device.alloc::<u8>(q8_bytes(n, cols)).expect("q8 buffer");
    let act = if takes_q8(ty) {
        matvec::quantize_q8(x_dev.view(), n, cols, q8.view_mut(), stream).expect("quantize");
        GpuActivations::Q8(q8.view())
    } else {
        GpuActivations::F32(x_dev.view())
    };
    let mut outs: Vec<_> = weights
        .iter()
        .enumerate()
        .map(|(i, (_, rows))| {
            let start = initial.map_or(vec![f32::NAN; n * rows], |init| init[i].clone());
            upload(device, stream, &start)
        })
        .collect();
    let mut views: Vec<_> = outs.iter_mut().map(|o| o.view_mut()).collect();
    matvec::matvec(&mats, act, n, &mut views, initial.is_some(), stream).expect("product");
    outs.iter().map(|o| download(stream, o)).collect()
}

/// The CPU product's relative error against the reference, the yardstick.
fn cpu_error(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    want: &[f64],
) -> f64 {
    let m = QuantizedMatrix::new(ty, rows, cols, w).expect("cpu matrix");
    let mut out = vec![0f32; n * rows];
    m.matmul(x, n, &mut out).expect("cpu product");
    relative_error(&out, want)
}

fn check_type(
    device: &Device,
    stream: &Stream,
    ty: GgmlType,
    rows: usize,
    cols: usize,
    n: usize,
    seed: u64,
) {
    let mut rng = Rng(seed | 1);
    let w = random_matrix(ty, rows, cols, &mut rng);
    let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
    let want = reference(ty, &w, rows, cols, &x, n);
    let got = gpu_products(device, stream, ty, &[(w.clone(), rows)], cols, &x, n, None);
    let gpu_err = relative_error(&got[0], &want);
    if takes_q8(ty) {
        // The same activations as the GPU's Q8 blocks: then only the order of the f32
        // sums differs, so any misread weight shows.
        let want_q8 = reference(ty, &w, rows, cols, &as_q8_blocks(&x), n);
        let err = relative_error(&got[0], &want_q8);
        assert!(
            err <= 1e-4,
            "{ty} {rows}x{cols}, {n} tokens: relative error {err:.2e} against the \
             quantized activations"
        );
    }
    // Where the CPU has no product for the type, the fixed bound below alone.
    let cpu_err = if crate::matmul::is_supported(ty) {
        cpu_error(ty, &w, rows, cols, &x, n, &want)
    } else {
        0.0
    };
    // Float weights: f32 sums, differing only in order. Quantized: the 8-bit
    // activations' rounding, about half a step of 1/127 of each block's largest value.
    let bound = if takes_q8(ty) && cpu_err > 0.0 {
        (2.0 * cpu_err).max(0.01)
    } else if takes_q8(ty) {
        // No CPU yardstick: the check above against the quantized activations is the
        // exact one; this one only bounds their rounding (wider weights, e.g. the
        // non-linear grids' ±127, sum fewer terms of the same size).
        0.03
    } else {
        1e-5
    };
    assert!(
        gpu_err <= bound && got[0].iter().all(|v| v.is_finite()),
        "{ty} {rows}x{cols}, {n} tokens: GPU relative error {gpu_err:.2e} > {bound:.2e} \
         (CPU {cpu_err:.2e})"
    );
}

#[test]
fn products_match_the_reference_for_every_type_and_shape() {
    let Some((device, stream)) =
        gpu_or_skip("products_match_the_reference_for_every_type_and_shape")
    else {
        return;
    };
    for ty in types() {
        // Narrow (4 rows a workgroup), middle (2) and wide (1) rows; row counts that
        // leave a workgroup half full; one row; 1, 3 and 8 tokens. Types of 32-value
        // blocks also take rows of 9 blocks, which start at every alignment their
        // block size allows (MXFP4's 17-byte blocks at any byte).
        let odd_rows = (ty.block_size() == 32).then_some((9, 288, 3));
        for (rows, cols, n) in [
            (1, 256, 1),
            (7, 256, 3),
            (130, 512, 1),
            (33, 768, 8),
            (65, 2816, 2),
        ]
        .into_iter()
        .chain(odd_rows)
        {
            check_type(
                &device,
                &stream,
                ty,
                rows,
                cols,
                n,
                1000 + u64::from(ty.id()) * 7 + rows as u64,
            );
        }
    }
}

#[test]
fn float_products_take_any_count_of_tokens_in_groups() {
    let Some((device, stream)) = gpu_or_skip("float_products_take_any_count_of_tokens_in_groups")
    else {
        return;
    };
    // Whole groups of MAX_TOKENS only, whole groups and a rest, more groups than one
    // launch of the quantized products could take; rows a workgroup of 1, 2 and 4.
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for (rows, cols, n) in [(128, 2048, 32), (60, 256, 19), (7, 4096, 9), (1, 512, 75)] {
            check_type(
                &device,
                &stream,
                ty,
                rows,
                cols,
                n,
                77 + rows as u64 + n as u64,
            );
        }
    }
    // Quantized weights still take at most MAX_TOKENS.
    let w = random_matrix(GgmlType::Q8_0, 4, 256, &mut Rng(5));
    let buf = upload(&device, &stream, &w);
    let m = GpuMatrix::new(GgmlType::Q8_0, 4, 256, buf.view()).expect("matrix");
    let n = matvec::MAX_TOKENS + 1;
    let q8 = device.alloc::<u8>(q8_bytes(n, 256)).expect("q8 buffer");
    let mut out = device.alloc::<f32>(n * 4).expect("output");
    let refused = matvec::matvec(
        &[m],
        GpuActivations::Q8(q8.view()),
        n,
        &mut [out.view_mut()],
        false,
        &stream,
    );
    assert!(refused.is_err(), "{n} tokens of Q8_0 were taken");
}

#[test]
fn the_largest_vocabulary_fits_one_launch() {
    let Some((device, stream)) = gpu_or_skip("the_largest_vocabulary_fits_one_launch") else {
        return;
    };
    check_type(&device, &stream, GgmlType::Q8_0, 262_144, 256, 1, 42);
}

#[test]
fn fused_matrices_and_accumulation_give_each_products_result() {
    let Some((device, stream)) =
        gpu_or_skip("fused_matrices_and_accumulation_give_each_products_result")
    else {
        return;
    };
    let mut rng = Rng(77);
    let (cols, n) = (512, 2);
    for ty in [GgmlType::Q4_K, GgmlType::Q8_0, GgmlType::F16] {
        let weights: Vec<(Vec<u8>, usize)> = [64, 16, 16]
            .iter()
            .map(|&rows| (random_matrix(ty, rows, cols, &mut rng), rows))
            .collect();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
        let initial: Vec<Vec<f32>> = weights.iter().map(|(_, r)| vec![1.5; n * r]).collect();
        let fused = gpu_products(&device, &stream, ty, &weights, cols, &x, n, Some(&initial));
        for (i, (w, rows)) in weights.iter().enumerate() {
            let alone = gpu_products(
                &device,
                &stream,
                ty,
                &[(w.clone(), *rows)],
                cols,
                &x,
                n,
                None,
            );
            let expected: Vec<f32> = alone[0].iter().map(|v| v + 1.5).collect();
            assert_eq!(
                fused[i], expected,
                "{ty}: matrix {i} fused with accumulation"
            );
        }
    }
}

#[test]
fn mismatched_products_are_refused_before_any_launch() {
    let Some((device, stream)) = gpu_or_skip("mismatched_products_are_refused_before_any_launch")
    else {
        return;
    };
    let w = device.alloc::<u8>(144).expect("buffer");
    // A Q4_K row of 256 values is 144 bytes: 255 columns is not whole blocks.
    assert!(GpuMatrix::new(GgmlType::Q4_K, 1, 255, w.view()).is_err());
    assert!(GpuMatrix::new(GgmlType::Q4_K, 2, 256, w.view()).is_err());
    let m = GpuMatrix::new(GgmlType::Q4_K, 1, 256, w.view()).expect("one row");
    let x = device.alloc::<f32>(256).expect("buffer");
    let mut out = device.alloc::<f32>(1).expect("buffer");
    let mut run = |act, n| matvec::matvec(&[m], act, n, &mut [out.view_mut()], false, &stream);
    // Quantized weights take Q8 blocks, not f32 values.
    assert!(run(GpuActivations::F32(x.view()), 1).is_err());
    // Nine tokens is one more than a launch takes.
    let q8 = device.alloc::<u8>(q8_bytes(9, 256)).expect("buffer");
    assert!(run(GpuActivations::Q8(q8.view()), 9).is_err());
}

#[test]
fn a_products_code_loads_ahead_for_every_type_and_token_count() {
    let Some((device, stream)) =
        gpu_or_skip("a_products_code_loads_ahead_for_every_type_and_token_count")
    else {
        return;
    };
    for ty in types() {
        // Widths whose rows take 1, 2 and 4 rows a workgroup for some types.
        for cols in [256, 4096, 11008] {
            for n in 1..=matvec::MAX_TOKENS {
                matvec::load_matvec(ty, cols, n, &stream)
                    .unwrap_or_else(|e| panic!("{ty}, {cols} columns, {n} tokens: {e}"));
            }
        }
        // And a product it loaded for still gives the reference's result (a case of
        // products_match_the_reference_for_every_type_and_shape, seed included).
        let (rows, cols, n) = (130, 512, 1);
        let seed = 1000 + u64::from(ty.id()) * 7 + rows as u64;
        matvec::load_matvec(ty, cols, n, &stream).expect("loaded");
        check_type(&device, &stream, ty, rows, cols, n, seed);
    }
    use crate::DequantError::*;
    let refused = |ty, cols, n| match matvec::load_matvec(ty, cols, n, &stream) {
        Err(super::GpuDequantError::Layout(error)) => error,
        other => panic!("{ty}, {cols} columns, {n} tokens: {other:?}"),
    };
    assert!(matches!(
        refused(GgmlType::Q4_K, 256, 0),
        ProductTokens { n_tokens: 0, .. }
    ));
    assert!(matches!(
        refused(GgmlType::Q4_K, 256, 9),
        ProductTokens { n_tokens: 9, .. }
    ));
    assert!(matches!(refused(GgmlType::Q4_K, 255, 1), PartialRow { .. }));
    assert!(matches!(
        refused(GgmlType::I8, 256, 1),
        NoProductKernel { .. }
    ));
}

/// The products negate the IQ2 and IQ3 grid magnitudes four bytes at a time, as
/// `(g ^ 0xFF) + 1` in one 32-bit add, which would carry into the next byte for a
/// magnitude of 0: the grids hold none.
#[test]
fn the_grid_magnitudes_the_products_negate_are_never_zero() {
    use crate::decode::grids;
    fn bytes<T: bytemuck::Pod>(table: &[T]) -> &[u8] {
        bytemuck::cast_slice(table)
    }
    for (name, table) in [
        ("IQ3XXS_GRID", bytes(&grids::IQ3XXS_GRID)),
        ("IQ3S_GRID", bytes(&grids::IQ3S_GRID)),
        ("IQ2XXS_GRID", bytes(&grids::IQ2XXS_GRID)),
        ("IQ2XS_GRID", bytes(&grids::IQ2XS_GRID)),
        ("IQ2S_GRID", bytes(&grids::IQ2S_GRID)),
    ] {
        assert!(
            table.iter().all(|&b| b != 0),
            "{name} holds a magnitude of 0"
        );
    }
}

/// The products compute the sign bytes of IQ2_XXS, IQ2_XS and IQ3_XXS as the seven bits
/// of the sign index and their parity, instead of reading `KSIGNS_IQ2XS`.
#[test]
fn sign_bytes_are_seven_bits_and_their_parity() {
    use crate::decode::grids::KSIGNS_IQ2XS;
    for (i, &signs) in (0u32..).zip(KSIGNS_IQ2XS.iter()) {
        assert_eq!(
            u32::from(signs),
            i | ((i.count_ones() & 1) << 7),
            "index {i}"
        );
    }
}

/// The GPU multiplies every type the CPU does but the ternary TQ1_0 and TQ2_0, so a
/// model the CPU runs is refused by the GPU only for its architecture, its features or
/// those two types. A type multiplied on the CPU alone is refused by `model`'s
/// `check_plan` and needs a model-level refusal test (model/tests/real_models/
/// synthetic.rs, `gpu_refuses_type!`) before it joins the list below.
#[test]
fn the_gpu_multiplies_every_type_the_cpu_does() {
    const CPU_ONLY: [GgmlType; 2] = [GgmlType::TQ1_0, GgmlType::TQ2_0];
    for ty in GgmlType::ALL {
        if crate::matmul::is_supported(ty) {
            assert_eq!(
                matvec::is_supported_on_gpu(ty),
                !CPU_ONLY.contains(&ty),
                "{ty}: multiplied on the CPU only, or listed as such but on the GPU too"
            );
        }
    }
}
