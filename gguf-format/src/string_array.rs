//! Arrays of strings kept compactly: every string's bytes in one buffer, and where each
//! ends.
//!
//! A model's vocabulary is such an array: Gemma 3's has 262,144 short strings. Held as
//! one `String` each, it costs a 24-byte header and a heap block per token, several times
//! the text itself, and as many allocations; held here it costs the text plus four bytes
//! a string, in two allocations. Clones share the buffers, so a tokenizer can keep the
//! vocabulary its file's metadata holds without a second copy.

use std::fmt;
use std::iter::FusedIterator;
use std::ops::Index;
use std::sync::Arc;

/// An array of strings in one buffer. Indexing, [`StringArray::get`] and
/// [`StringArray::iter`] give `&str`s borrowed from it.
///
/// Cloning is cheap: clones share the buffers, and [`StringArray::push`] copies them
/// first only when they are shared.
#[derive(Clone, Default)]
pub struct StringArray {
    data: Arc<Data>,
}

#[derive(Clone, Default)]
struct Data {
    /// Every string, one after another.
    text: String,
    /// `ends[i]` is where string `i` ends in `text`; it starts where string `i - 1` ends.
    ends: Ends,
}

/// End offsets: four bytes each while the text is shorter than 4 GiB, eight beyond.
#[derive(Clone)]
enum Ends {
    Narrow(Vec<u32>),
    Wide(Vec<u64>),
}

impl Default for Ends {
    fn default() -> Ends {
        Ends::Narrow(Vec::new())
    }
}

impl Ends {
    fn with_capacity(n_strings: usize, n_bytes: usize) -> Ends {
        if u32::try_from(n_bytes).is_ok() {
            Ends::Narrow(Vec::with_capacity(n_strings))
        } else {
            Ends::Wide(Vec::with_capacity(n_strings))
        }
    }

    #[inline]
    fn len(&self) -> usize {
        match self {
            Ends::Narrow(v) => v.len(),
            Ends::Wide(v) => v.len(),
        }
    }

    /// Where string `i` ends; `i` must be in range.
    #[inline]
    fn end(&self, i: usize) -> usize {
        match self {
            Ends::Narrow(v) => v[i] as usize,
            // The text is in memory, so its offsets fit in usize.
            Ends::Wide(v) => v[i] as usize,
        }
    }

    /// Where string `i` starts; `i` must be in range.
    #[inline]
    fn start(&self, i: usize) -> usize {
        match i {
            0 => 0,
            _ => self.end(i - 1),
        }
    }

    #[inline]
    fn push(&mut self, end: usize) {
        match self {
            Ends::Narrow(v) => match u32::try_from(end) {
                Ok(end) => v.push(end),
                Err(_) => {
                    let mut wide: Vec<u64> = Vec::with_capacity(v.capacity().max(v.len() + 1));
                    wide.extend(v.iter().map(|&e| u64::from(e)));
                    wide.push(end as u64);
                    *self = Ends::Wide(wide);
                }
            },
            Ends::Wide(v) => v.push(end as u64),
        }
    }
}

impl StringArray {
    /// An empty array.
    pub fn new() -> StringArray {
        StringArray::default()
    }

    /// An empty array with room for `n_strings` strings of `n_bytes` bytes in all.
    pub fn with_capacity(n_strings: usize, n_bytes: usize) -> StringArray {
        StringArray {
            data: Arc::new(Data {
                text: String::with_capacity(n_bytes),
                ends: Ends::with_capacity(n_strings, n_bytes),
            }),
        }
    }

    /// Appends a string (copying the buffers first if a clone shares them).
    pub fn push(&mut self, s: &str) {
        let data = Arc::make_mut(&mut self.data);
        data.text.push_str(s);
        data.ends.push(data.text.len());
    }

    /// Number of strings.
    #[inline]
    pub fn len(&self) -> usize {
        self.data.ends.len()
    }

    /// True when there are no strings.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `i`-th string, or `None` past the end.
    #[inline]
    pub fn get(&self, i: usize) -> Option<&str> {
        (i < self.len()).then(|| self.at(i))
    }

