//! Every path against the reference decoders on seeded random blocks, and the length
//! errors of every type.

use gguf_format::GgmlType;
use half::f16;

use super::TASK_VALUES;
use crate::splitmix::Rng;
use crate::{decoded_len, DecodePath, Decoder, DequantError};

/// Random bytes for enough blocks of `ty` that the parallel driver splits them into
/// several tasks, with a partial last task. Every bit pattern is a valid block: f16
/// fields may be infinities or NaNs, which the comparison allows for.
fn random_blocks(ty: GgmlType, rng: &mut Rng) -> Vec<u8> {
    let values_per_block = ty.block_size() as usize;
    let per_task = (TASK_VALUES / values_per_block).max(1);
    let blocks = 2 * per_task + 3;
    let mut bytes = vec![0u8; blocks * ty.type_size() as usize];
    rng.fill(&mut bytes);
    bytes
}

/// Equal bits, or both NaN (a NaN's payload may depend on operand order).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fn decoders() -> Vec<(&'static str, Decoder)> {
    let mut all = vec![
        ("scalar parallel", Decoder::scalar()),
        ("scalar serial", Decoder::scalar().parallel(false)),
    ];
    if let Ok(avx2) = Decoder::with_path(DecodePath::Avx2) {
        all.push(("avx2 parallel", avx2));
        all.push(("avx2 serial", avx2.parallel(false)));
    }
    all
}

#[test]
fn every_path_matches_the_reference_on_random_blocks() {
    let mut rng = Rng(0x5EED_DEC0_DE00_0001);
    let reference = Decoder::scalar().parallel(false);
    for ty in GgmlType::ALL {
        let bytes = random_blocks(ty, &mut rng);
        let n = decoded_len(ty, bytes.len()).expect("whole blocks");
        let mut want = vec![0f32; n];
        reference
            .decode_f32(ty, &bytes, &mut want)
            .expect("reference decodes");
        // Guards against a generator that makes everything NaN, which compares equal.
        let finite = want.iter().filter(|w| w.is_finite()).count();
        assert!(finite > n / 2, "{ty}: too few finite values to compare");
        for (name, decoder) in decoders() {
            let mut got = vec![f32::NAN; n];
            decoder.decode_f32(ty, &bytes, &mut got).expect("decodes");
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(same(*g, *w), "{ty} {name}: value {i} is {g:e}, want {w:e}");
            }
        }
    }
}

#[test]
fn f16_output_is_the_rounded_f32_output() {
    let mut rng = Rng(0x5EED_DEC0_DE00_0002);
    for ty in GgmlType::ALL {
        let bytes = random_blocks(ty, &mut rng);
        let n = decoded_len(ty, bytes.len()).expect("whole blocks");
        let mut wide = vec![0f32; n];
        Decoder::scalar()
            .decode_f32(ty, &bytes, &mut wide)
            .expect("decodes");
        for (name, decoder) in decoders() {
            let mut got = vec![f16::ZERO; n];
            decoder.decode_f16(ty, &bytes, &mut got).expect("decodes");
            for (i, (g, w)) in got.iter().zip(&wide).enumerate() {
                let w = f16::from_f32(*w);
                let ok = g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan());
                assert!(ok, "{ty} {name}: value {i} is {g}, want {w}");
            }
        }
    }
}

#[test]
fn f16_input_is_copied_to_f16_output_unchanged() {
    let mut rng = Rng(0x5EED_DEC0_DE00_0003);
    let mut bytes = vec![0u8; 2 * 1000];
    rng.fill(&mut bytes);
    let mut out = vec![f16::ZERO; 1000];
    crate::decode_f16(GgmlType::F16, &bytes, &mut out).expect("decodes");
    for (i, v) in out.iter().enumerate() {
        assert_eq!(v.to_le_bytes(), [bytes[2 * i], bytes[2 * i + 1]]);
    }
}

