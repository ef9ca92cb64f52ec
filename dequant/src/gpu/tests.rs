//! The GPU decoders against the CPU reference decoders, bit for bit: on every type of the
//! test vectors in `testdata/vectors` (whose gguf-py values they must also match) and on random blocks
//! of every type, at aligned and unaligned addresses, and past one grid of tiles.
//!
//! Tests that need a device print `SKIPPED <test>: <reason>` on stderr and pass when the
//! build has no GPU platform or the machine has no device. The vectors file is compiled
//! into the test binary, so prebuilt binaries carried to a GPU machine need no data beside
//! them.

use gguf_format::GgmlType;
use half::f16;
use hip_backend::{Device, HipError, Platform, Stream, PLATFORM};

use super::*;
use crate::blocks::BlockQ4_K;
use crate::{Decoder, DequantError};

/// Values per tile of the block kernels (`kTileValues` in kernels/common.h).
const TILE_VALUES: usize = 2048;
/// Workgroups per launch at most (`kMaxGrid` in kernels/common.h).
const MAX_GRID: usize = 8192;

/// Device 0 and a stream on it, or `None` after saying plainly on stderr that `test`
/// was skipped and why.
pub(super) fn gpu_or_skip(test: &str) -> Option<(Device, Stream)> {
    let device = hip_backend::device_or_skip(test)?;
    let stream = device.new_stream().expect("stream on device 0");
    Some((device, stream))
}

/// Deterministic pseudo-random bytes (xorshift64).
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 24) as u8
        })
        .collect()
}

fn block_geometry(ty: GgmlType) -> (usize, usize) {
    (ty.type_size() as usize, ty.block_size() as usize)
}

/// Where `bytes` may start so that views of `ty` can be cast: plain types need their
/// element alignment, block formats none.
fn element_align(ty: GgmlType) -> usize {
    if ty.is_quantized() {
        1
    } else {
        ty.type_size() as usize
    }
}

/// Decodes `bytes` of `ty` on the GPU to f32 and to f16. The source is placed
/// `src_shift` bytes and the outputs `dst_shift` elements past the start of their
/// allocations, so shifts that are not multiples of 16 bytes exercise the unaligned paths.
fn gpu_decode(
    gpu: &(Device, Stream),
    ty: GgmlType,
    bytes: &[u8],
    src_shift: usize,
    dst_shift: usize,
) -> (Vec<f32>, Vec<f16>) {
    let (device, stream) = gpu;
    let n_values = crate::decoded_len(ty, bytes.len()).expect("whole blocks");
    let mut src = device
        .alloc::<u8>(src_shift + bytes.len())
        .expect("alloc src");
    let mut out32 = device
        .alloc::<f32>(dst_shift + n_values)
        .expect("alloc f32");
    let mut out16 = device
        .alloc::<f16>(dst_shift + n_values)
        .expect("alloc f16");
    let src_range = src_shift..src_shift + bytes.len();
    if !bytes.is_empty() {
        let view = src.slice_mut(src_range.clone()).expect("src range");
        stream.write_from_host(bytes, view).expect("upload");
    }
    let src_view = src.slice(src_range).expect("src range");
    let dst32 = out32
        .slice_mut(dst_shift..dst_shift + n_values)
        .expect("f32 range");
    decode_f32(ty, src_view, dst32, stream).unwrap_or_else(|e| panic!("{ty} to f32: {e}"));
    let dst16 = out16
        .slice_mut(dst_shift..dst_shift + n_values)
        .expect("f16 range");
    decode_f16(ty, src_view, dst16, stream).unwrap_or_else(|e| panic!("{ty} to f16: {e}"));
    stream.synchronize().expect("decode finished");
    let mut host32 = vec![0f32; n_values];
    let mut host16 = vec![f16::ZERO; n_values];
    if n_values > 0 {
        let view = out32
            .slice(dst_shift..dst_shift + n_values)
            .expect("f32 range");
        stream.read_to_host(view, &mut host32).expect("read f32");
        let view = out16
            .slice(dst_shift..dst_shift + n_values)
            .expect("f16 range");
        stream.read_to_host(view, &mut host16).expect("read f16");
    }
    (host32, host16)
}

/// The CPU reference decoders' f32 and f16 values.
fn cpu_decode(ty: GgmlType, bytes: &[u8]) -> (Vec<f32>, Vec<f16>) {
    let n_values = crate::decoded_len(ty, bytes.len()).expect("whole blocks");
    let reference = Decoder::scalar();
    let mut out32 = vec![0f32; n_values];
    let mut out16 = vec![f16::ZERO; n_values];
    reference
        .decode_f32(ty, bytes, &mut out32)
        .expect("cpu f32");
    reference
        .decode_f16(ty, bytes, &mut out16)
        .expect("cpu f16");
    (out32, out16)
}

