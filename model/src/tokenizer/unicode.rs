//! Code point classes for the pre-tokenizers and the byte-level alphabet of GPT-2 style BPE.
//!
//! The classes come from Unicode 15.1 general categories (the table llama.cpp uses, so that
//! both split text at the same places); `unicode_table.rs` is generated from that data.

/// The generated table, a child of this module: it names the classes defined here.
#[path = "unicode_table.rs"]
mod table;

use table::CLASS_RANGES;

/// The general-category group of a code point.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CodepointClass {
    /// Unassigned (`Cn`).
    Undefined,
    /// `Cc`, `Cf`, `Co`, `Cs`.
    Control,
    /// `L*`.
    Letter,
    /// `M*`.
    Mark,
    /// `N*`.
    Number,
    /// `P*`.
    Punctuation,
    /// `S*`.
    Symbol,
    /// `Z*`.
    Separator,
}

/// The class of `cp`, for any `u32` (values past U+10FFFF are `Undefined`).
pub(super) fn class_of(cp: u32) -> CodepointClass {
    // The first range starts at 0, so the partition point is at least 1.
    let idx = CLASS_RANGES.partition_point(|&(start, _)| start <= cp);
    if cp > 0x10FFFF || idx == 0 {
        return CodepointClass::Undefined;
    }
    CLASS_RANGES[idx - 1].1
}

/// The Unicode `White_Space` property.
pub(super) fn is_whitespace(cp: u32) -> bool {
    matches!(
        cp,
        0x09..=0x0D | 0x20 | 0x85 | 0xA0 | 0x1680 | 0x2000..=0x200A | 0x2028 | 0x2029 | 0x202F
            | 0x205F | 0x3000
    )
}

/// What the pre-tokenizers ask of one position of a piece of text.
///
/// Positions outside the piece read as `Flags::OUTSIDE`: not a letter, number or space,
/// and not `inside` either (the hand-written splitters test that to stop at the end).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Flags {
    pub inside: bool,
    pub letter: bool,
    pub number: bool,
    pub whitespace: bool,
}

impl Flags {
    pub const OUTSIDE: Flags = Flags {
        inside: false,
        letter: false,
        number: false,
        whitespace: false,
    };

    pub fn of(cp: u32) -> Flags {
        let class = class_of(cp);
        Flags {
            inside: true,
            letter: class == CodepointClass::Letter,
            number: class == CodepointClass::Number,
            whitespace: is_whitespace(cp),
        }
    }

    /// Neither space, letter nor number, and inside the piece: `[^\s\p{L}\p{N}]`.
    pub fn is_other(self) -> bool {
        self.inside && !(self.whitespace || self.letter || self.number)
    }
}

/// GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes map to
/// themselves, the other 68 to U+0100.. in byte order.
pub(super) struct ByteAlphabet {
    to_char: [char; 256],
    /// Indexed by code point; every character of the alphabet is below U+0200.
    to_byte: [Option<u8>; 0x200],
}

impl ByteAlphabet {
    pub fn new() -> ByteAlphabet {
        let mut to_char = ['\0'; 256];
        let mut to_byte = [None; 0x200];
        let mut next_extra = 0x100u32;
        for byte in 0..=255u8 {
            let b = u32::from(byte);
            let printable = (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
            let cp = if printable {
                b
            } else {
                next_extra += 1;
                next_extra - 1
            };
            // Below U+0200: always a valid scalar value.
            to_char[usize::from(byte)] = char::from_u32(cp).unwrap_or('\u{FFFD}');
            to_byte[cp as usize] = Some(byte);
        }
        ByteAlphabet { to_char, to_byte }
    }

    /// The character that stands for `byte`.
    pub fn char_of(&self, byte: u8) -> char {
        self.to_char[usize::from(byte)]
    }

    /// The byte that `c` stands for, when `c` is in the alphabet.
    pub fn byte_of(&self, c: char) -> Option<u8> {
        self.to_byte.get(c as usize).copied().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_of_known_code_points() {
        assert_eq!(class_of('a' as u32), CodepointClass::Letter);
        assert_eq!(class_of('7' as u32), CodepointClass::Number);
        assert_eq!(class_of('½' as u32), CodepointClass::Number);
        assert_eq!(class_of('!' as u32), CodepointClass::Punctuation);
        assert_eq!(class_of('$' as u32), CodepointClass::Symbol);
        assert_eq!(class_of(' ' as u32), CodepointClass::Separator);
        assert_eq!(class_of(0x0301), CodepointClass::Mark);
        assert_eq!(class_of(0x200B), CodepointClass::Control);
        assert_eq!(class_of('日' as u32), CodepointClass::Letter);
        // CJK extension I arrived in Unicode 15.1; Garay only in 16.0.
        assert_eq!(class_of(0x2EBF0), CodepointClass::Letter);
        assert_eq!(class_of(0x10D40), CodepointClass::Undefined);
        assert_eq!(class_of(0x10FFFF), CodepointClass::Undefined);
        assert_eq!(class_of(0x110000), CodepointClass::Undefined);
    }

    #[test]
    fn table_is_sorted_and_starts_at_zero() {
        assert_eq!(CLASS_RANGES[0].0, 0);
        assert!(CLASS_RANGES.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn byte_alphabet_round_trips() {
        let alphabet = ByteAlphabet::new();
        assert_eq!(alphabet.char_of(b'a'), 'a');
        assert_eq!(alphabet.char_of(b' '), 'Ġ');
        assert_eq!(alphabet.char_of(b'\n'), 'Ċ');
        assert_eq!(alphabet.char_of(0xAD), 'Ń');
        for byte in 0..=255u8 {
            assert_eq!(
                alphabet.byte_of(alphabet.char_of(byte)),
                Some(byte),
                "byte {byte:#x}"
            );
        }
        assert_eq!(alphabet.byte_of('€'), None);
        assert_eq!(alphabet.byte_of(' '), None);
    }
}
