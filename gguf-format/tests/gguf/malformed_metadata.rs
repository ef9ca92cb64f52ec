//! Metadata: keys, values of every type, arrays, and `general.alignment`.

use gguf_format::limits::{
    MAX_ALIGNMENT, MAX_ARRAY_DEPTH, MAX_ARRAY_LEN, MAX_KEY_LEN, MAX_STRING_LEN,
};
use gguf_format::{parse, Array, GgufError, Value, ValueType};

use crate::builder::{assert_parse_err, one_array, Bytes};

const ARRAY: u32 = 9;

#[test]
fn key_longer_than_the_cap() {
    let b = Bytes::v3(0, 1)
        .u64(MAX_KEY_LEN + 1)
        .zeros(MAX_KEY_LEN as usize + 1)
        .u32(ValueType::U8.id())
        .u8(0);
    assert_parse_err!(&b, GgufError::StringTooLong { len, max: MAX_KEY_LEN, offset: 24 } if len == MAX_KEY_LEN + 1);
}

#[test]
fn string_value_longer_than_the_cap() {
    let b = Bytes::v3(0, 1)
        .key("general.name", ValueType::String)
        .u64(u64::MAX)
        .zeros(8);
    // Header 24, key 8 + 12, type 4.
    assert_parse_err!(
        &b,
        GgufError::StringTooLong {
            len: u64::MAX,
            max: MAX_STRING_LEN,
            offset: 48
        }
    );
}

#[test]
fn string_value_longer_than_the_bytes_left() {
    let b = Bytes::v3(0, 1)
        .key("general.name", ValueType::String)
        .u64(100)
        .raw(b"abc");
    assert_parse_err!(
        &b,
        GgufError::UnexpectedEof {
            offset: 56,
            needed: 100,
            available: 3
        }
    );
}

#[test]
fn key_cut_short() {
    let b = Bytes::v3(0, 1).u64(20).raw(b"general.");
    assert_parse_err!(
        &b,
        GgufError::UnexpectedEof {
            offset: 32,
            needed: 20,
            available: 8
        }
    );
}

#[test]
fn invalid_utf8_in_a_key() {
    let b = Bytes::v3(0, 1)
        .string(b"general.\xff\xfe")
        .u32(ValueType::U8.id())
        .u8(0);
    assert_parse_err!(&b, GgufError::InvalidUtf8 { offset: 24 });
}

#[test]
fn invalid_utf8_in_a_string_value() {
    // An overlong encoding of '/' and a lone continuation byte.
    let b = Bytes::v3(0, 1)
        .key("general.name", ValueType::String)
        .string(b"ok \xc0\xaf \x80");
    assert_parse_err!(&b, GgufError::InvalidUtf8 { offset: 48 });
}

#[test]
fn invalid_utf8_in_a_string_array_element() {
    // Key at 24 (8 + 6), type at 38, array header at 42 (4 + 8), elements at 54.
    let b = Bytes::v3(0, 1)
        .key("tokens", ValueType::Array)
        .strings(&[b"fine", b"\xed\xa0\x80"]);
    assert_parse_err!(&b, GgufError::InvalidUtf8 { offset: 66 });
}

#[test]
fn character_split_between_two_string_array_elements() {
    // "é" as its lead byte ending one element and its continuation byte starting the
    // next: the elements' bytes together are valid UTF-8, each element alone is not.
    // Elements at 54: "a" (54..63), "\xc3" (63..72), "" (72..80), "\xa9" (80..89).
    let b = Bytes::v3(0, 1)
        .key("tokens", ValueType::Array)
        .strings(&[b"a", b"\xc3", b"", b"\xa9"]);
    assert_parse_err!(&b, GgufError::InvalidUtf8 { offset: 63 });
}

#[test]
fn empty_key() {
    // Padded: an entry takes at least 14 bytes when its key is not empty.
    let b = Bytes::v3(0, 1).key("", ValueType::U8).u8(1).zeros(8);
    assert_parse_err!(&b, GgufError::EmptyKey { offset: 24 });
}

#[test]
fn unknown_value_type() {
    for type_id in [13, 0x100, u32::MAX] {
        let b = Bytes::v3(0, 1).string(b"k").u32(type_id).u64(0);
        assert_parse_err!(&b, GgufError::UnknownValueType { ref key, type_id: found, offset: 33 }
                if key == "k" && found == type_id);
    }
}

#[test]
fn unknown_array_element_type() {
    let b = one_array(13, 1).u64(0);
    assert_parse_err!(&b, GgufError::UnknownValueType { ref key, type_id: 13, offset: 37 } if key == "k");
}

#[test]
fn bool_value_neither_zero_nor_one() {
    let b = Bytes::v3(0, 1).key("flag", ValueType::Bool).u8(2);
    assert_parse_err!(&b, GgufError::InvalidBool { ref key, value: 2, offset: 40 } if key == "flag");
}

#[test]
fn bool_array_element_neither_zero_nor_one() {
    let b = Bytes::v3(0, 1)
        .key("flags", ValueType::Array)
        .array_header(ValueType::Bool.id(), 3)
        .raw(&[1, 0, 0xff]);
    assert_parse_err!(&b, GgufError::InvalidBool { ref key, value: 0xff, offset: 55 } if key == "flags");
}

