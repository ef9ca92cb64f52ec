//! Tensor infos and the layout of the data section.

use gguf_format::limits::{MAX_DIMS, MAX_TENSOR_NAME_LEN};
use gguf_format::{parse, GgmlType, GgufError};

use crate::builder::{assert_parse_err, with_tensors, Bytes, F32, Q4_0};

#[test]
fn tensor_name_longer_than_ggml_allows() {
    let long = "x".repeat(MAX_TENSOR_NAME_LEN as usize + 1);
    let b = with_tensors(&[(&long, &[8], F32, 0)], 32);
    assert_parse_err!(
        &b,
        GgufError::TensorNameTooLong {
            len: 64,
            max: MAX_TENSOR_NAME_LEN,
            offset: 24
        }
    );
    let longest = "x".repeat(MAX_TENSOR_NAME_LEN as usize);
    let file = parse(&with_tensors(&[(&longest, &[8], F32, 0)], 32).0).unwrap();
    assert_eq!(file.tensors[0].name, longest);
}

#[test]
fn tensor_name_length_near_u64_max() {
    let b = Bytes::v3(1, 0).u64(u64::MAX).zeros(32);
    assert_parse_err!(&b, GgufError::TensorNameTooLong { len: u64::MAX, .. });
}

#[test]
fn invalid_utf8_in_a_tensor_name() {
    let b = Bytes::v3(1, 0)
        .string(b"blk.\xf8.weight")
        .u32(1)
        .u64(8)
        .u32(F32)
        .u64(0)
        .pad_to(32)
        .zeros(32);
    assert_parse_err!(&b, GgufError::InvalidUtf8 { offset: 24 });
}

#[test]
fn more_dimensions_than_ggml_supports() {
    let b = with_tensors(&[("t", &[1, 1, 1, 1, 1], F32, 0)], 32);
    assert_parse_err!(&b, GgufError::TooManyDims { ref tensor, n_dims: 5, max: MAX_DIMS } if tensor == "t");
    let b = Bytes::v3(1, 0).string(b"t").u32(u32::MAX).zeros(64);
    assert_parse_err!(
        &b,
        GgufError::TooManyDims {
            n_dims: u32::MAX,
            ..
        }
    );
}

#[test]
fn dimensions_cut_short() {
    // Two dimensions declared; the file ends 5 bytes into the second, at 24 + 9 + 4 + 8.
    let b = Bytes::v3(1, 0).string(b"t").u32(2).u64(8).zeros(5);
    assert_parse_err!(
        &b,
        GgufError::UnexpectedEof {
            offset: 45,
            needed: 8,
            available: 5
        }
    );
}

#[test]
fn unknown_tensor_type_id() {
    for type_id in [40, 1000, u32::MAX] {
        let b = with_tensors(&[("blk.0.ffn_up.weight", &[32], type_id, 0)], 64);
        assert_parse_err!(&b, GgufError::UnknownTensorType { ref tensor, type_id: found }
                if tensor == "blk.0.ffn_up.weight" && found == type_id);
    }
}

#[test]
fn retired_tensor_type_ids() {
    // 4 and 5 were Q4_2 and Q4_3; 31-33 and 36-38 were short-lived repacked layouts.
    for type_id in [4, 5, 31, 32, 33, 36, 37, 38] {
        let b = with_tensors(&[("old", &[32], type_id, 0)], 64);
        assert_parse_err!(&b, GgufError::UnknownTensorType { type_id: found, .. } if found == type_id);
    }
}

#[test]
fn shape_whose_element_count_overflows() {
    let shape = [1 << 32, 1 << 32];
    let b = with_tensors(&[("big", &shape, F32, 0)], 32);
    assert_parse_err!(&b, GgufError::ShapeOverflow { ref tensor, shape: ref found } if tensor == "big" && found == &shape);
}

#[test]
fn shape_whose_byte_size_overflows() {
    // 2^62 elements fit in u64, their 2^64 bytes do not.
    let b = with_tensors(&[("big", &[1 << 31, 1 << 31], F32, 0)], 32);
    assert_parse_err!(&b, GgufError::ShapeOverflow { .. });
}

