//! Text → token id lookup without a second copy of the vocabulary's texts, and the fast
//! hash it and the merge table use.
//!
//! Keys come from the model file, not from users, so a fast non-cryptographic hash (the
//! multiply-rotate scheme of rustc's `FxHasher`) is enough: building Gemma 3's 262,144-
//! token index is on the path to the first generated token.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

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

    fn finish(&self) -> u64 {
        self.hash
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
pub(super) struct TokenIndex {
    slots: Vec<u32>,
    /// `64 - log2(slots.len())`: the slot is the hash's top bits, where multiply-rotate
    /// hashing puts its entropy.
    shift: u32,
}

impl TokenIndex {
    /// Indexes `texts`; on two equal texts returns the ids of both.
    pub fn new(texts: &[String]) -> Result<TokenIndex, (TokenId, TokenId)> {
        // At most half full, at least 2 slots.
        let n_slots = (texts.len() * 2).next_power_of_two().max(2);
        let mut index = TokenIndex {
            slots: vec![EMPTY; n_slots],
            shift: 64 - n_slots.trailing_zeros(),
        };
        let mask = n_slots - 1;
        for (id, text) in texts.iter().enumerate() {
            let mut slot = index.first_slot(text);
            loop {
                match index.slots[slot] {
                    EMPTY => {
                        // Ids fit in u32: the caller checked the vocabulary's size.
                        index.slots[slot] = id as u32;
                        break;
                    }
                    other if texts[other as usize] == *text => return Err((other, id as u32)),
                    _ => slot = (slot + 1) & mask,
                }
            }
        }
        Ok(index)
    }

    fn first_slot(&self, text: &str) -> usize {
        (hash_text(text) >> self.shift) as usize
    }

    /// The id whose text in `texts` (the same texts the index was built from) is `text`.
    pub fn get(&self, texts: &[String], text: &str) -> Option<TokenId> {
        let mask = self.slots.len() - 1;
        let mut slot = self.first_slot(text);
        loop {
            match self.slots[slot] {
                EMPTY => return None,
                id if texts[id as usize] == text => return Some(id),
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
        let texts: Vec<String> = (0..1000)
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
    fn reports_duplicates() {
        let texts: Vec<String> = ["x", "y", "x"].iter().map(|s| s.to_string()).collect();
        assert_eq!(TokenIndex::new(&texts).err(), Some((0, 2)));
        let one = vec!["only".to_string()];
        assert_eq!(TokenIndex::new(&one).unwrap().get(&one, "only"), Some(0));
    }
}
