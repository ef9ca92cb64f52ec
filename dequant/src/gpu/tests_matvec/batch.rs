//! The batch products (`matmul`): the tiled kernel and the skinny one, split or not,
//! against the f16-rounded and the exact references, and their f16 input.

use super::*;

/// The batch products of matrices `mats` (their blocks and rows) of one type and width
/// on `n` tokens, in one launch, each added to outputs filled with `initial` when given;
/// with `split`, given room to split their columns (whose counters it checks are left at
/// zero).
#[allow(clippy::too_many_arguments)]
fn gpu_matmul_many(
    device: &Device,
    stream: &Stream,
    ty: GgmlType,
    mats: &[(&[u8], usize)],
    cols: usize,
    x: &[f32],
    n: usize,
    initial: Option<f32>,
    split: bool,
    kernel: matmul::BatchKernel,
) -> Vec<Vec<f32>> {
    let bufs = upload_matrices(device, stream, mats);
    let gms = gpu_matrices(ty, cols, mats, &bufs);
    let (x16, scales) = f16_input(device, stream, x, n, cols);
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
    matmul::matmul_with(
        kernel,
        &gms,
        x16.view(),
        scales.view(),
        n,
        &mut views,
        initial.is_some(),
        room,
        stream,
    )
    .expect("batch product");
    let mut left = vec![1u32; matmul::SPLIT_COUNTERS];
    stream
        .read_to_host(counters.view(), &mut left)
        .expect("read back");
    assert!(left.iter().all(|&c| c == 0), "split counters left at zero");
    outs.iter().map(|o| download(stream, o)).collect()
}

/// The tiled batch product of one matrix on `n` tokens, added to `initial` when given.
#[allow(clippy::too_many_arguments)]
fn gpu_matmul(
    device: &Device,
    stream: &Stream,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    initial: Option<f32>,
) -> Vec<f32> {
    let mut outs = gpu_matmul_many(
        device,
        stream,
        ty,
        &[(w, rows)],
        cols,
        x,
        n,
        initial,
        false,
        matmul::BatchKernel::Tiles,
    );
    outs.pop().expect("one output")
}

/// How far the batch product may be from the product of the f16-rounded decoded weights
/// and activations (relative, root mean square). Most types' f16 weights are exactly the
/// rounded decoded values, so only the sum order separates them. Q4_K and Q6_K decode in
/// f16 arithmetic, rounding their minimum or their scale to f16 first: a weight may land
/// one unit in the last place (2^-11 relative) from the rounded value, independently of
/// its neighbours, so their results spread by a fraction of 2^-11 (1e-3 leaves room, and
/// the check against the exact product below still holds them to 2e-3).
pub(in crate::gpu) fn rounded_bound(ty: GgmlType) -> f64 {
    match ty {
        GgmlType::Q4_K | GgmlType::Q6_K => 1e-3,
        _ => 1e-4,
    }
}

/// Checks that a batch product `got` of `w` on `x` wrote every output and is within
/// [`rounded_bound`] of the product of the f16-rounded operands; `kernel` names the
/// product in the messages.
#[allow(clippy::too_many_arguments)]
fn check_rounded(
    kernel: &str,
    ty: GgmlType,
    got: &[f32],
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
) {
    assert!(
        got.iter().all(|v| v.is_finite()),
        "{ty} {rows}x{cols}, {n} tokens: every output written"
    );
    let err = relative_error(
        got,
        &reference_rounded(ty, w, rows, cols, x, n, |v| f16::from_f32(v).to_f32()),
    );
    assert!(
        err <= rounded_bound(ty),
        "{ty} {rows}x{cols}, {n} tokens: {kernel}relative error {err:.2e} against the \
         f16-rounded operands"
    );
}

