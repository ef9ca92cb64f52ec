//! The kernels on random blocks: against the reference, and exactly against each
//! other where they must compute the same numbers.

use gguf_format::GgmlType;

use super::{check_against_reference, in_pool, paths, random_matrix, random_x, types, Rng};
use crate::matmul::activation::{BSUM_GROUP, GEMM_MIN_TOKENS, QK8, QK_K};
use crate::matmul::{portable, QuantizedMatrix};
use crate::DecodePath;

#[test]
fn every_type_matches_the_reference_on_random_blocks() {
    for (i, ty) in types().enumerate() {
        let block = ty.block_size() as usize;
        let unit = if block == 1 { 8 } else { block };
        // Odd and even block counts, one token and batches around the kernels' width of 4.
        for (rows, blocks, n_tokens) in [(5, 1, 1), (3, 3, 2), (7, 2, 4), (4, 5, 5), (6, 4, 9)] {
            check_against_reference(
                ty,
                rows,
                blocks * unit,
                n_tokens,
                1000 * i as u64 + rows as u64,
            );
        }
    }
}

#[test]
fn float_rows_with_tails_match_the_reference() {
    for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
        for cols in [1, 7, 9, 15, 17, 33] {
            check_against_reference(ty, 3, cols, 3, cols as u64);
        }
    }
}

#[test]
fn model_shaped_products_match_the_reference() {
    // SmolLM2 attention and the Gemma 3 feed-forward widths, large enough for many chunks.
    check_against_reference(GgmlType::Q4_1, 96, 576, 3, 1);
    check_against_reference(GgmlType::Q8_0, 1000, 256, 1, 2);
    check_against_reference(GgmlType::Q8_0, 1000, 256, 6, 3);
    check_against_reference(GgmlType::Q4_K, 64, 2048, 2, 4);
    check_against_reference(GgmlType::Q6_K, 40, 640 / 128 * 256, 5, 5);
}

/// Blocks whose values sit at the extremes of their ranges, and random ones.
fn block_cases(ty: GgmlType, rng: &mut Rng) -> Vec<Vec<u8>> {
    let size = ty.type_size() as usize;
    let mut cases = vec![
        vec![0xFF; size],
        vec![0x00; size],
        vec![0x80; size],
        vec![0x7F; size],
    ];
    for _ in 0..200 {
        let mut b = vec![0u8; size];
        rng.bytes(&mut b);
        cases.push(b);
    }
    cases
}

/// The one block of type `B` that `bytes` hold.
fn one<B: crate::blocks::Block>(bytes: &[u8]) -> B {
    crate::blocks::cast_blocks::<B>(bytes).unwrap()[0]
}

fn activation_cases(len: usize, rng: &mut Rng) -> Vec<Vec<i8>> {
    let mut cases = vec![vec![127; len], vec![-127; len], vec![0; len]];
    cases.push(
        (0..len)
            .map(|i| if i % 2 == 0 { 127 } else { -127 })
            .collect(),
    );
    for _ in 0..20 {
        cases.push(
            (0..len)
                .map(|_| (rng.next_u64() % 255) as i8 as i16 as i8)
                .map(|q| q.max(-127))
                .collect(),
        );
    }
    cases
}

/// The sums of `qx`'s groups of [`BSUM_GROUP`], as a `Q8_K` row keeps them.
fn bsums(qx: &[i8]) -> Vec<i16> {
    qx.chunks_exact(BSUM_GROUP)
        .map(|g| g.iter().map(|&q| i16::from(q)).sum())
        .collect()
}

