//! The KV pool the scheduler's sequences share: keys and values of every layer in blocks
//! of a fixed number of positions, handed to sequences one block at a time.
//!
//! No sequence owns a fixed slice of the context: a sequence holds a table of block ids
//! that grows as it does, so a short request takes little and a long one can use what
//! the others leave. A full block is registered under its content (the block before it
//! and its tokens), so a later request whose prompt starts with the same tokens takes
//! the same blocks instead of computing them again, whoever computed them. Shared blocks
//! are full, so they are never written again; a block whose last holder lets go stays
//! registered (and reusable) until its memory is needed, least recently used first,
//! leaves of the prefix tree before the blocks they extend.

use std::collections::HashMap;

use crate::config::ModelConfig;
use crate::kv_type::{KvTypes, RowStore};
use crate::ops::CacheRows;

/// A block's id: its index in the pool.
pub(crate) type BlockId = u32;

/// What identifies a full block's contents: the block before it (none for the first)
/// and its tokens. Two sequences whose blocks have equal keys hold equal keys and values
/// there, since each position depends only on the tokens up to it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct BlockKey {
    parent: Option<BlockId>,
    tokens: Vec<u32>,
}

#[derive(Clone, Debug, Default)]
struct BlockState {
    /// Sequences whose table holds this block.
    holders: u32,
    /// Set while the block is registered for reuse.
    key: Option<BlockKey>,
    /// Registered blocks whose parent is this one.
    children: u32,
    /// When a sequence last took or released it (a step counter).
    last_used: u64,
}

/// Keys and values of `n_blocks × block_size` positions for every layer.
pub(crate) struct KvPool {
    block_size: usize,
    k_dim: usize,
    v_dim: usize,
    keys: Vec<RowStore>,
    values: Vec<RowStore>,
    types: KvTypes,
    blocks: Vec<BlockState>,
    /// Unregistered blocks no sequence holds.
    free: Vec<BlockId>,
    registry: HashMap<BlockKey, BlockId>,
    clock: u64,
}

impl KvPool {
    /// A pool of at least `positions` positions (whole blocks) for `config`'s model.
    /// Memory is reserved at once but only touched as blocks are used.
    /// Keys and values are stored at `types` (checked by the caller).
    pub(crate) fn for_model(
        config: &ModelConfig,
        positions: usize,
        block_size: usize,
        types: KvTypes,
    ) -> KvPool {
        KvPool::new(
            config.n_layers,
            config.n_kv_heads * config.head_dim,
            config.n_kv_heads * config.head_dim_v,
            positions,
            block_size,
            types,
        )
    }

    fn new(
        n_layers: usize,
        k_dim: usize,
        v_dim: usize,
        positions: usize,
        block_size: usize,
        types: KvTypes,
    ) -> KvPool {
        let block_size = block_size.max(1);
        let n_blocks = positions.div_ceil(block_size).max(1);
        let slots = n_blocks * block_size;
        KvPool {
            block_size,
            k_dim,
            v_dim,
            keys: (0..n_layers)
                .map(|_| RowStore::zeroed(types.k, k_dim, slots))
                .collect(),
            values: (0..n_layers)
                .map(|_| RowStore::zeroed(types.v, v_dim, slots))
                .collect(),
            types,
            blocks: vec![BlockState::default(); n_blocks],
            free: (0..n_blocks as BlockId).rev().collect(),
            registry: HashMap::new(),
            clock: 0,
        }
    }

    /// Frees the keys and values held in host memory, when another device holds them
    /// (the block books stay: the same ids name the same blocks there).
    pub(crate) fn drop_storage(&mut self) {
        self.keys = Vec::new();
        self.values = Vec::new();
    }

    pub(crate) fn block_size(&self) -> usize {
        self.block_size
    }

    pub(crate) fn n_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks some sequence holds.
    pub(crate) fn blocks_in_use(&self) -> usize {
        self.blocks.iter().filter(|b| b.holders > 0).count()
    }

    /// Blocks kept only for reuse (no holder, registered).
    pub(crate) fn blocks_cached(&self) -> usize {
        self.blocks
            .iter()
            .filter(|b| b.holders == 0 && b.key.is_some())
            .count()
    }