    /// The `i`-th string; `i` must be in range.
    #[inline]
    fn at(&self, i: usize) -> &str {
        let ends = &self.data.ends;
        &self.data.text[ends.start(i)..ends.end(i)]
    }

    /// The strings in order.
    #[inline]
    pub fn iter(&self) -> Iter<'_> {
        Iter {
            array: self,
            front: 0,
            back: self.len(),
        }
    }

    /// The length in bytes of each string, in order, read from the offsets alone.
    #[inline]
    pub fn lens(&self) -> impl ExactSizeIterator<Item = usize> + '_ {
        let ends = &self.data.ends;
        (0..ends.len()).map(|i| ends.end(i) - ends.start(i))
    }

    /// Bytes of all strings together.
    #[inline]
    pub fn text_len(&self) -> usize {
        self.data.text.len()
    }

    /// Whether `self` and `other` share their buffers (one is a clone of the other).
    pub fn shares_buffer_with(&self, other: &StringArray) -> bool {
        Arc::ptr_eq(&self.data, &other.data)
    }
}

/// Builds an array from raw bytes, checking UTF-8 once at the end.
pub(crate) struct StringArrayBuilder {
    /// The strings so far in `bytes[..filled]`; past it, scratch space.
    bytes: Vec<u8>,
    filled: usize,
    ends: Ends,
}

/// Strings up to this long are copied as a block of this many bytes, which compiles to a
/// couple of moves where a copy of any other length calls `memcpy`; vocabularies are
/// hundreds of thousands of strings of a few bytes.
const BLOCK: usize = 16;

/// A string of a [`StringArrayBuilder`] that is not UTF-8: its index, and where its bytes
/// start in the concatenated text.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct InvalidString {
    pub index: usize,
    pub start: usize,
}

impl StringArrayBuilder {
    /// Room for `n_strings` strings of `n_bytes` bytes in all.
    pub fn with_capacity(n_strings: usize, n_bytes: usize) -> StringArrayBuilder {
        StringArrayBuilder {
            bytes: vec![0; n_bytes.saturating_add(BLOCK)],
            filled: 0,
            ends: Ends::with_capacity(n_strings, n_bytes),
        }
    }

    /// Appends a string's `bytes`, not yet checked, given within `followed`, a slice
    /// that starts with them and may go on: when it holds [`BLOCK`] bytes, a short string
    /// is copied with what follows it, which the next string overwrites.
    pub fn push_bytes(&mut self, bytes: &[u8], followed: &[u8]) {
        let start = self.filled;
        let end = start + bytes.len();
        match self.bytes.get_mut(start..start + BLOCK) {
            Some(block) if bytes.len() <= BLOCK && followed.len() >= BLOCK => {
                block.copy_from_slice(&followed[..BLOCK]);
            }
            _ => {
                if self.bytes.len() < end {
                    self.bytes.resize(end, 0);
                }
                self.bytes[start..end].copy_from_slice(bytes);
            }
        }
        self.filled = end;
        self.ends.push(end);
    }

    /// The array, or the first string (in order) that is not valid UTF-8.
    pub fn finish(self) -> Result<StringArray, InvalidString> {
        let StringArrayBuilder {
            mut bytes,
            filled,
            ends,
        } = self;
        bytes.truncate(filled);
        // Valid text cut only between characters is valid string by string: a boundary
        // inside a character would start the next string with a continuation byte.
        let cut_inside = |ends: &Ends, text: &[u8]| {
            (0..ends.len()).any(|i| text.get(ends.start(i)).is_some_and(|&b| is_continuation(b)))
        };
        match String::from_utf8(bytes) {
            Ok(text) if !cut_inside(&ends, text.as_bytes()) => Ok(StringArray {
                data: Arc::new(Data { text, ends }),
            }),
            // Rare and hostile: find which string is at fault, one by one.
            Ok(text) => Err(first_invalid(&ends, text.as_bytes())),
            Err(e) => Err(first_invalid(&ends, e.as_bytes())),
        }
    }
}

fn is_continuation(byte: u8) -> bool {
    byte & 0xc0 == 0x80
}