/// Asserts equal bits everywhere, except that a NaN only has to meet a NaN (payloads are
/// not specified across platforms). Names the first differing value and its block.
fn assert_same(what: &str, ty: GgmlType, gpu: &[(u32, bool)], cpu: &[(u32, bool)]) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: {ty}: lengths");
    let block_values = ty.block_size() as usize;
    let differs = |(g, c): (&(u32, bool), &(u32, bool))| !(g.0 == c.0 || (g.1 && c.1));
    if let Some(i) = gpu.iter().zip(cpu).position(differs) {
        panic!(
            "{what}: {ty} value {i} (block {}, index {}): gpu bits {:#x}, cpu bits {:#x}",
            i / block_values,
            i % block_values,
            gpu[i].0,
            cpu[i].0
        );
    }
}

fn f32_bits(values: &[f32]) -> Vec<(u32, bool)> {
    values.iter().map(|v| (v.to_bits(), v.is_nan())).collect()
}

fn f16_bits(values: &[f16]) -> Vec<(u32, bool)> {
    values
        .iter()
        .map(|v| (v.to_bits() as u32, v.is_nan()))
        .collect()
}

/// Decodes `bytes` on both sides and asserts the results agree, f32 and f16.
fn check_against_cpu(
    what: &str,
    gpu: &(Device, Stream),
    ty: GgmlType,
    bytes: &[u8],
    shifts: (usize, usize),
) {
    let (gpu32, gpu16) = gpu_decode(gpu, ty, bytes, shifts.0, shifts.1);
    let (cpu32, cpu16) = cpu_decode(ty, bytes);
    assert_same(
        &format!("{what}, f32"),
        ty,
        &f32_bits(&gpu32),
        &f32_bits(&cpu32),
    );
    assert_same(
        &format!("{what}, f16"),
        ty,
        &f16_bits(&gpu16),
        &f16_bits(&cpu16),
    );
}

/// The repository's `testdata/vectors/dequant_vectors.gguf`.
const VECTOR_FILE: &[u8] = include_bytes!("../../../testdata/vectors/dequant_vectors.gguf");

#[test]
fn output_lengths_are_checked_without_overflow() {
    assert_eq!(check_lengths(GgmlType::Q4_K, 256, 3, 768), Ok(768));
    assert_eq!(
        check_lengths(GgmlType::Q4_K, 256, 3, 767),
        Err(DequantError::OutputLength {
            ty: GgmlType::Q4_K,
            blocks: 3,
            expected: 768,
            actual: 767
        })
    );
    assert!(matches!(
        check_lengths(GgmlType::Q8_0, 32, usize::MAX / 16, 0),
        Err(DequantError::OutputLength {
            expected: usize::MAX,
            ..
        })
    ));
    let text = check_lengths(GgmlType::Q4_K, 256, 3, 767)
        .unwrap_err()
        .to_string();
    assert!(text.contains("768") && text.contains("767"), "{text}");
}

#[test]
fn without_a_gpu_the_error_says_so() {
    let unavailable = GpuDequantError::from(HipError::BuiltWithoutGpu);
    assert!(unavailable.is_unavailable());
    let layout = GpuDequantError::from(DequantError::PartialBlock {
        ty: GgmlType::Q4_0,
        bytes: 19,
        block_bytes: 18,
    });
    assert!(!layout.is_unavailable());
    match (PLATFORM, Device::open(0)) {
        (Platform::None, Err(HipError::BuiltWithoutGpu)) => {}
        (Platform::None, other) => panic!("platform none opened a device: {other:?}"),
        (_, Err(error)) => assert!(error.is_unavailable(), "{error}"),
        (_, Ok(_)) => {}
    }
}

#[test]
fn every_vectors_type_decodes_as_the_cpu_and_gguf_py_do() {
    let Some(gpu) = gpu_or_skip("every_vectors_type_decodes_as_the_cpu_and_gguf_py_do") else {
        return;
    };
    let file = VECTOR_FILE.to_vec();
    let gguf = gguf_format::parse(&file).expect("vectors parse");
    let data = |name: &str| {
        let tensor = gguf
            .tensor(name)
            .unwrap_or_else(|| panic!("no tensor {name}"));
        let range = gguf.tensor_range(tensor);
        (
            tensor.ggml_type,
            &file[range.start as usize..range.end as usize],
        )
    };
    let mut types = Vec::new();
    for tensor in gguf.tensors.iter().filter(|t| t.name.ends_with(".q")) {
        let (ty, bytes) = data(&tensor.name);
        let (expected_ty, expected) = data(&tensor.name.replace(".q", ".f32"));
        assert_eq!(expected_ty, GgmlType::F32);
        let expected: Vec<f32> = expected
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let (gpu32, _) = gpu_decode(&gpu, ty, bytes, 0, 0);
        assert_same(
            "gguf-py values",
            ty,
            &f32_bits(&gpu32),
            &f32_bits(&expected),
        );
        check_against_cpu("vectors", &gpu, ty, bytes, (0, 0));
        types.push(ty);
    }
    assert_eq!(types.len(), 24, "types in the vectors file: {types:?}");
}