/// Every decoder refuses to decode `bytes` of `ty` into `out` and into `out16` with
/// `expected`.
fn every_decoder_refuses(
    ty: GgmlType,
    bytes: &[u8],
    out: &mut [f32],
    out16: &mut [f16],
    expected: &DequantError,
) {
    for (name, decoder) in decoders() {
        let got = decoder.decode_f32(ty, bytes, out);
        assert_eq!(got, Err(expected.clone()), "{ty} {name}");
        let got = decoder.decode_f16(ty, bytes, out16);
        assert_eq!(got, Err(expected.clone()), "{ty} {name} f16");
    }
}

#[test]
fn partial_blocks_are_refused_for_every_type() {
    for ty in GgmlType::ALL {
        let block_bytes = ty.type_size() as usize;
        for extra in [1, block_bytes - 1]
            .into_iter()
            .filter(|&e| e % block_bytes != 0)
        {
            let bytes = vec![0u8; 3 * block_bytes + extra];
            let mut out = vec![0f32; 4 * ty.block_size() as usize];
            let mut out16 = vec![f16::ZERO; out.len()];
            let expected = DequantError::PartialBlock {
                ty,
                bytes: bytes.len(),
                block_bytes,
            };
            every_decoder_refuses(ty, &bytes, &mut out, &mut out16, &expected);
            assert_eq!(decoded_len(ty, bytes.len()), Err(expected));
        }
    }
}

#[test]
fn wrong_output_lengths_are_refused_for_every_type() {
    for ty in GgmlType::ALL {
        let bytes = vec![0u8; 3 * ty.type_size() as usize];
        let expected = 3 * ty.block_size() as usize;
        for actual in [0, expected - 1, expected + 1] {
            let mut out = vec![0f32; actual];
            let mut out16 = vec![f16::ZERO; actual];
            let error = DequantError::OutputLength {
                ty,
                blocks: 3,
                expected,
                actual,
            };
            every_decoder_refuses(ty, &bytes, &mut out, &mut out16, &error);
        }
    }
}

#[test]
fn empty_input_decodes_to_nothing() {
    for ty in GgmlType::ALL {
        assert_eq!(crate::decode_f32(ty, &[], &mut []), Ok(()), "{ty}");
        assert_eq!(crate::decode_f16(ty, &[], &mut []), Ok(()), "{ty}");
    }
}

#[test]
fn unaligned_input_decodes_like_aligned_input() {
    let mut rng = Rng(0x5EED_DEC0_DE00_0004);
    for ty in GgmlType::ALL {
        let len = 9 * ty.type_size() as usize;
        let mut blocks = vec![0u8; len];
        rng.fill(&mut blocks);
        let n = 9 * ty.block_size() as usize;
        let mut want = vec![0f32; n];
        crate::decode_f32(ty, &blocks, &mut want).expect("decodes");
        for shift in 1..4 {
            let mut buffer = vec![0u8; len + shift];
            buffer[shift..].copy_from_slice(&blocks);
            for (name, decoder) in decoders() {
                let mut got = vec![0f32; n];
                decoder
                    .decode_f32(ty, &buffer[shift..], &mut got)
                    .expect("decodes");
                let ok = got.iter().zip(&want).all(|(g, w)| same(*g, *w));
                assert!(ok, "{ty} {name} at offset {shift}");
            }
        }
    }
}

#[test]
fn the_avx2_path_is_offered_exactly_when_the_cpu_has_it() {
    let available = DecodePath::Avx2.is_available();
    match Decoder::with_path(DecodePath::Avx2) {
        Ok(decoder) => {
            assert!(available);
            assert_eq!(decoder.path(), DecodePath::Avx2);
        }
        Err(e) => {
            assert!(!available);
            assert_eq!(
                e,
                DequantError::PathUnavailable {
                    path: DecodePath::Avx2
                }
            );
        }
    }
    assert_eq!(Decoder::new().path(), DecodePath::detect());
}