fn first_invalid(ends: &Ends, bytes: &[u8]) -> InvalidString {
    (0..ends.len())
        .map(|index| InvalidString {
            index,
            start: ends.start(index),
        })
        .find(|s| std::str::from_utf8(&bytes[s.start..ends.end(s.index)]).is_err())
        .expect("invalid text holds an invalid string")
}

impl Index<usize> for StringArray {
    type Output = str;

    /// The `i`-th string; panics past the end, as slices do.
    #[inline]
    fn index(&self, i: usize) -> &str {
        match self.get(i) {
            Some(s) => s,
            None => panic!(
                "index {i} is out of range for an array of {} strings",
                self.len()
            ),
        }
    }
}

/// The strings of a [`StringArray`], in order.
#[derive(Clone, Debug)]
pub struct Iter<'a> {
    array: &'a StringArray,
    front: usize,
    back: usize,
}

impl<'a> Iterator for Iter<'a> {
    type Item = &'a str;

    #[inline]
    fn next(&mut self) -> Option<&'a str> {
        if self.front == self.back {
            return None;
        }
        self.front += 1;
        Some(self.array.at(self.front - 1))
    }

    #[inline]
    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.back - self.front;
        (n, Some(n))
    }
}

impl DoubleEndedIterator for Iter<'_> {
    #[inline]
    fn next_back(&mut self) -> Option<Self::Item> {
        if self.front == self.back {
            return None;
        }
        self.back -= 1;
        Some(self.array.at(self.back))
    }
}

impl ExactSizeIterator for Iter<'_> {}

impl FusedIterator for Iter<'_> {}

impl<'a> IntoIterator for &'a StringArray {
    type Item = &'a str;
    type IntoIter = Iter<'a>;

    #[inline]
    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

impl<S: AsRef<str>> FromIterator<S> for StringArray {
    fn from_iter<I: IntoIterator<Item = S>>(items: I) -> StringArray {
        let items = items.into_iter();
        let mut data = Data {
            text: String::new(),
            ends: Ends::with_capacity(items.size_hint().0, 0),
        };
        for s in items {
            data.text.push_str(s.as_ref());
            data.ends.push(data.text.len());
        }
        StringArray {
            data: Arc::new(data),
        }
    }
}

impl<S: AsRef<str>> Extend<S> for StringArray {
    fn extend<I: IntoIterator<Item = S>>(&mut self, items: I) {
        for s in items {
            self.push(s.as_ref());
        }
    }
}

impl From<Vec<String>> for StringArray {
    fn from(strings: Vec<String>) -> StringArray {
        let n_bytes = strings.iter().map(String::len).sum();
        let mut data = Data {
            text: String::with_capacity(n_bytes),
            ends: Ends::with_capacity(strings.len(), n_bytes),
        };
        for s in &strings {
            data.text.push_str(s);
            data.ends.push(data.text.len());
        }
        StringArray {
            data: Arc::new(data),
        }
    }
}

impl From<&[&str]> for StringArray {
    fn from(strings: &[&str]) -> StringArray {
        strings.iter().collect()
    }
}

impl PartialEq for StringArray {
    fn eq(&self, other: &StringArray) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter())
    }
}

impl Eq for StringArray {}

impl<S: AsRef<str>> PartialEq<[S]> for StringArray {
    fn eq(&self, other: &[S]) -> bool {
        self.len() == other.len() && self.iter().eq(other.iter().map(AsRef::as_ref))
    }
}

impl<S: AsRef<str>, const N: usize> PartialEq<[S; N]> for StringArray {
    fn eq(&self, other: &[S; N]) -> bool {
        *self == other[..]
    }
}

impl<S: AsRef<str>> PartialEq<Vec<S>> for StringArray {
    fn eq(&self, other: &Vec<S>) -> bool {
        *self == other[..]
    }
}

impl fmt::Debug for StringArray {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn built(parts: &[&[u8]]) -> Result<StringArray, InvalidString> {
        let mut b = StringArrayBuilder::with_capacity(parts.len(), 0);
        for p in parts {
            b.push_bytes(p, p);
        }
        b.finish()
    }