#[test]
fn avx2_block_integers_equal_the_portable_ones_exactly() {
    #[cfg(target_arch = "x86_64")]
    {
        let Some(proof) = crate::matmul::avx2::Avx2::detect() else {
            eprintln!("skipped: this cpu has no avx2, fma and f16c");
            return;
        };
        let mut rng = Rng(42);
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::IQ4_NL,
            GgmlType::MXFP4,
        ] {
            for block in block_cases(ty, &mut rng) {
                for qx in activation_cases(QK8, &mut rng) {
                    let expected = match ty {
                        GgmlType::MXFP4 => portable::mxfp4_block(&one(&block), &qx),
                        GgmlType::IQ4_NL => portable::iq4_nl_block(&one(&block), &qx),
                        GgmlType::Q4_0 => portable::q4_0_block(&one(&block), &qx),
                        GgmlType::Q4_1 => portable::q4_1_block(&one(&block), &qx),
                        GgmlType::Q5_0 => portable::q5_0_block(&one(&block), &qx),
                        GgmlType::Q5_1 => portable::q5_1_block(&one(&block), &qx),
                        _ => portable::q8_0_block(&one(&block), &qx),
                    };
                    let got = crate::matmul::avx2::legacy::block_int(proof, ty, &block, &qx);
                    assert_eq!(got, expected, "{ty} block {block:?} activations {qx:?}");
                }
            }
        }
        for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
            for block in block_cases(ty, &mut rng) {
                for qx in activation_cases(QK_K, &mut rng) {
                    let bsums = bsums(&qx);
                    let expected = match ty {
                        GgmlType::Q4_K => portable::q4_k_block(&one(&block), &qx, &bsums),
                        GgmlType::Q5_K => portable::q5_k_block(&one(&block), &qx, &bsums),
                        _ => (portable::q6_k_block(&one(&block), &qx, &bsums), 0),
                    };
                    let got =
                        crate::matmul::avx2::kquants::block_ints(proof, ty, &block, &qx, &bsums);
                    assert_eq!(got, expected, "{ty} block {block:?} activations {qx:?}");
                }
            }
        }
        // The formats multiplied lane by lane: every lane, not only the total.
        for ty in LANE_TYPES {
            for block in block_cases(ty, &mut rng) {
                for qx in activation_cases(QK_K, &mut rng) {
                    let bsums = bsums(&qx);
                    let expected = portable_lanes(ty, &block, &qx, &bsums);
                    let got =
                        crate::matmul::avx2::lanes::block_lanes(proof, ty, &block, &qx, &bsums);
                    assert_eq!(got, expected, "{ty} block {block:?} activations {qx:?}");
                }
            }
        }
    }
}

/// The AVX-512 kernels compute the AVX2 kernels' integers: each super-block's sums for
/// the repacked `Q4_K` kernels (whose float operations see only those), each lane for
/// the plain `Q4_K`, `Q5_K` and `Q6_K` kernels (whose single-token products fuse them
/// lane by lane), on blocks and activations at the extremes of their ranges (where
/// `maddubs` would saturate first) and random ones.
#[test]
fn avx512_block_integers_equal_the_avx2_ones_exactly() {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::matmul::{avx2, avx512};
        let (Some(avx2_proof), Some(proof)) = (avx2::Avx2::detect(), avx512::Avx512::detect())
        else {
            eprintln!("SKIPPED: this cpu has no avx-512 f, bw, vl and vnni");
            return;
        };
        let mut rng = Rng(512);
        for ty in [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
            for block in block_cases(ty, &mut rng) {
                for qx in activation_cases(QK_K, &mut rng) {
                    let bsums = bsums(&qx);
                    let context = format!("{ty} block {block:?} activations {qx:?}");
                    if ty != GgmlType::Q6_K {
                        let five = ty == GgmlType::Q5_K;
                        let expected =
                            avx2::kquants::q45_k_block_lanes(avx2_proof, five, &block, &qx, &bsums);
                        let got =
                            avx512::kquants::q45_k_block_lanes(proof, five, &block, &qx, &bsums);
                        assert_eq!(got, expected, "{context}");
                    }
                    if ty == GgmlType::Q4_K {
                        let expected =
                            avx2::kquants::block_ints(avx2_proof, ty, &block, &qx, &bsums);
                        let got = avx512::kquants::q4_k_block_ints(proof, &block, &qx, &bsums);
                        assert_eq!(got, expected, "{context}");
                    } else if ty == GgmlType::Q6_K {
                        let expected =
                            avx2::kquants::q6_k_block_lanes(avx2_proof, &block, &qx, &bsums);
                        let got = avx512::kquants::q6_k_block_lanes(proof, &block, &qx, &bsums);
                        assert_eq!(got, expected, "{context}");
                    }
                }
            }
        }
    }
}

