//! Text → token id lookup without a second copy of the vocabulary's texts, and the fast
//! hash it and the merge table use.
//!
//! Keys come from the model file, not from users, so a fast non-cryptographic hash (the
//! multiply-rotate scheme of rustc's `FxHasher`) is enough: building Gemma 3's 262,144-
//! token index is on the path to the first generated token.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use gguf_format::StringArray;

use super::TokenId;

const MULTIPLIER: u64 = 0x517c_c1b7_2722_0a95;

/// Multiply-rotate hashing over 8-byte words.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct FastHasher {
    hash: u64,
}

impl FastHasher {
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(MULTIPLIER);
    }
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, byte: u8) {
        self.add(u64::from(byte));
    }

    fn write_u32(&mut self, word: u32) {
        self.add(u64::from(word));
    }

    fn write_u64(&mut self, word: u64) {
        self.add(word);
    }

    fn finish(&self) -> u64 {
        // A product's low bits see only the input's low bits; `HashMap` takes its bucket
        // from the low bits, so fold the well-mixed high half into them. The high half,
        // which `TokenIndex` uses, is unchanged.
        self.hash ^ (self.hash >> 32)
    }
}

/// A `HashMap` with [`FastHasher`].
pub(super) type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

fn hash_text(text: &str) -> u64 {
    let mut hasher = FastHasher::default();
    hasher.write(text.as_bytes());
    // The length tells "a" from "a\0", which pad to the same word.
    hasher.add(text.len() as u64);
    hasher.finish()
}

const EMPTY: u32 = u32::MAX;

/// An open-addressing table of token ids, probed linearly; the texts stay in the
/// vocabulary and are compared in place.
///
/// Each slot holds an id in its low bits and, in the bits an id does not need, a tag of
/// more bits of the text's hash: a probe compares texts only when the tags agree, so
/// building Gemma 3's index (18-bit ids, 13-bit tags) almost never reads a text twice.
pub(super) struct TokenIndex {
    slots: Vec<u32>,
    /// `64 - log2(slots.len())`: the slot is the hash's top bits, where multiply-rotate
    /// hashing puts its entropy.
    shift: u32,
    /// Bits of a slot that hold the id; the rest hold the tag.
    id_bits: u32,
}

impl TokenIndex {
    /// Indexes `texts`; on two equal texts returns the ids of both.
    pub fn new(texts: &StringArray) -> Result<TokenIndex, (TokenId, TokenId)> {
        // At most half full, at least 2 slots.
        let n_slots = (texts.len() * 2).next_power_of_two().max(2);
        // Enough bits that no id has them all set, so no slot value equals EMPTY. The
        // caller checked that ids fit in u32.
        let id_bits = u32::BITS - (texts.len() as u32).leading_zeros();
        let mut index = TokenIndex {
            slots: vec![EMPTY; n_slots],
            shift: 64 - n_slots.trailing_zeros(),
            id_bits,
        };
        // In batches: hashing a batch of texts first leaves the probes that follow free
        // of the hashing loop's mispredicted branches, so the processor overlaps their
        // cache misses (the table is larger than the cache), which otherwise dominate.
        const BATCH: usize = 32;
        let mut places = [(0, 0, 0); BATCH];
        let mut texts_in_order = texts.iter().enumerate();
        loop {
            let mut batch = 0;
            for (id, text) in texts_in_order.by_ref().take(BATCH) {
                let (slot, tag) = index.place(text);
                // Ids fit in u32: the caller checked the vocabulary's size.
                places[batch] = (id as u32, slot, tag);
                batch += 1;
            }
            if batch == 0 {
                return Ok(index);
            }
            for &(id, slot, tag) in &places[..batch] {
                index.insert(texts, id, slot, tag)?;
            }
        }
    }

    /// Puts `id` in the first free slot from `slot` on, unless its text is there already.
    fn insert(
        &mut self,
        texts: &StringArray,
        id: TokenId,
        mut slot: usize,
        tag: u32,
    ) -> Result<(), (TokenId, TokenId)> {
        let mask = self.slots.len() - 1;
        loop {
            match self.slots[slot] {
                EMPTY => {
                    self.slots[slot] = tag | id;
                    return Ok(());
                }
                other if self.tag_matches(other, tag) => {
                    let other = self.id(other);
                    if texts[other as usize] == texts[id as usize] {
                        return Err((other, id));
                    }
                    slot = (slot + 1) & mask;
                }
                _ => slot = (slot + 1) & mask,
            }
        }
    }

    /// The first slot to probe for `text`, and its tag, already in place above the id.
    fn place(&self, text: &str) -> (usize, u32) {
        let hash = hash_text(text);
        let slot = (hash >> self.shift) as usize;
        // The tag comes from hash bits below the slot's.
        let tag = ((hash >> self.shift.saturating_sub(32)) as u32)
            .checked_shl(self.id_bits)
            .unwrap_or(0);
        (slot, tag)
    }

    fn tag_matches(&self, slot_value: u32, tag: u32) -> bool {
        (slot_value ^ tag).checked_shr(self.id_bits).unwrap_or(0) == 0
    }

    fn id(&self, slot_value: u32) -> TokenId {
        slot_value & u32::MAX.checked_shr(u32::BITS - self.id_bits).unwrap_or(0)
    }

    /// The id whose text in `texts` (the same texts the index was built from) is `text`.
    pub fn get(&self, texts: &StringArray, text: &str) -> Option<TokenId> {
        let mask = self.slots.len() - 1;
        let (mut slot, tag) = self.place(text);
        loop {
            match self.slots[slot] {
                EMPTY => return None,
                value
                    if self.tag_matches(value, tag) && &texts[self.id(value) as usize] == text =>
                {
                    return Some(self.id(value))
                }
                _ => slot = (slot + 1) & mask,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_every_text_and_nothing_else() {
        let texts: StringArray = (0..1000)
            .map(|i| format!("tok{i}"))
            .chain(["a".into(), "a\0".into()])
            .collect();
        let index = TokenIndex::new(&texts).unwrap();
        for (id, text) in texts.iter().enumerate() {
            assert_eq!(index.get(&texts, text), Some(id as u32));
        }
        assert_eq!(index.get(&texts, "tok1000"), None);
        assert_eq!(index.get(&texts, ""), None);
    }

    #[test]
    fn ids_and_tags_share_slots_at_every_size() {
        // Around powers of two the id takes one bit more and the tag one bit less.
        for n in [1, 2, 3, 4, 255, 256, 257, 4095, 4096] {
            let texts: StringArray = (0..n).map(|i| format!("{i:x}")).collect();
            let index = TokenIndex::new(&texts).unwrap();
            assert!(index.id_bits < 32 && n < 1 << index.id_bits, "{n}");
            for (id, text) in texts.iter().enumerate() {
                assert_eq!(index.get(&texts, text), Some(id as u32), "{n} {text}");
            }
            assert_eq!(index.get(&texts, "absent"), None);
        }
    }

    #[test]
    fn reports_duplicates() {
        let texts: StringArray = ["x", "y", "x"].iter().collect();
        assert_eq!(TokenIndex::new(&texts).err(), Some((0, 2)));
        let one: StringArray = ["only"].iter().collect();
        assert_eq!(TokenIndex::new(&one).unwrap().get(&one, "only"), Some(0));
    }
}
