//! The key/value cache of the attention layers.

use crate::config::ModelConfig;
use crate::kv_type::{KvTypes, RowStore};
use crate::ops::AttentionMethod;
use crate::ops::CacheRows;
use crate::ModelError;

/// Keys and values of every layer for the positions processed so far.
///
/// By default values are rounded to f16 precision as they are stored, the precision of
/// llama.cpp's default cache, but kept in f32 so the attention's dot products need no
/// conversion; [`KvCache::with_types`] stores them in `Q8_0` or `Q4_0` blocks instead.
/// Per layer, position `p`'s keys are row `p`, heads side by side; values likewise.
/// Memory is reserved up front for `capacity` positions so the decode loop never
/// reallocates.
#[derive(Clone, Debug)]
pub struct KvCache {
    capacity: usize,
    len: usize,
    k_dim: usize,
    v_dim: usize,
    keys: Vec<RowStore>,
    values: Vec<RowStore>,
    types: KvTypes,
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
            keys: Vec::new(),
            values: Vec::new(),
            types: KvTypes::default(),
            attention: AttentionMethod::default(),
            context: capacity,
        }
        .stored(config.n_layers)
    }

    /// Reserves the layers' rows at the cache's types.
    fn stored(mut self, n_layers: usize) -> KvCache {
        let (cap, types) = (self.capacity, self.types);
        self.keys = (0..n_layers)
            .map(|_| RowStore::with_capacity(types.k, self.k_dim, cap))
            .collect();
        self.values = (0..n_layers)
            .map(|_| RowStore::with_capacity(types.v, self.v_dim, cap))
            .collect();
        self.len = 0;
        self
    }

    /// The same cache, empty, storing keys and values at `types` (llama.cpp's
    /// `--cache-type-k/-v`), or an error when `config`'s model or the cache's attention
    /// method cannot take them ([`KvTypes::check`]).
    pub fn with_types(self, config: &ModelConfig, types: KvTypes) -> Result<KvCache, ModelError> {
        types.check(config, self.attention)?;
        let n_layers = self.keys.len();
        Ok(KvCache { types, ..self }.stored(n_layers))
    }

    /// The precisions keys and values are stored at.
    pub fn types(&self) -> KvTypes {
        self.types
    }

    /// The same cache computing attention as `method` says (a context setting in
    /// llama.cpp too: `-fa on|off`). Flash attention unless set; a quantized cache
    /// (checked against the method by [`KvCache::with_types`]) always takes it.
    pub fn with_attention(mut self, method: AttentionMethod) -> KvCache {
        self.attention = method;
        self
    }

    /// How attention over this cache is computed.
    pub fn attention(&self) -> AttentionMethod {
        match self.types.is_quantized() {
            true => AttentionMethod::Flash,
            false => self.attention,
        }
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
        self.keys.iter_mut().for_each(RowStore::clear);
        self.values.iter_mut().for_each(RowStore::clear);
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
        self.keys[layer].push(keys);
        self.values[layer].push(values);
    }

    /// Marks `n` positions appended to every layer as stored.
    pub(crate) fn commit(&mut self, n: usize) {
        self.len += n;
    }

    /// Every stored key and value of `layer`, the batch in flight included.
    pub(crate) fn layer(&self, layer: usize) -> (CacheRows<'_>, CacheRows<'_>) {
        (self.keys[layer].view(), self.values[layer].view())
    }

    /// Every stored key and value of `layer` of an f16 cache, as f32; `None` when the
    /// cache is quantized.
    pub(crate) fn layer_f16(&self, layer: usize) -> Option<(&[f32], &[f32])> {
        match self.layer(layer) {
            (CacheRows::F16(k), CacheRows::F16(v)) => Some((k, v)),
            _ => None,
        }
    }

    /// The keys of position `pos` in layer `layer`, decoded to f32 (every KV head side
    /// by side), or `None` past the positions held.
    pub fn key(&self, layer: usize, pos: usize) -> Option<Vec<f32>> {
        let rows = self.keys.get(layer)?;
        (pos < self.len).then(|| {
            let mut out = vec![0.0; self.k_dim];
            rows.read(pos, &mut out);
            out
        })
    }

    /// Removes positions `range` of every layer, moving the later ones down (their keys
    /// need their RoPE turned back by as many positions: [`crate::Model::shift_cache`]).
    pub(crate) fn remove_positions(&mut self, range: std::ops::Range<usize>) {
        let range = range.start.min(self.len)..range.end.min(self.len);
        for rows in self.keys.iter_mut().chain(&mut self.values) {
            rows.remove_rows(range.clone());
        }
        self.len -= range.len();
    }

    /// The key rows of `layer`, to rewrite.
    pub(crate) fn keys_mut(&mut self, layer: usize) -> &mut RowStore {
        &mut self.keys[layer]
    }

    /// Drops positions past `len` (for a batch that failed half-way).
    pub(crate) fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
        for rows in self.keys.iter_mut().chain(&mut self.values) {
            rows.truncate(len);
        }
    }
}