#[test]
fn batch_products_match_the_reference_for_every_type_and_shape() {
    let Some((device, stream)) =
        gpu_or_skip("batch_products_match_the_reference_for_every_type_and_shape")
    else {
        return;
    };
    for (i, ty) in types().enumerate() {
        // One row; rows and tokens that leave a tile partly empty; several token tiles.
        for (rows, cols, n) in [(1, 256, 9), (70, 512, 130), (130, 2816, 33)] {
            let mut rng = Rng((5000 + i as u64 * 11 + rows as u64) | 1);
            let w = random_matrix(ty, rows, cols, &mut rng);
            let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
            let got = gpu_matmul(&device, &stream, ty, &w, rows, cols, &x, n, None);
            check_rounded("", ty, &got, &w, rows, cols, &x, n);
            // Against the exact product: f16's 11 significant bits on both operands.
            let err = relative_error(&got, &reference(ty, &w, rows, cols, &x, n));
            assert!(
                err <= 2e-3,
                "{ty} {rows}x{cols}, {n} tokens: relative error {err:.2e}"
            );
        }
    }
    // Enough rows and tokens for the 128-row tiles (which need two workgroups per
    // multiprocessor), with partial tiles of both.
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::F16] {
        let (rows, cols, n) = (2200, 256, 2050);
        let mut rng = Rng(777 + ty as u64);
        let w = random_matrix(ty, rows, cols, &mut rng);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
        let got = gpu_matmul(&device, &stream, ty, &w, rows, cols, &x, n, None);
        let err = relative_error(
            &got,
            &reference_rounded(ty, &w, rows, cols, &x, n, |v| f16::from_f32(v).to_f32()),
        );
        assert!(
            err <= rounded_bound(ty),
            "{ty} {rows}x{cols}, {n} tokens: relative error {err:.2e} against the f16-rounded \
             operands"
        );
    }
    // Three matrices of one type and width in one launch give what each gives alone.
    let (cols, n) = (512, 40);
    let mut rng = Rng(4242);
    let ws: Vec<(Vec<u8>, usize)> = [70usize, 130, 200]
        .into_iter()
        .map(|rows| (random_matrix(GgmlType::Q6_K, rows, cols, &mut rng), rows))
        .collect();
    let mats: Vec<(&[u8], usize)> = ws.iter().map(|(w, rows)| (w.as_slice(), *rows)).collect();
    let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
    let together = gpu_matmul_many(
        &device,
        &stream,
        GgmlType::Q6_K,
        &mats,
        cols,
        &x,
        n,
        None,
        false,
        matmul::BatchKernel::Tiles,
    );
    for (got, &(w, rows)) in together.iter().zip(&mats) {
        let alone = gpu_matmul(&device, &stream, GgmlType::Q6_K, w, rows, cols, &x, n, None);
        assert_eq!(got, &alone, "{rows} rows: in one launch with others");
    }
    // Accumulation adds the same products to what the output holds.
    let mut rng = Rng(99);
    let (rows, cols, n) = (96, 512, 20);
    let w = random_matrix(GgmlType::Q4_K, rows, cols, &mut rng);
    let q4_k = |x: &[f32], initial| {
        gpu_matmul(
            &device,
            &stream,
            GgmlType::Q4_K,
            &w,
            rows,
            cols,
            x,
            n,
            initial,
        )
    };
    let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
    let alone = q4_k(&x, None);
    let added = q4_k(&x, Some(1.5));
    let expected: Vec<f32> = alone.iter().map(|v| v + 1.5).collect();
    assert_eq!(added, expected, "accumulated batch product");
    // Activations far past f16's range (65504), and a token of zeros: each token is
    // scaled by a power of two first, so nothing overflows.
    let mut x: Vec<f32> = (0..n * cols).map(|_| rng.unit() * 1e6).collect();
    x[..cols].fill(0.0);
    let got = q4_k(&x, None);
    assert!(got[..rows].iter().all(|&v| v == 0.0), "a token of zeros");
    let err = relative_error(&got, &reference(GgmlType::Q4_K, &w, rows, cols, &x, n));
    assert!(err <= 2e-3, "large activations: relative error {err:.2e}");
}