    #[test]
    fn holds_strings_in_order_with_empty_ones() {
        let a: StringArray = ["", "ab", "", "ü€", "c"].iter().collect();
        assert_eq!(a.len(), 5);
        assert_eq!(a.text_len(), 2 + 5 + 1);
        assert!(a.lens().eq([0, 2, 0, 5, 1]));
        assert_eq!(a, ["", "ab", "", "ü€", "c"]);
        assert_eq!(a.get(3), Some("ü€"));
        assert_eq!(a.get(5), None);
        assert_eq!(&a[1], "ab");
        assert_eq!(
            a.iter().rev().collect::<Vec<_>>(),
            ["c", "ü€", "", "ab", ""]
        );
        assert_eq!(a.iter().len(), 5);
        assert_eq!(format!("{a:?}"), r#"["", "ab", "", "ü€", "c"]"#);
        assert!(StringArray::new().is_empty());
        assert_eq!(StringArray::new().get(0), None);
    }

    #[test]
    fn conversions_agree() {
        let owned = vec!["x".to_string(), String::new(), "yz".into()];
        let from_vec = StringArray::from(owned.clone());
        let collected: StringArray = owned.iter().collect();
        let mut pushed = StringArray::with_capacity(3, 3);
        pushed.extend(&owned);
        assert_eq!(from_vec, collected);
        assert_eq!(from_vec, pushed);
        assert_eq!(from_vec, owned);
        assert_eq!(from_vec, StringArray::from(&["x", "", "yz"][..]));
        assert_ne!(from_vec, ["x", "", "y", "z"]);
        assert_ne!(from_vec, ["x", "y", "z"]);
    }

    #[test]
    fn clones_share_until_written() {
        let a: StringArray = ["a", "b"].iter().collect();
        let mut b = a.clone();
        assert!(b.shares_buffer_with(&a));
        b.push("c");
        assert!(!b.shares_buffer_with(&a));
        assert_eq!((a.len(), b.len()), (2, 3));
        assert_eq!(b, ["a", "b", "c"]);
    }

    #[test]
    fn short_strings_copied_with_what_follows_them() {
        let file = b"ab-cdefghijklmnopqrstuvwxyz0123456789";
        let mut b = StringArrayBuilder::with_capacity(5, 2 + 1 + 20 + 7);
        // Copied as blocks with the bytes after them, each overwriting the last's tail.
        b.push_bytes(&file[..2], file);
        b.push_bytes(&file[3..4], &file[3..]);
        // A string longer than a block, and one with too little after it.
        b.push_bytes(&file[4..24], &file[4..]);
        b.push_bytes(&file[30..], &file[30..]);
        b.push_bytes(b"", b"");
        assert_eq!(
            b.finish().unwrap(),
            ["ab", "c", "defghijklmnopqrstuvw", "3456789", ""]
        );
    }

    #[test]
    fn offsets_widen_past_four_gib() {
        let mut ends = Ends::with_capacity(2, 0);
        ends.push(7);
        ends.push(u32::MAX as usize + 1);
        assert!(matches!(ends, Ends::Wide(_)));
        assert_eq!((ends.start(1), ends.end(1)), (7, u32::MAX as usize + 1));
        assert_eq!((ends.start(0), ends.end(0)), (0, 7));
    }

    #[test]
    fn the_builder_names_the_first_invalid_string() {
        assert_eq!(
            built(&[b"ok", b"", "é".as_bytes()]).unwrap(),
            ["ok", "", "é"]
        );
        // Invalid on its own.
        assert_eq!(
            built(&[b"ok", b"\xed\xa0\x80", b"\xff"]).unwrap_err(),
            InvalidString { index: 1, start: 2 }
        );
        // "é" cut in two: the text as a whole is valid, neither string is.
        assert_eq!(
            built(&[b"a", b"\xc3", b"", b"\xa9"]).unwrap_err(),
            InvalidString { index: 1, start: 1 }
        );
        // A string of continuation bytes after a valid one.
        assert_eq!(
            built(&[b"a", b"\x80"]).unwrap_err(),
            InvalidString { index: 1, start: 1 }
        );
        assert_eq!(
            built(&[b"\xf0\x9f", b"\x98\x80"]).unwrap_err(),
            InvalidString { index: 0, start: 0 }
        );
    }
}