#[test]
fn random_blocks_of_every_type_decode_as_the_cpu_does() {
    let Some(gpu) = gpu_or_skip("random_blocks_of_every_type_decode_as_the_cpu_does") else {
        return;
    };
    for (t, &ty) in GgmlType::ALL.iter().enumerate() {
        let (block_bytes, block_values) = block_geometry(ty);
        let per_tile = TILE_VALUES / block_values;
        // One block, a partial tile, just over one tile, several tiles and a partial one.
        for (c, n_blocks) in [1, per_tile - 1, per_tile + 1, 5 * per_tile + 3]
            .into_iter()
            .enumerate()
        {
            let bytes = random_bytes(n_blocks * block_bytes, (t * 16 + c) as u64 + 1);
            let what = format!("{n_blocks} random blocks");
            check_against_cpu(&what, &gpu, ty, &bytes, (0, 0));
        }
    }
}

#[test]
fn unaligned_sources_and_destinations_decode_the_same_values() {
    let Some(gpu) = gpu_or_skip("unaligned_sources_and_destinations_decode_the_same_values") else {
        return;
    };
    for (t, &ty) in GgmlType::ALL.iter().enumerate() {
        let (block_bytes, block_values) = block_geometry(ty);
        let n_blocks = 3 * TILE_VALUES / block_values + 1;
        let bytes = random_bytes(n_blocks * block_bytes, 1000 + t as u64);
        // The smallest shift each side allows, then a shift of 16 bytes minus that.
        let align = element_align(ty);
        for shifts in [(align, 1), (16 - align, 3), (0, 1), (align, 0)] {
            let what = format!("source +{} bytes, outputs +{} values", shifts.0, shifts.1);
            check_against_cpu(&what, &gpu, ty, &bytes, shifts);
        }
    }
}

#[test]
fn inputs_longer_than_one_grid_loop_over_their_tiles() {
    let Some(gpu) = gpu_or_skip("inputs_longer_than_one_grid_loop_over_their_tiles") else {
        return;
    };
    for (ty, seed) in [(GgmlType::Q4_K, 7), (GgmlType::Q8_0, 8), (GgmlType::F16, 9)] {
        let (block_bytes, block_values) = block_geometry(ty);
        let n_blocks = (MAX_GRID + 100) * TILE_VALUES / block_values + 1;
        let bytes = random_bytes(n_blocks * block_bytes, seed);
        check_against_cpu("more tiles than workgroups", &gpu, ty, &bytes, (0, 0));
    }
}

#[test]
fn bad_arguments_are_refused_before_any_launch() {
    let Some((device, stream)) = gpu_or_skip("bad_arguments_are_refused_before_any_launch") else {
        return;
    };
    let src = device.alloc::<u8>(4 * 144 + 1).expect("alloc");
    let mut dst = device.alloc::<f32>(4 * 256 + 1).expect("alloc");

    // Bytes that are not whole blocks.
    let partial = src.slice(0..3 * 144 + 1).expect("range");
    let error = decode_f32(GgmlType::Q4_K, partial, dst.view_mut(), &stream).unwrap_err();
    assert!(
        matches!(
            error,
            GpuDequantError::Layout(DequantError::PartialBlock {
                ty: GgmlType::Q4_K,
                bytes: 433,
                block_bytes: 144
            })
        ),
        "{error}"
    );

    // An output one value short, through the typed wrapper.
    let blocks = src
        .slice(0..4 * 144)
        .expect("range")
        .cast::<BlockQ4_K>()
        .expect("cast");
    assert_eq!(blocks.len(), 4);
    let short = dst.slice_mut(0..4 * 256 - 1).expect("range");
    let error = q4_k_to_f32(blocks, short, &stream).unwrap_err();
    assert!(
        matches!(
            error,
            GpuDequantError::Layout(DequantError::OutputLength {
                blocks: 4,
                expected: 1024,
                actual: 1023,
                ..
            })
        ),
        "{error}"
    );

    // F32 data at an odd address cannot be viewed as f32.
    let odd = src.slice(1..1 + 4 * 16).expect("range");
    let out = dst.slice_mut(0..16).expect("range");
    let error = decode_f32(GgmlType::F32, odd, out, &stream).unwrap_err();
    assert!(
        matches!(error, GpuDequantError::Hip(HipError::BadCast { .. })),
        "{error}"
    );

    // Nothing to do is not an error.
    let empty = src.slice(0..0).expect("range");
    let out = dst.slice_mut(0..0).expect("range");
    decode_f32(GgmlType::IQ2_XS, empty, out, &stream).expect("empty input");
    stream.synchronize().expect("nothing failed");
}