/// Products of few tokens against matrices of few rows split their columns over several
/// workgroups per tile when given room, in the tiled kernel and (up to its limit of
/// tokens, where the device runs it) the skinny one: the same function as unsplit (to the
/// f16-rounded reference's bound), the same bits on every call, accumulation included,
/// and the tile counters left at zero (checked by `gpu_matmul_many`).
#[test]
fn split_batch_products_match_and_repeat_exactly() {
    let Some((device, stream)) = gpu_or_skip("split_batch_products_match_and_repeat_exactly")
    else {
        return;
    };
    let mut kernels = vec![matmul::BatchKernel::Tiles];
    if matmul::skinny_available(&device) {
        kernels.push(matmul::BatchKernel::Skinny);
    }
    for (i, ty) in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::Q4_1,
        GgmlType::F16,
    ]
    .into_iter()
    .enumerate()
    {
        // 4096 columns: 16 super-blocks (or 32 chunks of four blocks) to split.
        for (rows, n) in [(200, 9), (1000, 40), (64, 2), (64, 130)] {
            let cols = 4096;
            let mut rng = Rng(9000 + i as u64 * 7 + rows as u64);
            let w = random_matrix(ty, rows, cols, &mut rng);
            let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
            for &kernel in &kernels {
                if kernel == matmul::BatchKernel::Skinny && n > matmul::SKINNY_MAX_TOKENS {
                    continue;
                }
                let run = |initial| {
                    let mats = [(w.as_slice(), rows)];
                    gpu_matmul_many(
                        &device, &stream, ty, &mats, cols, &x, n, initial, true, kernel,
                    )
                    .pop()
                    .expect("one output")
                };
                let what = format!("{ty} {rows}x{cols}, {n} tokens, {kernel:?} split");
                let split = run(None);
                let err = relative_error(
                    &split,
                    &reference_rounded(ty, &w, rows, cols, &x, n, |v| f16::from_f32(v).to_f32()),
                );
                assert!(err <= rounded_bound(ty), "{what}: relative error {err:.2e}");
                assert_eq!(split, run(None), "{what}: repeats");
                let added = run(Some(0.25));
                let expected: Vec<f32> = split.iter().map(|v| v + 0.25).collect();
                assert_eq!(added, expected, "{what}: accumulates");
            }
        }
    }
}

/// The skinny batch products (few tokens, weights decoded straight into the matrix
/// instructions' registers) compute every type's product to the f16-rounded reference's
/// bound: one row and partial 16-row tiles, widths that end inside a 64-column step,
/// token counts inside and at the ends of each token-group size (8, 16, 32, 64), several
/// matrices in one launch, accumulation, and the same bits on every call (split columns:
/// `split_batch_products_match_and_repeat_exactly`).
#[test]
fn skinny_batch_products_match_the_reference_and_repeat_exactly() {
    let Some((device, stream)) =
        gpu_or_skip("skinny_batch_products_match_the_reference_and_repeat_exactly")
    else {
        return;
    };
    if !matmul::skinny_available(&device) {
        eprintln!(
            "SKIPPED skinny_batch_products_match_the_reference_and_repeat_exactly: \
             the skinny kernel needs an NVIDIA GPU of compute capability 8.0 or later"
        );
        return;
    }
    let skinny = |ty, mats: &[(&[u8], usize)], cols, x: &[f32], n, initial| {
        gpu_matmul_many(
            &device,
            &stream,
            ty,
            mats,
            cols,
            x,
            n,
            initial,
            false,
            matmul::BatchKernel::Skinny,
        )
    };
    for (i, ty) in types().enumerate() {
        let mut shapes = vec![(1, 256, 1), (70, 512, 9), (33, 768, 64), (130, 2816, 17)];
        if ty.block_size() <= 32 {
            // 96 columns: the second step of 64 ends half way.
            shapes.extend([(20, 96, 5), (17, 160, 33)]);
        }
        for (rows, cols, n) in shapes {
            let mut rng = Rng((7000 + i as u64 * 13 + rows as u64) | 1);
            let w = random_matrix(ty, rows, cols, &mut rng);
            let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
            let mats = [(w.as_slice(), rows)];
            let got = skinny(ty, &mats, cols, &x, n, None)
                .pop()
                .expect("one output");
            check_rounded("skinny ", ty, &got, &w, rows, cols, &x, n);
            let again = skinny(ty, &mats, cols, &x, n, None)
                .pop()
                .expect("one output");
            assert_eq!(got, again, "{ty} {rows}x{cols}, {n} tokens: skinny repeats");
        }
    }
    // Three matrices in one launch, and accumulation, for two types with loads of their
    // own and one through the general decoders.
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::IQ4_XS] {
        let (cols, n) = (1024, 24);
        let mut rng = Rng(31337 + ty as u64);
        let ws: Vec<(Vec<u8>, usize)> = [48usize, 70, 200]
            .into_iter()
            .map(|rows| (random_matrix(ty, rows, cols, &mut rng), rows))
            .collect();
        let mats: Vec<(&[u8], usize)> = ws.iter().map(|(w, rows)| (w.as_slice(), *rows)).collect();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
        let together = skinny(ty, &mats, cols, &x, n, None);
        for (got, &(w, rows)) in together.iter().zip(&mats) {
            let err = relative_error(
                got,
                &reference_rounded(ty, w, rows, cols, &x, n, |v| f16::from_f32(v).to_f32()),
            );
            assert!(
                err <= rounded_bound(ty),
                "{ty} {rows}x{cols}, {n} tokens, three in one launch: relative error {err:.2e}"
            );
        }
        let added = skinny(ty, &mats, cols, &x, n, Some(0.5));
        for (sum, alone) in added.iter().zip(&together) {
            let expected: Vec<f32> = alone.iter().map(|v| v + 0.5).collect();
            assert_eq!(sum, &expected, "{ty}: skinny accumulates");
        }
    }
}