/// The AVX-512 kernel of the symmetric legacy formats' batches computes the AVX2
/// kernel's eight integer lanes of every block, on blocks and activations at the
/// extremes of their ranges and random ones (`Q8_0`'s -128, whose magnitude is 128;
/// `Q5_0`'s weights from -16 to 15, whose signs come from the high bits).
#[test]
fn avx512_legacy_lanes_equal_the_avx2_ones_exactly() {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::matmul::{avx2, avx512};
        let (Some(avx2_proof), Some(proof)) = (avx2::Avx2::detect(), avx512::Avx512::detect())
        else {
            eprintln!("SKIPPED: this cpu has no avx-512 f, bw, vl and vnni");
            return;
        };
        let mut rng = Rng(5120);
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q5_0,
            GgmlType::Q8_0,
            GgmlType::IQ4_NL,
        ] {
            for block in block_cases(ty, &mut rng) {
                for qx in activation_cases(QK8, &mut rng) {
                    let expected = avx2::legacy::block_lanes(avx2_proof, ty, &block, &qx);
                    let got = avx512::legacy::block_lanes(proof, ty, &block, &qx);
                    assert_eq!(got, expected, "{ty} block {block:?} activations {qx:?}");
                }
            }
        }
    }
}

/// The formats whose super-blocks llama.cpp multiplies lane by lane (`lane_dot`).
const LANE_TYPES: [GgmlType; 12] = [
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::IQ4_XS,
    GgmlType::IQ3_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
];

/// The grid format of `ty`, for the grid formats among [`LANE_TYPES`].
fn grid_of(ty: GgmlType) -> Option<crate::matmul::grids::Grid> {
    use crate::matmul::grids::Grid;
    match ty {
        GgmlType::IQ3_S => Some(Grid::IQ3S),
        GgmlType::IQ3_XXS => Some(Grid::IQ3XXS),
        GgmlType::IQ2_XXS => Some(Grid::IQ2XXS),
        GgmlType::IQ2_XS => Some(Grid::IQ2XS),
        GgmlType::IQ2_S => Some(Grid::IQ2S),
        GgmlType::IQ1_S => Some(Grid::IQ1S),
        GgmlType::IQ1_M => Some(Grid::IQ1M),
        _ => None,
    }
}

/// The portable integer lanes of one super-block of a [`LANE_TYPES`] format.
fn portable_lanes(ty: GgmlType, block: &[u8], qx: &[i8], bsums: &[i16]) -> portable::LaneInts {
    match ty {
        GgmlType::Q2_K => portable::q2_k_lanes(&one(block), qx, bsums),
        GgmlType::Q3_K => portable::q3_k_lanes(&one(block), qx),
        GgmlType::IQ4_XS => portable::iq4_xs_lanes(&one(block), qx),
        GgmlType::TQ1_0 => portable::tq1_0_lanes(&one(block), qx, bsums),
        GgmlType::TQ2_0 => portable::tq2_0_lanes(&one(block), qx, bsums),
        other => match grid_of(other) {
            Some(grid) => portable::grid_lanes(grid, block, qx),
            None => panic!("{other} is not a lane format"),
        },
    }
}

/// The integer lanes of a super-block are exact sums: the portable ones against a
/// plain sum over the block's decoded values (the scale times the value, read back
/// from the f32 decoder through the block's `d`).
#[test]
fn lane_integers_sum_to_the_plain_integer_product() {
    let mut rng = Rng(7);
    for ty in LANE_TYPES {
        for block in block_cases(ty, &mut rng).into_iter().take(60) {
            let mut block = block;
            // d = dmin = 1: the decoded values are the integers `scale · q − min`.
            // (The grid formats keep `d` first; their decoded values carry the format's
            // power of two, which the integers leave out.)
            use crate::blocks::{BlockIQ4_XS, BlockQ2_K, BlockQ3_K, BlockTQ1_0, BlockTQ2_0};
            use std::mem::offset_of;
            let scales: &[usize] = match ty {
                GgmlType::Q2_K => &[offset_of!(BlockQ2_K, d), offset_of!(BlockQ2_K, dmin)],
                GgmlType::Q3_K => &[offset_of!(BlockQ3_K, d)],
                GgmlType::IQ4_XS => &[offset_of!(BlockIQ4_XS, d)],
                GgmlType::TQ1_0 => &[offset_of!(BlockTQ1_0, d)],
                GgmlType::TQ2_0 => &[offset_of!(BlockTQ2_0, d)],
                GgmlType::IQ1_M => {
                    super::put_iq1_m_scale(&mut block, 1.0);
                    &[]
                }
                _ => &[0],
            };
            // The IQ1 formats' values are `g + δ/8`: in units of 1/8, `8 g + δ`.
            let shifted = matches!(ty, GgmlType::IQ1_S | GgmlType::IQ1_M);
            let factor = grid_of(ty).map_or(1.0, |grid| grid.factor());
            for &at in scales {
                block[at..at + 2].copy_from_slice(&half::f16::ONE.to_bits().to_le_bytes());
            }
            let w: Vec<f32> = super::dequantize_row(ty, &block)
                .iter()
                .map(|&w| w / factor)
                .collect();
            for qx in activation_cases(QK_K, &mut rng) {
                let bsums = bsums(&qx);
                let ints = portable_lanes(ty, &block, &qx, &bsums);
                let plain: i64 = w
                    .iter()
                    .zip(&qx)
                    .map(|(&w, &x)| w as i64 * i64::from(x))
                    .sum();
                let lane_total: Vec<i64> = (0..8)
                    .map(|l| {
                        let dots = i64::from(ints.dots[l]);
                        if shifted {
                            8 * dots + i64::from(ints.deltas[l])
                        } else {
                            dots
                        }
                    })
                    .collect();
                let lanes: i64 = lane_total.iter().sum::<i64>()
                    - ints.mins.iter().map(|&l| i64::from(l)).sum::<i64>();
                assert_eq!(lanes, plain, "{ty} block {block:?}");
                // Lane l holds values 4l .. 4l + 4 of every 32.
                for (l, &lane) in lane_total.iter().enumerate() {
                    let part: i64 = (0..QK_K)
                        .filter(|i| i % 32 / 4 == l)
                        .map(|i| w[i] as i64 * i64::from(qx[i]))
                        .sum();
                    if ints.mins == [0; 8] {
                        assert_eq!(lane, part, "{ty} lane {l}");
                    }
                }
            }
        }
    }
}

