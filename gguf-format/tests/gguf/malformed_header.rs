//! The header: magic, version, and the two counts.

use gguf_format::limits::{MAX_METADATA, MAX_TENSORS};
use gguf_format::{parse, GgufError};

use crate::builder::{assert_parse_err, parse_err, Bytes};

#[test]
fn empty_input_ends_early_at_the_magic() {
    assert!(matches!(
        parse(&[]),
        Err(GgufError::UnexpectedEof {
            offset: 0,
            needed: 4,
            available: 0
        })
    ));
}

#[test]
fn bad_magic_names_the_bytes_found() {
    let b = Bytes::header(3, 0, 0);
    let mut bytes = b.0;
    bytes[..4].copy_from_slice(b"GGML");
    assert!(matches!(
        parse(&bytes),
        Err(GgufError::BadMagic { found }) if &found == b"GGML"
    ));
}

#[test]
fn big_endian_file_with_ascii_magic_is_named() {
    // A big-endian writer stores the magic as characters and the version big-endian.
    let b = Bytes::default()
        .raw(b"GGUF")
        .raw(&3u32.to_be_bytes())
        .raw(&0u64.to_be_bytes())
        .raw(&0u64.to_be_bytes());
    assert_parse_err!(&b, GgufError::BigEndian { version: 3 });
}

#[test]
fn big_endian_file_with_swapped_magic_is_named() {
    let b = Bytes::default()
        .raw(b"FUGG")
        .raw(&2u32.to_be_bytes())
        .zeros(16);
    assert_parse_err!(&b, GgufError::BigEndian { version: 2 });
}

#[test]
fn version_one_is_refused_by_name() {
    assert_parse_err!(&Bytes::header(1, 0, 0), GgufError::VersionOne);
}

#[test]
fn version_four_is_unsupported() {
    for version in [4, u32::MAX] {
        assert_parse_err!(
            &Bytes::header(version, 0, 0),
            GgufError::UnsupportedVersion { version: v } if v == version
        );
    }
}

#[test]
fn versions_two_and_three_parse() {
    for version in [2, 3] {
        let file = parse(&Bytes::header(version, 0, 0).0).unwrap();
        assert_eq!(file.version, version);
        assert_eq!(file.data_offset, 32);
        assert!(file.metadata.is_empty() && file.tensors.is_empty());
    }
}

#[test]
fn truncated_version_ends_early() {
    let b = Bytes::default().raw(b"GGUF").raw(&[3, 0]);
    assert_parse_err!(
        &b,
        GgufError::UnexpectedEof {
            offset: 4,
            needed: 4,
            available: 2
        }
    );
}

#[test]
fn truncated_metadata_count_ends_early() {
    let mut b = Bytes::header(3, 0, 0);
    b.0.truncate(19);
    assert_parse_err!(
        &b,
        GgufError::UnexpectedEof {
            offset: 16,
            needed: 8,
            available: 3
        }
    );
}

#[test]
fn huge_tensor_count_exceeds_the_cap() {
    assert_parse_err!(
        &Bytes::v3(u64::MAX, 0),
        GgufError::CountTooLarge {
            what: "tensor",
            count: u64::MAX,
            max: MAX_TENSORS
        }
    );
}

#[test]
fn huge_metadata_count_exceeds_the_cap() {
    assert_parse_err!(&Bytes::v3(0, MAX_METADATA + 1), GgufError::CountTooLarge {
            what: "metadata",
            count,
            max: MAX_METADATA
        } if count == MAX_METADATA + 1);
}

#[test]
fn tensor_count_within_the_cap_but_beyond_the_bytes_left() {
    // 100 bytes follow the header: room for 4 tensor infos of at least 24 bytes, not 5.
    let fits = Bytes::v3(4, 0).zeros(100);
    assert!(!matches!(
        parse_err(&fits),
        GgufError::CountExceedsFile { .. }
    ));
    let b = Bytes::v3(5, 0).zeros(100);
    assert_parse_err!(
        &b,
        GgufError::CountExceedsFile {
            what: "tensor",
            count: 5,
            offset: 24,
            remaining: 100
        }
    );
}

#[test]
fn metadata_count_within_the_cap_but_beyond_the_bytes_left() {
    let b = Bytes::v3(0, MAX_METADATA).kv_u32("a", 1);
    assert_parse_err!(
        &b,
        GgufError::CountExceedsFile {
            what: "metadata",
            count: MAX_METADATA,
            offset: 24,
            remaining: 17
        }
    );
}
