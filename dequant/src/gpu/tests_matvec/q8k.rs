//! The `Q4_K` products from `Q8_K` input on the int8 matrix units (`matmul_q8k`): the
//! quantizer against its definition on the host, the products against the f64 product of
//! the decoded weights with the quantized activations (what they compute, to f32 and f16
//! rounding) and with the activations themselves (the rounding of 8 bits a value, held to
//! the CPU product's own).

use super::*;
use crate::gpu::matmul;
use crate::gpu::matmul_q8k::{self, q8k_bytes, Q8K_BLOCK};

/// `x` (rows of `cols`) as the host reads the `Q8_K` bytes back: each value its int8
/// times its block's scale; with the bytes' sub-block sums checked against the values.
fn dequantize(q: &[u8], n: usize, cols: usize) -> Vec<f32> {
    let values = n * cols;
    let scales: Vec<f32> = q[values..values + values / Q8K_BLOCK * 4]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let sums_at = values + (values / Q8K_BLOCK * 4).div_ceil(16) * 16;
    let sums: Vec<f32> = q[sums_at..sums_at + values / 32 * 2]
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect();
    for (s, block) in q[..values].chunks_exact(32).enumerate() {
        let sum: i32 = block.iter().map(|&b| i32::from(b as i8)).sum();
        assert_eq!(
            sums[s],
            f16::from_f32(sum as f32).to_f32(),
            "sub-block {s}: its sum"
        );
    }
    q[..values]
        .iter()
        .enumerate()
        .map(|(i, &b)| f32::from(b as i8) * scales[i / Q8K_BLOCK])
        .collect()
}