/// Tokens get the same bits whichever batch they come in, as long as llama.cpp would
/// multiply them with the same kernel (and so do ours): below [`GEMM_MIN_TOKENS`] a
/// batch gives each token the bits of a single-token product, except that `Q4_K`
/// tokens in a whole group of four, against a matrix llama.cpp repacks, get the bits of
/// a batch of four (its repacked GEMM), and `IQ4_NL` tokens against a matrix it does
/// not repack those of any batch (its GEMM, from two tokens on), as do float tokens
/// against a matrix of a multiple of 4 rows (llamafile's GEMM), and `MXFP4` tokens
/// always the single-token bits (it has no GEMM); from
/// [`GEMM_MIN_TOKENS`] on (where llama.cpp switches the other k-quants to its tiled GEMM)
/// a batch gives the bits of each of its halves, and for the ternary formats (which
/// llama.cpp only multiplies with its dot product) those of its tokens one at a time.
#[test]
fn a_batch_equals_its_tokens_multiplied_in_batches_of_its_kind_exactly() {
    for (i, ty) in types().enumerate() {
        // 16 rows: a matrix llama.cpp repacks (Q4_0, Q4_K); 9: one it does not.
        for rows in [9, 16] {
            let (cols, n_tokens) = (2 * QK_K, 2 * GEMM_MIN_TOKENS);
            let bytes = random_matrix(ty, rows, cols, 77 + i as u64);
            let x = random_x(n_tokens * cols, 5 + i as u64);
            let matrix = QuantizedMatrix::new(ty, rows, cols, &bytes).unwrap();
            let grouped = ty == GgmlType::Q4_K && rows % 8 == 0;
            let float = matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16);
            let batched = (ty == GgmlType::IQ4_NL && rows % 8 != 0) || (float && rows % 4 == 0);
            for path in paths() {
                let small = GEMM_MIN_TOKENS - 1;
                let mut batch = vec![0.0; small * rows];
                matrix
                    .matmul_with(path, &x[..small * cols], small, &mut batch)
                    .unwrap();
                let mut four = vec![0.0; 4 * rows];
                matrix
                    .matmul_with(path, &x[..4 * cols], 4, &mut four)
                    .unwrap();
                for t in 0..small {
                    let mut single = vec![0.0; rows];
                    matrix
                        .matvec_with(path, &x[t * cols..(t + 1) * cols], &mut single)
                        .unwrap();
                    // Token t twice: a batch of two.
                    let twice = [&x[t * cols..(t + 1) * cols], &x[t * cols..(t + 1) * cols]];
                    let mut pair = vec![0.0; 2 * rows];
                    matrix
                        .matmul_with(path, &twice.concat(), 2, &mut pair)
                        .unwrap();
                    let expected = if grouped && t < 4 {
                        &four[t * rows..(t + 1) * rows]
                    } else if batched {
                        &pair[..rows]
                    } else {
                        &single[..]
                    };
                    assert_eq!(
                        to_bits(&batch[t * rows..(t + 1) * rows]),
                        to_bits(expected),
                        "{ty} ({rows} rows) token {t} of {small} on {path:?}"
                    );
                }
                let mut batch = vec![0.0; n_tokens * rows];
                matrix.matmul_with(path, &x, n_tokens, &mut batch).unwrap();
                if matches!(ty, GgmlType::TQ1_0 | GgmlType::TQ2_0) {
                    for t in 0..n_tokens {
                        let mut single = vec![0.0; rows];
                        matrix
                            .matvec_with(path, &x[t * cols..(t + 1) * cols], &mut single)
                            .unwrap();
                        assert_eq!(
                            to_bits(&batch[t * rows..(t + 1) * rows]),
                            to_bits(&single),
                            "{ty} ({rows} rows) token {t} of {n_tokens} on {path:?}"
                        );
                    }
                }
                let half = n_tokens / 2;
                for h in 0..2 {
                    let mut part = vec![0.0; half * rows];
                    let xs = &x[h * half * cols..(h + 1) * half * cols];
                    matrix.matmul_with(path, xs, half, &mut part).unwrap();
                    assert_eq!(
                        to_bits(&batch[h * half * rows..(h + 1) * half * rows]),
                        to_bits(&part),
                        "{ty} ({rows} rows) half {h} of {n_tokens} on {path:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn every_split_gives_the_serial_results_exactly() {
    use crate::matmul::driver::{split_for, Split};
    // (rows, cols, tokens) covering each split, with chunks ending inside a group of 4.
    let cases = [
        (1002, 256, 1),
        (1002, 256, 3),
        (130, 512, 37),
        (64, 256, 64),
        (7, 256, 1),
        (515, 1024, 2),
    ];
    let mut seen = Vec::new();
    for ty in [
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q6_K,
        GgmlType::F16,
    ] {
        for (rows, cols, n_tokens) in cases {
            let bytes = random_matrix(ty, rows, cols, rows as u64);
            let x = random_x(n_tokens * cols, 3);
            let m = QuantizedMatrix::new(ty, rows, cols, &bytes).unwrap();
            for path in paths() {
                let run = || {
                    let mut y = vec![0.0f32; n_tokens * rows];
                    m.matmul_with(path, &x, n_tokens, &mut y).unwrap();
                    (
                        split_for(&m, n_tokens),
                        y.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    )
                };
                let (serial_split, serial) = in_pool(1, run);
                assert_eq!(serial_split, Split::Serial);
                let (split, parallel) = in_pool(2, run);
                let context = format!(
                    "{ty} {rows}x{cols} x {n_tokens} tokens split as {split:?} on {path:?}"
                );
                assert_eq!(parallel, serial, "{context}");
                seen.push(split);
            }
        }
    }
    for kind in [Split::Serial, Split::Rows(0), Split::Tokens(0)] {
        let same = |s: &Split| std::mem::discriminant(s) == std::mem::discriminant(&kind);
        assert!(seen.iter().any(same), "no {kind:?} among {seen:?}");
    }
}

/// The portable kernels repeat the AVX2 kernels' float operations one for one, and the
/// AVX-512 kernels compute the AVX2 kernels' integers before the same float
/// operations, so whole products agree bit for bit on every quantized format and path:
/// for single tokens, batches of every size up to past [`GEMM_MIN_TOKENS`] (groups of
/// four and remainders, llama.cpp's GEMV, GEMM and tiled GEMM), on matrices it repacks
/// and matrices it does not. (The float formats sum in orders of their own.)
#[test]
fn every_path_gives_the_portable_products_bit_for_bit() {
    let Some(fast) = fast_paths() else {
        eprintln!("SKIPPED: this cpu has no avx2, fma and f16c");
        return;
    };
    for (i, ty) in types().enumerate() {
        if !ty.is_quantized() {
            continue;
        }
        // 8 and 16 rows: llama.cpp repacks Q4_0, Q4_K and IQ4_NL matrices of a multiple
        // of 8 rows; 1 and 13: fewer than, and not a multiple of, the single-token
        // kernels' 4 rows. For blocks of 32, an odd number of blocks too (IQ4_NL's dot
        // product takes them in pairs).
        let widths: &[usize] = match ty.block_size() {
            32 => &[2 * QK_K, 2 * QK_K + 32],
            _ => &[2 * QK_K, 3 * QK_K],
        };
        let shapes = [1, 8, 13, 16]
            .into_iter()
            .flat_map(|rows| widths.iter().map(move |&cols| (rows, cols)));
        for (rows, cols) in shapes {
            let bytes = random_matrix(ty, rows, cols, 500 + i as u64);
            let matrix = QuantizedMatrix::new(ty, rows, cols, &bytes).unwrap();
            // Up to past GEMM_MIN_TOKENS, and a batch of two groups of eight (the AVX2
            // path's tiles of `Q4_K`) and four.
            for n_tokens in (1..=GEMM_MIN_TOKENS + 1).chain([2 * GEMM_MIN_TOKENS + 4]) {
                let x = random_x(n_tokens * cols, 50 + i as u64);
                let mut portable = vec![0.0; n_tokens * rows];
                matrix
                    .matmul_with(DecodePath::Scalar, &x, n_tokens, &mut portable)
                    .unwrap();
                for &path in &fast {
                    let mut y = vec![0.0; n_tokens * rows];
                    matrix.matmul_with(path, &x, n_tokens, &mut y).unwrap();
                    let context = format!("{ty}, {rows}x{cols}, {n_tokens} tokens on {path:?}");
                    assert_eq!(to_bits(&portable), to_bits(&y), "{context}");
                }
            }
        }
    }
}

/// The tiles on a whole group of eight tokens (`Q4_K` matrices llama.cpp repacks and
/// `Q6_K`) sum a row's products in 16-bit lanes before widening them: at the largest
/// values every format allows (every quant and scale at its maximum, activations all
/// at ±127, or alternating) they still give the portable products bit for bit.
#[test]
fn the_grouped_tiles_hold_at_the_integers_extremes() {
    use crate::blocks::{BlockQ4_K, BlockQ6_K};
    use std::mem::{offset_of, size_of};
    let Some(fast) = fast_paths() else {
        eprintln!("SKIPPED: this cpu has no avx2, fma and f16c");
        return;
    };
    let (rows, cols) = (8, 2 * QK_K);
    // (type, block bytes, the bytes set to 0xFF): Q4_K's scales, mins and quants (all
    // at 63 and 15); Q6_K's ql and qh (q = 31), its scales as drawn but the first two
    // set to 127 and -128.
    let extremes = [
        (
            GgmlType::Q4_K,
            size_of::<BlockQ4_K>(),
            offset_of!(BlockQ4_K, scales)..size_of::<BlockQ4_K>(),
        ),
        (
            GgmlType::Q6_K,
            size_of::<BlockQ6_K>(),
            0..offset_of!(BlockQ6_K, scales),
        ),
    ];
    for (ty, block, range) in extremes {
        let mut bytes = random_matrix(ty, rows, cols, 77);
        for b in bytes.chunks_exact_mut(block) {
            b[range.clone()].fill(0xFF);
            if ty == GgmlType::Q6_K {
                b[offset_of!(BlockQ6_K, scales)] = 127;
                b[offset_of!(BlockQ6_K, scales) + 1] = 0x80;
            }
        }
        let matrix = QuantizedMatrix::new(ty, rows, cols, &bytes).unwrap();
        for n_tokens in [8, 16] {
            let patterns: [fn(usize) -> f32; 3] =
                [|_| 3.0, |_| -3.0, |i| if i % 2 == 0 { 3.0 } else { -3.0 }];
            for pattern in patterns {
                let x: Vec<f32> = (0..n_tokens * cols).map(pattern).collect();
                let mut portable = vec![0.0; n_tokens * rows];
                matrix
                    .matmul_with(DecodePath::Scalar, &x, n_tokens, &mut portable)
                    .unwrap();
                for &path in &fast {
                    let mut y = vec![0.0; n_tokens * rows];
                    matrix.matmul_with(path, &x, n_tokens, &mut y).unwrap();
                    assert_eq!(
                        to_bits(&portable),
                        to_bits(&y),
                        "{ty}, {n_tokens} tokens on {path:?}"
                    );
                    assert!(y.iter().all(|v| v.is_finite()), "{ty} on {path:?}: {y:?}");
                }
            }
        }
    }
}

/// The paths other than the portable one, if this CPU has any.
fn fast_paths() -> Option<Vec<DecodePath>> {
    let fast: Vec<DecodePath> = paths()
        .into_iter()
        .filter(|&p| p != DecodePath::Scalar)
        .collect();
    (!fast.is_empty()).then_some(fast)
}

/// The values' bits, to compare products exactly (NaNs included).
fn to_bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}