/// The batch products' input: each token's power-of-two scale and its values divided by
/// it in f16, against the host's, for few tokens (the most threads each) and many, widths
/// that are and are not multiples of four, and an input and output that start off the
/// 16- and 8-byte boundaries the wide loads and stores need.
#[test]
fn row_scales_match_the_host() {
    let Some((device, stream)) = gpu_or_skip("row_scales_match_the_host") else {
        return;
    };
    let mut rng = Rng(4242);
    for (n, cols, offset) in [
        (3, 4096, 0),
        (200, 1030, 0),
        (5, 6, 0),
        (7, 512, 1),
        (1, 9, 3),
    ] {
        let mut x: Vec<f32> = (0..n * cols + offset)
            .map(|_| 3000.0 * rng.unit())
            .collect();
        x[offset] = 0.5; // a first token of small values
        let zeros = offset + cols..offset + 2 * cols;
        if n > 2 {
            x[zeros].fill(0.0); // and a second of zeros
        }
        let x_dev = upload(&device, &stream, &x);
        let mut scales = upload(&device, &stream, &vec![f32::NAN; n]);
        let mut x16 = upload(&device, &stream, &vec![f16::NAN; n * cols + offset]);
        let input = x_dev
            .view()
            .slice(offset..offset + n * cols)
            .expect("input");
        let output = x16
            .view_mut()
            .slice_mut(offset..offset + n * cols)
            .expect("output");
        matmul::row_scales(input, n, cols, scales.view_mut(), output, &stream).expect("scales");
        let mut got_scales = vec![0f32; n];
        stream
            .read_to_host(scales.view(), &mut got_scales)
            .expect("read back");
        let mut got = vec![f16::ZERO; n * cols + offset];
        stream
            .read_to_host(x16.view(), &mut got)
            .expect("read back");
        for t in 0..n {
            let row = &x[offset + t * cols..offset + (t + 1) * cols];
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = if amax > 0.0 {
                // ilogb of a normal number: its exponent field, unbiased.
                2f32.powi(((amax.to_bits() >> 23) & 0xff) as i32 - 127 - 14)
            } else {
                1.0
            };
            assert_eq!(
                got_scales[t], scale,
                "{n}x{cols}+{offset}: token {t}'s scale"
            );
            for (j, &v) in row.iter().enumerate() {
                assert_eq!(
                    got[offset + t * cols + j],
                    f16::from_f32(v / scale),
                    "{n}x{cols}+{offset}: token {t}, value {j}"
                );
            }
        }
    }
}