/// The int8 values the quantizer must give for `x`: per block of 256, d = amax / 127 and
/// round(x · 127 / amax), ties to even.
fn host_values(x: &[f32]) -> Vec<i8> {
    x.chunks(Q8K_BLOCK)
        .flat_map(|block| {
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            block
                .iter()
                .map(move |v| (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8)
        })
        .collect()
}

/// The `Q8_K` bytes of `n` rows of `x` made on the device, and the buffer.
fn quantize(
    device: &Device,
    stream: &Stream,
    x: &[f32],
    n: usize,
    cols: usize,
) -> (DeviceBuffer<u8>, Vec<u8>) {
    let x_dev = upload(device, stream, x);
    let bytes = q8k_bytes(n, cols).expect("size");
    let mut q = upload(device, stream, &vec![0xa5u8; bytes]);
    matmul_q8k::quantize_q8k(x_dev.view(), n, cols, q.view_mut(), stream).expect("quantize");
    let mut host = vec![0u8; bytes];
    stream.read_to_host(q.view(), &mut host).expect("read back");
    (q, host)
}

/// The products of `mats` (one width) on `n` tokens of `x`, added to outputs holding
/// `initial` when given; with the host's reading of the quantized input. With `split`,
/// given room to split their columns (whose counters it checks are left at zero).
#[allow(clippy::too_many_arguments)]
fn gpu_q8k_with(
    device: &Device,
    stream: &Stream,
    mats: &[(&[u8], usize)],
    cols: usize,
    x: &[f32],
    n: usize,
    initial: Option<f32>,
    split: bool,
) -> (Vec<Vec<f32>>, Vec<f32>) {
    let bufs = upload_matrices(device, stream, mats);
    let gms = gpu_matrices(GgmlType::Q4_K, cols, mats, &bufs);
    let (q, host) = quantize(device, stream, x, n, cols);
    let mut outs: Vec<_> = mats
        .iter()
        .map(|&(_, rows)| upload(device, stream, &vec![initial.unwrap_or(f32::NAN); n * rows]))
        .collect();
    let mut views: Vec<_> = outs.iter_mut().map(|o| o.view_mut()).collect();
    let mut partials = upload(device, stream, &vec![f32::NAN; matmul::SPLIT_PARTIALS]);
    let mut counters = upload(device, stream, &vec![0u32; matmul::SPLIT_COUNTERS]);
    let room = split.then(|| matmul::SplitScratch {
        partials: partials.view_mut(),
        counters: counters.view_mut(),
    });
    matmul_q8k::matmul_q8k(
        &gms,
        q.view(),
        n,
        &mut views,
        initial.is_some(),
        room,
        stream,
    )
    .expect("q8k product");
    let mut left = vec![1u32; matmul::SPLIT_COUNTERS];
    stream
        .read_to_host(counters.view(), &mut left)
        .expect("read back");
    assert!(left.iter().all(|&c| c == 0), "split counters left at zero");
    let got = outs.iter().map(|o| download(stream, o)).collect();
    (got, dequantize(&host, n, cols))
}

/// `v` widened, to compare two products with [`relative_error`].
fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// [`gpu_q8k_with`] without room to split.
fn gpu_q8k(
    device: &Device,
    stream: &Stream,
    mats: &[(&[u8], usize)],
    cols: usize,
    x: &[f32],
    n: usize,
    initial: Option<f32>,
) -> (Vec<Vec<f32>>, Vec<f32>) {
    gpu_q8k_with(device, stream, mats, cols, x, n, initial, false)
}

#[test]
fn q4_k_products_from_q8_k_input_match_the_reference() {
    let Some((device, stream)) = gpu_or_skip("q4_k_products_from_q8_k_input_match_the_reference")
    else {
        return;
    };
    if !matmul_q8k::q8k_takes(GgmlType::Q4_K, Q8K_BLOCK, &device) {
        eprintln!("skipped: the device has no int8 matrix units' path");
        return;
    }
    // One row; partial tiles of rows and tokens; several of each; a 7B's width.
    for (rows, cols, n) in [
        (1, 256, 9),
        (70, 512, 130),
        (130, 2816, 65),
        (300, 4096, 200),
    ] {
        let mut rng = Rng(31 + rows as u64 * 7 + n as u64);
        let w = random_matrix(GgmlType::Q4_K, rows, cols, &mut rng);
        // Activations of a few magnitudes, and one outlier a token, as a model's have.
        let mut x: Vec<f32> = (0..n * cols)
            .map(|i| rng.unit() * [0.1f32, 1.0, 30.0][i % 3])
            .collect();
        for t in 0..n {
            x[t * cols + (t * 37) % cols] = 200.0;
        }
        let (got, xq) = gpu_q8k(&device, &stream, &[(&w, rows)], cols, &x, n, None);
        let got = &got[0];
        assert!(
            got.iter().all(|v| v.is_finite()),
            "{rows}x{cols}, {n}: every output"
        );
        let err = relative_error(got, &reference(GgmlType::Q4_K, &w, rows, cols, &xq, n));
        assert!(
            err <= 2e-5,
            "{rows}x{cols}, {n} tokens: relative error {err:.2e} against the quantized input"
        );
        // Against the exact product: the rounding of the activations to 8 bits a value,
        // which the CPU's own Q4_K product (from Q8_K blocks) shares.
        let want = reference(GgmlType::Q4_K, &w, rows, cols, &x, n);
        let err = relative_error(got, &want);
        let cpu = cpu_error(GgmlType::Q4_K, &w, rows, cols, &x, n, &want);
        assert!(
            err <= 1.25 * cpu + 1e-4,
            "{rows}x{cols}, {n} tokens: relative error {err:.2e} against the exact product, \
             the CPU's {cpu:.2e}"
        );
    }
}

#[test]
fn the_q8_k_quantizer_gives_the_hosts_values() {
    let Some((device, stream)) = gpu_or_skip("the_q8_k_quantizer_gives_the_hosts_values") else {
        return;
    };
    let (n, cols) = (5, 768);
    let mut rng = Rng(8080);
    let mut x: Vec<f32> = (0..n * cols).map(|_| rng.unit() * 3.0).collect();
    x[cols..2 * cols].fill(0.0); // a token of zeros
    x[2 * cols + 300] = f32::INFINITY; // a block with a non-finite value
    x[3 * cols + 5] = -1e30;
    let (_, host) = quantize(&device, &stream, &x, n, cols);
    let mut want = host_values(&x);
    want[2 * cols + 256..2 * cols + 512].fill(0);
    let got: Vec<i8> = host[..n * cols].iter().map(|&b| b as i8).collect();
    assert_eq!(got, want, "the int8 values");
    let xq = dequantize(&host, n, cols);
    assert!(
        xq[cols..2 * cols].iter().all(|&v| v == 0.0),
        "a token of zeros"
    );
    assert!(
        xq[2 * cols + 256..2 * cols + 512].iter().all(|&v| v == 0.0),
        "a block with a non-finite value reads as zeros"
    );
    assert!(
        (xq[3 * cols + 5] + 1e30).abs() <= 1e30 / 254.0,
        "the block's largest"
    );
}

#[test]
fn q8_k_products_fuse_accumulate_and_refuse_what_they_do_not_take() {
    let Some((device, stream)) =
        gpu_or_skip("q8_k_products_fuse_accumulate_and_refuse_what_they_do_not_take")
    else {
        return;
    };
    if !matmul_q8k::q8k_takes(GgmlType::Q4_K, Q8K_BLOCK, &device) {
        eprintln!("skipped: the device has no int8 matrix units' path");
        return;
    }
    let (cols, n) = (1024, 100);
    let mut rng = Rng(4243);
    let ws: Vec<(Vec<u8>, usize)> = [70usize, 130, 260]
        .into_iter()
        .map(|rows| (random_matrix(GgmlType::Q4_K, rows, cols, &mut rng), rows))
        .collect();
    let mats: Vec<(&[u8], usize)> = ws.iter().map(|(w, rows)| (w.as_slice(), *rows)).collect();
    let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
    let (together, _) = gpu_q8k(&device, &stream, &mats, cols, &x, n, None);
    for (got, &mat) in together.iter().zip(&mats) {
        let (alone, _) = gpu_q8k(&device, &stream, &[mat], cols, &x, n, None);
        assert_eq!(got, &alone[0], "{} rows: in one launch with others", mat.1);
        let (added, _) = gpu_q8k(&device, &stream, &[mat], cols, &x, n, Some(1.5));
        let expected: Vec<f32> = alone[0].iter().map(|v| v + 1.5).collect();
        assert_eq!(added[0], expected, "{} rows: accumulated", mat.1);
    }
    // Other types, widths that are not whole super-blocks, input of the wrong size.
    let w6 = random_matrix(GgmlType::Q6_K, 64, cols, &mut rng);
    let bufs = upload_matrices(&device, &stream, &[(&w6, 64)]);
    let gms = gpu_matrices(GgmlType::Q6_K, cols, &[(&w6, 64)], &bufs);
    let (q, _) = quantize(&device, &stream, &x, n, cols);
    let mut out = upload(&device, &stream, &vec![0f32; n * 64]);
    let refused = matmul_q8k::matmul_q8k(
        &gms,
        q.view(),
        n,
        &mut [out.view_mut()],
        false,
        None,
        &stream,
    );
    assert!(refused.is_err(), "Q6_K refused");
    let bufs = upload_matrices(&device, &stream, &[(&ws[0].0, 70)]);
    let gms = gpu_matrices(GgmlType::Q4_K, cols, &[(&ws[0].0, 70)], &bufs);
    let mut out = upload(&device, &stream, &vec![0f32; (n - 1) * 70]);
    let refused = matmul_q8k::matmul_q8k(
        &gms,
        q.view(),
        n - 1,
        &mut [out.view_mut()],
        false,
        None,
        &stream,
    );
    assert!(refused.is_err(), "input of another count of tokens refused");
    let x_dev = upload(&device, &stream, &x[..n * 1000]);
    let mut q = upload(&device, &stream, &vec![0u8; 2 * n * 1000]);
    let refused = matmul_q8k::quantize_q8k(x_dev.view(), n, 1000, q.view_mut(), &stream);
    assert!(refused.is_err(), "a width of partial blocks refused");
}

/// Products of a batch of decoding sequences (a few dozen tokens) against matrices of
/// few row tiles split their columns when given room: the same function as unsplit (to
/// f32 sums in another order), the same bits on every call, accumulation fused, and
/// every split's counter left at zero; for one matrix and for three in one launch.
#[test]
fn split_q8_k_products_match_and_repeat_exactly() {
    let Some((device, stream)) = gpu_or_skip("split_q8_k_products_match_and_repeat_exactly") else {
        return;
    };
    if !matmul_q8k::q8k_takes(GgmlType::Q4_K, Q8K_BLOCK, &device) {
        eprintln!("skipped: the device has no int8 matrix units' path");
        return;
    }
    // 4096 columns: 16 super-blocks to split; 11,008 (a 7B's down, 43 of them) too.
    for (rows, cols, n) in [
        (300, 4096, 32),
        (130, 4096, 64),
        (200, 11008, 9),
        (64, 512, 20),
    ] {
        let mut rng = Rng(77 + rows as u64 + n as u64);
        let ws: Vec<(Vec<u8>, usize)> = [rows, 70, 129]
            .into_iter()
            .map(|r| (random_matrix(GgmlType::Q4_K, r, cols, &mut rng), r))
            .collect();
        let mats: Vec<(&[u8], usize)> = ws.iter().map(|(w, r)| (w.as_slice(), *r)).collect();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.unit() * 2.0).collect();
        let what = format!("{rows}x{cols}, {n} tokens");
        let (split, xq) = gpu_q8k_with(&device, &stream, &mats[..1], cols, &x, n, None, true);
        let (whole, _) = gpu_q8k_with(&device, &stream, &mats[..1], cols, &x, n, None, false);
        let err = relative_error(&split[0], &f64s(&whole[0]));
        assert!(err <= 1e-6, "{what}: {err:.2e} from the unsplit product");
        let err = relative_error(
            &split[0],
            &reference(GgmlType::Q4_K, &ws[0].0, rows, cols, &xq, n),
        );
        assert!(err <= 2e-5, "{what}: {err:.2e} against the quantized input");
        let (again, _) = gpu_q8k_with(&device, &stream, &mats[..1], cols, &x, n, None, true);
        assert_eq!(split, again, "{what}: repeats");
        let (added, _) = gpu_q8k_with(&device, &stream, &mats[..1], cols, &x, n, Some(0.25), true);
        let expected: Vec<f32> = split[0].iter().map(|v| v + 0.25).collect();
        assert_eq!(added[0], expected, "{what}: accumulated");
        // In one launch with others (whose tiles may change the count of splits).
        let (together, _) = gpu_q8k_with(&device, &stream, &mats, cols, &x, n, None, true);
        for (got, &(w, r)) in together.iter().zip(&mats) {
            let (alone, _) = gpu_q8k_with(&device, &stream, &[(w, r)], cols, &x, n, None, false);
            let err = relative_error(got, &f64s(&alone[0]));
            assert!(
                err <= 1e-6,
                "{what}, {r} rows beside: {err:.2e} from unsplit"
            );
        }
    }
}
