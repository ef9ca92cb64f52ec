//! GPT-2's byte alphabet, written apart from the tokenizer's: what the vocabularies built
//! by hand for tests and fuzzing spell their byte tokens with. Each user compiles this
//! file in with `#[path]`.

/// The character GPT-2's byte-level BPE uses for byte `b`: printable Latin-1 bytes stand
/// for themselves, the others for the code points from U+0100 up, in byte order.
pub fn byte_char(b: u8) -> char {
    let printable = |b: u8| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + rank).expect("a valid code point")
}