/// Past whole tiles of 128 tokens, `matmul` runs the tiles on those tokens and, for up to
/// 32 tokens left on matrices of 16 MiB and more where the device runs the skinny
/// kernel, that kernel on the rest: bit for bit what each kernel gives on its tokens
/// alone. Smaller matrices, and more tokens left, take the tiles whole.
#[test]
fn tokens_past_whole_tiles_take_the_tiled_and_the_skinny_products() {
    let Some((device, stream)) =
        gpu_or_skip("tokens_past_whole_tiles_take_the_tiled_and_the_skinny_products")
    else {
        return;
    };
    let skinny = matmul::skinny_available(&device);
    let ty = GgmlType::Q4_K;
    let cols = 4096;
    let mut rng = Rng(31337);
    // 7,400 rows of 2,304 bytes: 17 MB; 1,000 rows: 2.3 MB.
    for (rows, n) in [(7400, 133), (7400, 160), (7400, 200), (1000, 133)] {
        let w = random_matrix(ty, rows, cols, &mut rng);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
        let run = |x: &[f32], n: usize, kernel| {
            gpu_matmul_many(
                &device,
                &stream,
                ty,
                &[(&w, rows)],
                cols,
                x,
                n,
                None,
                true,
                kernel,
            )
            .pop()
            .expect("one output")
        };
        let fastest = run(&x, n, matmul::BatchKernel::Fastest);
        let rest = n % 128;
        let what = format!("{rows}x{cols}, {n} tokens");
        if skinny && rows == 7400 && rest <= 32 {
            let whole = n - rest;
            let tiles = run(&x[..whole * cols], whole, matmul::BatchKernel::Tiles);
            let tail = run(&x[whole * cols..], rest, matmul::BatchKernel::Skinny);
            assert!(
                fastest[..whole * rows] == tiles[..],
                "{what}: the whole tiles' tokens differ from the tiled products'"
            );
            assert!(
                fastest[whole * rows..] == tail[..],
                "{what}: the {rest} tokens left differ from the skinny products'"
            );
        } else {
            let tiles = run(&x, n, matmul::BatchKernel::Tiles);
            assert!(fastest == tiles, "{what}: differ from the tiled products");
        }
    }
}

/// A prompt's product with a matrix of few rows (a 7B's down projection at 512 tokens:
/// 32 tiles of 128 rows × 4 of tokens, one round of one to two workgroups a multiprocessor
/// on an H100 or H200) takes 128-row tiles split in two when given room: rows at both ends
/// hold to the f16-rounded reference's bound, the whole to the unsplit product's, and the
/// same bits come on every call (the counters left at zero: `gpu_matmul_many`).
#[test]
fn prompt_products_of_few_rows_split_their_columns_and_match() {
    let Some((device, stream)) =
        gpu_or_skip("prompt_products_of_few_rows_split_their_columns_and_match")
    else {
        return;
    };
    let (rows, cols, n) = (4096, 4096, 512);
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
        let mut rng = Rng(2024 + ty as u64);
        let w = random_matrix(ty, rows, cols, &mut rng);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
        let run = |split| {
            gpu_matmul_many(
                &device,
                &stream,
                ty,
                &[(&w, rows)],
                cols,
                &x,
                n,
                None,
                split,
                matmul::BatchKernel::Tiles,
            )
            .pop()
            .expect("one output")
        };
        let split = run(true);
        assert!(split == run(true), "{ty}: repeats");
        let whole = run(false);
        let f64s: Vec<f64> = whole.iter().map(|&v| f64::from(v)).collect();
        let err = relative_error(&split, &f64s);
        assert!(
            err <= rounded_bound(ty),
            "{ty}: {err:.2e} from the unsplit product"
        );
        // The first and last eight rows against the reference.
        let row_bytes = w.len() / rows;
        for first in [0, rows - 8] {
            let part = &w[first * row_bytes..(first + 8) * row_bytes];
            let want = reference_rounded(ty, part, 8, cols, &x, n, |v| f16::from_f32(v).to_f32());
            let got: Vec<f32> = (0..n)
                .flat_map(|t| split[t * rows + first..t * rows + first + 8].to_vec())
                .collect();
            let err = relative_error(&got, &want);
            assert!(
                err <= rounded_bound(ty),
                "{ty}: rows {first}.. relative error {err:.2e}"
            );
        }
    }
}
