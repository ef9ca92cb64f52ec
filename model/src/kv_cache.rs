//! The key/value cache of the attention layers.

use crate::config::ModelConfig;
use crate::ops::{round_f16, AttentionMethod};
use crate::ModelError;

/// Keys and values of every layer for the positions processed so far.
///
/// Values are rounded to f16 precision as they are stored, the precision of llama.cpp's
/// default cache, but kept in f32 so the attention's dot products need no conversion.
/// Per layer, position `p`'s keys are `k[p * kv_dim .. (p + 1) * kv_dim]`, heads side by
/// side; values likewise. Memory is reserved up front for `capacity` positions so the
/// decode loop never reallocates.
#[derive(Clone, Debug)]
pub struct KvCache {
    capacity: usize,
    len: usize,
    k_dim: usize,
    v_dim: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    attention: AttentionMethod,
    /// The context a run of this cache stands for (at least `capacity`).
    context: usize,
}

impl KvCache {
    /// An empty cache for `capacity` positions of `config`'s model.
    pub fn new(config: &ModelConfig, capacity: usize) -> KvCache {
        let k_dim = config.n_kv_heads * config.head_dim;
        let v_dim = config.n_kv_heads * config.head_dim_v;
        KvCache {
            capacity,
            len: 0,
            k_dim,
            v_dim,
            keys: (0..config.n_layers)
                .map(|_| Vec::with_capacity(capacity * k_dim))
                .collect(),
            values: (0..config.n_layers)
                .map(|_| Vec::with_capacity(capacity * v_dim))
                .collect(),
            attention: AttentionMethod::default(),
            context: capacity,
        }
    }

    /// The same cache computing attention as `method` says (a context setting in
    /// llama.cpp too: `-fa on|off`). Flash attention unless set.
    pub fn with_attention(mut self, method: AttentionMethod) -> KvCache {
        self.attention = method;
        self
    }

    /// How attention over this cache is computed.
    pub fn attention(&self) -> AttentionMethod {
        self.attention
    }

    /// The same cache standing for a run whose context holds `context` positions,
    /// more than the cache itself when a caller sizes the cache to what one request
    /// needs. Flash attention's view of the cache is bounded by the context (as
    /// llama.cpp's is by `-c`); values below the capacity are ignored.
    pub fn with_context(mut self, context: usize) -> KvCache {
        self.context = context.max(self.capacity);
        self
    }

    /// The context size this cache stands for.
    pub fn context(&self) -> usize {
        self.context
    }

    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True before the first token.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Most positions the cache holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forgets every position, keeping the memory.
    pub fn clear(&mut self) {
        self.len = 0;
        self.keys.iter_mut().for_each(Vec::clear);
        self.values.iter_mut().for_each(Vec::clear);
    }

    /// Refuses a batch of `n` more positions that would not fit.
    pub(crate) fn check_room(&self, n: usize) -> Result<(), ModelError> {
        let needed = self.len + n;
        if needed > self.capacity {
            return Err(ModelError::ContextFull {
                needed,
                capacity: self.capacity,
            });
        }
        Ok(())
    }

    /// Appends `n` positions' keys and values for `layer`.
    pub(crate) fn append(&mut self, layer: usize, keys: &[f32], values: &[f32]) {
        debug_assert_eq!(keys.len() / self.k_dim, values.len() / self.v_dim);
        self.keys[layer].extend(keys.iter().map(|&v| round_f16(v)));
        self.values[layer].extend(values.iter().map(|&v| round_f16(v)));
    }

    /// Marks `n` positions appended to every layer as stored.
    pub(crate) fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// Every stored key and value of `layer`, the batch in flight included.
    pub(crate) fn layer(&self, layer: usize) -> (&[f32], &[f32]) {
        (&self.keys[layer], &self.values[layer])
    }

    /// Drops positions past `len` (for a batch that failed half-way).
    pub(crate) fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        for k in &mut self.keys {
            k.truncate(len * self.k_dim);
        }
        for v in &mut self.values {
            v.truncate(len * self.v_dim);
        }
    }
}