/// `depth` arrays, each holding the next, the innermost holding one u8.
fn nested(depth: usize) -> Bytes {
    let mut b = Bytes::v3(0, 1).key("deep", ValueType::Array);
    for _ in 1..depth {
        b = b.array_header(ARRAY, 1);
    }
    b.array_header(ValueType::U8.id(), 1).u8(7)
}

#[test]
fn arrays_nested_deeper_than_the_cap() {
    assert_parse_err!(&nested(MAX_ARRAY_DEPTH + 1), GgufError::NestingTooDeep { ref key, depth, max: MAX_ARRAY_DEPTH }
            if key == "deep" && depth == MAX_ARRAY_DEPTH + 1);
    // The same bytes one level less deep are fine, and read back as nested arrays.
    let file = parse(&nested(MAX_ARRAY_DEPTH).pad_to(32).0).unwrap();
    let mut array = file.metadata.get_array("deep").unwrap();
    for _ in 1..MAX_ARRAY_DEPTH {
        match array {
            Array::Array(inner) if inner.len() == 1 => array = &inner[0],
            other => panic!("expected an array of one array, found {other:?}"),
        }
    }
    assert_eq!(array, &Array::U8(vec![7]));
}

#[test]
fn arrays_of_arrays_of_mixed_element_types_parse() {
    let b = Bytes::v3(0, 1)
        .key("merges", ValueType::Array)
        .array_header(ARRAY, 3)
        .strings(&[b"a b", b"c d"])
        .array_header(ValueType::I16.id(), 1)
        .raw(&(-2i16).to_le_bytes())
        .array_header(ARRAY, 0)
        .pad_to(32);
    let file = parse(&b.0).unwrap();
    assert_eq!(
        file.metadata.get("merges"),
        Some(&Value::Array(Array::Array(vec![
            Array::String(["a b", "c d"].iter().collect()),
            Array::I16(vec![-2]),
            Array::Array(vec![]),
        ])))
    );
}

#[test]
fn array_length_above_the_cap() {
    let b = one_array(ValueType::U8.id(), MAX_ARRAY_LEN + 1);
    assert_parse_err!(&b, GgufError::CountTooLarge { what: "array element", count, max: MAX_ARRAY_LEN }
            if count == MAX_ARRAY_LEN + 1);
}

#[test]
fn array_length_beyond_the_bytes_left() {
    // 1000 u32 need 4000 bytes; 10 are left after the array header at 49.
    let b = one_array(ValueType::U32.id(), 1000).zeros(10);
    assert_parse_err!(
        &b,
        GgufError::CountExceedsFile {
            what: "array element",
            count: 1000,
            offset: 49,
            remaining: 10
        }
    );
    // Strings take at least their 8-byte length each: 2 fit in 16 bytes, 3 do not.
    let b = one_array(ValueType::String.id(), 3).zeros(16);
    assert_parse_err!(
        &b,
        GgufError::CountExceedsFile {
            what: "array element",
            count: 3,
            ..
        }
    );
}

#[test]
fn array_of_strings_cut_inside_an_element() {
    let b = one_array(ValueType::String.id(), 2).u64(30).zeros(10);
    assert_parse_err!(
        &b,
        GgufError::UnexpectedEof {
            offset: 57,
            needed: 30,
            available: 10
        }
    );
}

#[test]
fn duplicate_key() {
    let b = Bytes::v3(0, 2)
        .kv_u32("llama.block_count", 1)
        .kv_u32("llama.block_count", 2);
    assert_parse_err!(&b, GgufError::DuplicateKey { ref key } if key == "llama.block_count");
}

#[test]
fn alignment_of_the_wrong_type() {
    let b = Bytes::v3(0, 1)
        .key("general.alignment", ValueType::U64)
        .u64(32);
    assert_parse_err!(
        &b,
        GgufError::AlignmentType {
            found: ValueType::U64
        }
    );
    let b = Bytes::v3(0, 1).kv_str("general.alignment", "32");
    assert_parse_err!(
        &b,
        GgufError::AlignmentType {
            found: ValueType::String
        }
    );
}

#[test]
fn alignment_zero() {
    let b = Bytes::v3(0, 1).kv_u32("general.alignment", 0);
    assert_parse_err!(
        &b,
        GgufError::InvalidAlignment {
            value: 0,
            max: MAX_ALIGNMENT
        }
    );
}

#[test]
fn alignment_not_a_power_of_two() {
    for value in [3, 48, u32::MAX] {
        let b = Bytes::v3(0, 1).kv_u32("general.alignment", value);
        assert_parse_err!(&b, GgufError::InvalidAlignment { value: found, .. } if found == u64::from(value));
    }
}

#[test]
fn alignment_above_the_cap() {
    let too_large = (MAX_ALIGNMENT * 2) as u32;
    let b = Bytes::v3(0, 1).kv_u32("general.alignment", too_large);
    assert_parse_err!(&b, GgufError::InvalidAlignment { value, max: MAX_ALIGNMENT } if value == u64::from(too_large));
}

#[test]
fn alignments_from_one_to_the_cap_set_the_data_offset() {
    for alignment in [1, 8, 64, MAX_ALIGNMENT as u32] {
        let b = Bytes::v3(0, 1).kv_u32("general.alignment", alignment);
        let file = parse(&b.0).unwrap();
        assert_eq!(file.alignment, u64::from(alignment));
        assert_eq!(
            file.data_offset,
            b.len().next_multiple_of(u64::from(alignment))
        );
    }
}