    /// Blocks a new allocation could take: free ones and cached ones.
    pub(crate) fn blocks_available(&self) -> usize {
        self.blocks.iter().filter(|b| b.holders == 0).count()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// A block for a sequence to write into: a free one, else the least recently used
    /// cached leaf, which is forgotten. `None` when every block is held.
    pub(crate) fn allocate(&mut self) -> Option<BlockId> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let victim = self
                    .blocks
                    .iter()
                    .enumerate()
                    .filter(|(_, b)| b.holders == 0 && b.key.is_some() && b.children == 0)
                    .min_by_key(|(_, b)| b.last_used)
                    .map(|(i, _)| i as BlockId)?;
                self.unregister(victim);
                victim
            }
        };
        let now = self.tick();
        let block = &mut self.blocks[id as usize];
        block.holders = 1;
        block.last_used = now;
        Some(id)
    }

    fn unregister(&mut self, id: BlockId) {
        if let Some(key) = self.blocks[id as usize].key.take() {
            self.registry.remove(&key);
            if let Some(parent) = key.parent {
                self.blocks[parent as usize].children -= 1;
            }
        }
    }

    /// Lets go of a block a sequence held. A registered block stays for reuse.
    pub(crate) fn release(&mut self, id: BlockId) {
        let now = self.tick();
        let block = &mut self.blocks[id as usize];
        block.holders = block.holders.saturating_sub(1);
        block.last_used = now;
        if block.holders == 0 && block.key.is_none() {
            self.free.push(id);
        }
    }

    /// The registered block after `parent` holding `tokens` (a whole block), taken for
    /// one more holder.
    pub(crate) fn take_cached(
        &mut self,
        parent: Option<BlockId>,
        tokens: &[u32],
    ) -> Option<BlockId> {
        let key = BlockKey {
            parent,
            tokens: tokens.to_vec(),
        };
        let id = *self.registry.get(&key)?;
        let now = self.tick();
        let block = &mut self.blocks[id as usize];
        block.holders += 1;
        block.last_used = now;
        Some(id)
    }

    /// Registers a full block a sequence computed, after `parent` (which must itself be
    /// registered, or `None` for a sequence's first block). Nothing happens when an equal
    /// block is registered already or the parent is not.
    pub(crate) fn register(&mut self, id: BlockId, parent: Option<BlockId>, tokens: &[u32]) {
        debug_assert_eq!(tokens.len(), self.block_size);
        if self.blocks[id as usize].key.is_some() {
            return;
        }
        if let Some(p) = parent {
            if self.blocks[p as usize].key.is_none() {
                return;
            }
        }
        let key = BlockKey {
            parent,
            tokens: tokens.to_vec(),
        };
        if self.registry.contains_key(&key) {
            return;
        }
        self.registry.insert(key.clone(), id);
        if let Some(p) = parent {
            self.blocks[p as usize].children += 1;
        }
        self.blocks[id as usize].key = Some(key);
    }

    /// Whether `id` is registered for reuse.
    #[cfg(test)]
    pub(crate) fn is_registered(&self, id: BlockId) -> bool {
        self.blocks[id as usize].key.is_some()
    }

    /// Stores `layer`'s keys and values of consecutive positions from `first_pos` of the
    /// sequence whose blocks are `table`, at the pool's precisions (as [`crate::KvCache`]
    /// stores them).
    pub(crate) fn write(
        &mut self,
        layer: usize,
        table: &[BlockId],
        first_pos: usize,
        keys: &[f32],
        values: &[f32],
    ) {
        let (bs, kd, vd) = (self.block_size, self.k_dim, self.v_dim);
        let n = keys.len() / kd.max(1);
        for i in 0..n {
            let pos = first_pos + i;
            let slot = table[pos / bs] as usize * bs + pos % bs;
            self.keys[layer].write(slot, &keys[i * kd..(i + 1) * kd]);
            self.values[layer].write(slot, &values[i * vd..(i + 1) * vd]);
        }
    }

    /// Every row of `layer`'s keys and values; a sequence's position `j` is in row
    /// `table[j / block_size] * block_size + j % block_size`.
    pub(crate) fn layer(&self, layer: usize) -> (CacheRows<'_>, CacheRows<'_>) {
        (self.keys[layer].view(), self.values[layer].view())
    }

    /// The precisions keys and values are stored at.
    pub(crate) fn types(&self) -> KvTypes {
        self.types
    }

    /// Copies `layer`'s keys and values of positions `0..len` of the sequence whose
    /// blocks are `table` into `keys` and `values`, in position order.
    #[cfg(test)]
    pub(crate) fn gather(
        &self,
        layer: usize,
        table: &[BlockId],
        len: usize,
        keys: &mut Vec<f32>,
        values: &mut Vec<f32>,
    ) {
        let bs = self.block_size;
        keys.clear();
        values.clear();
        let mut left = len;
        for &block in table {
            if left == 0 {
                break;
            }
            let n = left.min(bs);
            let start = block as usize * bs;
            for row in start..start + n {
                self.keys[layer].extend_row(row, keys);
                self.values[layer].extend_row(row, values);
            }
            left -= n;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_type::KvType;
    use crate::ops::round_f16;

    fn pool(n_blocks: usize) -> KvPool {
        KvPool::new(2, 3, 2, n_blocks * 4, 4, KvTypes::default())
    }

    #[test]
    fn released_blocks_come_back_and_full_pools_say_so() {
        let mut p = pool(2);
        let a = p.allocate().expect("a free block");
        let b = p.allocate().expect("a second free block");
        assert_ne!(a, b);
        assert_eq!(p.allocate(), None);
        assert_eq!(p.blocks_in_use(), 2);
        p.release(a);
        assert_eq!(p.allocate(), Some(a));
    }

    #[test]
    fn registered_blocks_are_found_by_prefix_and_evicted_leaf_first() {
        let mut p = pool(3);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        p.register(a, None, &[1, 2, 3, 4]);
        p.register(b, Some(a), &[5, 6, 7, 8]);
        p.release(a);
        p.release(b);
        assert_eq!(p.blocks_cached(), 2);
        // The same prefix finds the same blocks; another does not.
        assert_eq!(p.take_cached(None, &[1, 2, 3, 4]), Some(a));
        assert_eq!(p.take_cached(Some(a), &[5, 6, 7, 9]), None);
        p.release(a);
        // The free block goes first, then the leaf (b), never a parent before its child.
        let c = p.allocate().unwrap();
        assert!(c != a && c != b);
        assert_eq!(p.allocate(), Some(b));
        assert!(p.is_registered(a));
        assert_eq!(p.take_cached(Some(a), &[5, 6, 7, 8]), None);
        assert_eq!(p.allocate(), Some(a));
        assert!(!p.is_registered(a));
        assert_eq!(p.take_cached(None, &[1, 2, 3, 4]), None);
    }

    #[test]
    fn writes_round_to_f16_and_gather_in_position_order() {
        let mut p = pool(2);
        let (a, b) = (p.allocate().unwrap(), p.allocate().unwrap());
        // The second block first in the table: gathering follows the table.
        let table = [b, a];
        let (kd, vd) = (p.k_dim, p.v_dim);
        let n = 6;
        let keys: Vec<f32> = (0..n * kd).map(|i| i as f32 + 0.1).collect();
        let values: Vec<f32> = (0..n * vd).map(|i| -(i as f32)).collect();
        p.write(0, &table, 0, &keys, &values);
        let (mut k, mut v) = (Vec::new(), Vec::new());
        p.gather(0, &table, n, &mut k, &mut v);
        assert_eq!(k, keys.iter().map(|&x| round_f16(x)).collect::<Vec<_>>());
        assert_eq!(v, values);
    }

    #[test]
    fn quantized_pools_write_whole_rows_in_their_slots() {
        let types = KvTypes {
            k: KvType::Q8_0,
            v: KvType::Q4_0,
        };
        let mut p = KvPool::new(1, 32, 64, 8, 4, types);
        let (a, b) = (p.allocate().unwrap(), p.allocate().unwrap());
        let table = [b, a];
        let keys: Vec<f32> = (0..6 * 32).map(|i| (i as f32 * 0.37).sin()).collect();
        let values: Vec<f32> = (0..6 * 64).map(|i| (i as f32 * 0.11).cos()).collect();
        p.write(0, &table, 0, &keys, &values);
        let (mut k, mut v) = (Vec::new(), Vec::new());
        p.gather(0, &table, 6, &mut k, &mut v);
        // Each value within a step of its block: 127 steps of q8_0, 8 of q4_0.
        for (rows, back, dim, steps) in [(&keys, &k, 32, 127.0), (&values, &v, 64, 8.0)] {
            assert_eq!(back.len(), rows.len());
            for (x, y) in rows.chunks(32).zip(back.chunks(32)) {
                let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                for (a, b) in x.iter().zip(y) {
                    assert!((a - b).abs() <= amax / steps * 1.01, "dim {dim}: {a} {b}");
                }
            }
        }
        assert_eq!(p.types(), types);
    }
}