#[test]
fn row_length_not_a_whole_number_of_blocks() {
    let b = with_tensors(&[("q", &[48, 2], Q4_0, 0)], 64);
    assert_parse_err!(&b, GgufError::PartialBlock { ref tensor, ggml_type: GgmlType::Q4_0, ne0: 48, block_size: 32 }
            if tensor == "q");
    let k_quant = GgmlType::Q6_K.id();
    let b = with_tensors(&[("k", &[128], k_quant, 0)], 256);
    assert_parse_err!(
        &b,
        GgufError::PartialBlock {
            ggml_type: GgmlType::Q6_K,
            ne0: 128,
            block_size: 256,
            ..
        }
    );
}

#[test]
fn quantized_scalar_is_a_partial_block() {
    let b = with_tensors(&[("s", &[], Q4_0, 0)], 32);
    assert_parse_err!(
        &b,
        GgufError::PartialBlock {
            ne0: 1,
            block_size: 32,
            ..
        }
    );
}

#[test]
fn duplicate_tensor_name() {
    let b = with_tensors(&[("w", &[8], F32, 0), ("w", &[8], F32, 32)], 64);
    assert_parse_err!(&b, GgufError::DuplicateTensor { ref tensor } if tensor == "w");
}

#[test]
fn tensor_offset_not_aligned() {
    let b = with_tensors(&[("a", &[4], F32, 0), ("b", &[4], F32, 16)], 64);
    assert_parse_err!(&b, GgufError::MisalignedTensor { ref tensor, offset: 16, alignment: 32 } if tensor == "b");
    // Under a larger general.alignment, an offset aligned to 32 is not enough.
    let b = Bytes::v3(1, 1)
        .kv_u32("general.alignment", 64)
        .tensor("c", &[4], F32, 32)
        .pad_to(64)
        .zeros(64);
    assert_parse_err!(
        &b,
        GgufError::MisalignedTensor {
            offset: 32,
            alignment: 64,
            ..
        }
    );
}

#[test]
fn tensor_past_the_end_of_the_file() {
    // Data section at 64 (24 + 9 + 4 + 8 + 4 + 8 = 57, aligned); 8 floats need 32 bytes.
    let b = with_tensors(&[("t", &[8], F32, 0)], 31);
    assert_parse_err!(&b, GgufError::TensorOutOfBounds { ref tensor, start: 64, end: 96, file_len: 95 } if tensor == "t");
}

#[test]
fn tensor_data_section_missing() {
    let b = with_tensors(&[("t", &[8], F32, 0)], 0);
    assert_parse_err!(
        &b,
        GgufError::TensorOutOfBounds {
            start: 64,
            end: 96,
            file_len: 64,
            ..
        }
    );
}

#[test]
fn tensor_offset_plus_size_overflows() {
    let offset = u64::MAX - 31;
    let b = with_tensors(&[("t", &[8], F32, offset)], 64);
    assert_parse_err!(&b, GgufError::TensorOutOfBounds { end: u64::MAX, .. });
}

#[test]
fn overlapping_tensors() {
    // "b" starts inside "a" (64 bytes at 0).
    let b = with_tensors(&[("a", &[16], F32, 0), ("b", &[8], F32, 32)], 128);
    assert_parse_err!(&b, GgufError::TensorOverlap { ref first, ref second } if first == "a" && second == "b");
}

#[test]
fn overlap_is_found_whatever_the_declaration_order() {
    let b = with_tensors(
        &[
            ("late", &[8], F32, 96),
            ("early", &[64], F32, 0),
            ("mid", &[8], F32, 256),
        ],
        512,
    );
    assert_parse_err!(&b, GgufError::TensorOverlap { ref first, ref second } if first == "early" && second == "late");
}

#[test]
fn empty_tensors_may_share_an_offset() {
    let b = with_tensors(
        &[
            ("e1", &[0], F32, 0),
            ("e2", &[8, 0], F32, 0),
            ("t", &[8], F32, 0),
        ],
        32,
    );
    let file = parse(&b.0).unwrap();
    let sizes: Vec<u64> = file.tensors.iter().map(|t| t.size).collect();
    assert_eq!(sizes, [0, 0, 32]);
}

#[test]
fn tensors_may_leave_gaps_and_come_in_any_order() {
    let b = with_tensors(&[("second", &[8], F32, 64), ("first", &[8], F32, 0)], 96);
    let file = parse(&b.0).unwrap();
    let second = file.tensor("second").unwrap();
    assert_eq!(file.data_offset, 128);
    assert_eq!(file.tensor_range(second), 192..224);
}
