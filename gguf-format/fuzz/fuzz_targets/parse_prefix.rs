#![no_main]
//! Parsing any prefix of a file gives what parsing the whole file gives, or asks, through
//! `UnexpectedEof`, for bytes beyond the prefix; a reader that fetches what it asks for
//! gets there; and a file length far beyond the bytes in hand never makes the parser
//! allocate for what it has not seen.

use gguf_format::{parse, parse_prefix, GgufError, GgufFile};

#[path = "../../tests/gguf/same_bits.rs"]
mod same_bits;

use same_bits::same_value;

libfuzzer_sys::fuzz_target!(|file: &[u8]| {
    let whole = parse(file);
    // A reader growing its prefix to what each error asks for (a bounded number of times).
    let mut fetched = 0;
    for _ in 0..64 {
        match check_prefix(file, fetched, &whole) {
            Some(wanted) => fetched = wanted,
            None => break,
        }
    }
    // One more prefix, cut where the bytes themselves say.
    let hash = file.iter().fold(0usize, |h, &b| {
        h.wrapping_mul(31).wrapping_add(usize::from(b))
    });
    check_prefix(file, hash % (file.len() + 1), &whole);
    let _ = parse_prefix(file, 1 << 40);
});

/// Checks the parse of `file[..len]`; returns the prefix length it asks for, if any.
fn check_prefix(
    file: &[u8],
    len: usize,
    whole: &Result<gguf_format::GgufFile, GgufError>,
) -> Option<usize> {
    match parse_prefix(&file[..len], file.len() as u64) {
        Err(GgufError::UnexpectedEof { offset, needed, .. }) if len < file.len() => {
            let wanted = offset.saturating_add(needed);
            assert!(
                wanted > len as u64,
                "asked for {offset}..+{needed} in a prefix of {len}"
            );
            Some(wanted.min(file.len() as u64) as usize)
        }
        from_prefix => {
            let same = match (&from_prefix, whole) {
                (Ok(a), Ok(b)) => same_file(a, b),
                (a, b) => a == b,
            };
            assert!(same, "prefix of {len}: {from_prefix:?}\nwhole: {whole:?}");
            None
        }
    }
}

/// Equality with floats compared by their bits, so that a NaN equals itself.
fn same_file(a: &GgufFile, b: &GgufFile) -> bool {
    (a.version, a.alignment, a.data_offset, &a.tensors)
        == (b.version, b.alignment, b.data_offset, &b.tensors)
        && a.metadata.len() == b.metadata.len()
        && a.metadata
            .iter()
            .zip(b.metadata.iter())
            .all(|((ka, va), (kb, vb))| ka == kb && same_value(va, vb))
}
