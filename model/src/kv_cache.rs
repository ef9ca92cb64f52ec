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
    /// After a context shift, where llama.cpp's cache holds each position.
    cells: Option<Cells>,
}

/// The cells of llama.cpp's cache for one sequence, as its allocator fills them: a
/// context shift frees cells in the middle, and later tokens take the free cells from
/// the first, so the cells stop following the positions. Flash attention's sums follow
/// the cells: keeping them is what keeps the logits llama.cpp's past a shift.
#[derive(Clone, Debug)]
struct Cells {
    /// The position each cell holds, `-1` when empty (the context rounded up to whole
    /// `KV_PAD`s of cells, as llama.cpp sizes its cache).
    pos: Vec<i32>,
    /// Where the search for a free cell starts.
    head: usize,
    /// Positions `0..placed` have their cell.
    placed: usize,
    /// One past the last occupied cell.
    end: usize,
}

impl Cells {
    /// Cells for `len` positions placed in order from the first cell, as they are before
    /// any shift, in a cache of `context` positions.
    fn in_order(len: usize, context: usize) -> Cells {
        let n = context.div_ceil(crate::ops::KV_PAD) * crate::ops::KV_PAD;
        let mut pos = vec![-1; n.max(len)];
        for (p, cell) in pos.iter_mut().enumerate().take(len) {
            *cell = p as i32;
        }
        Cells {
            pos,
            head: len,
            placed: len,
            end: len,
        }
    }

    /// Counts the cells up to the last occupied one again, after some were emptied.
    fn settle(&mut self) {
        self.end = self.pos.iter().rposition(|&p| p >= 0).map_or(0, |i| i + 1);
    }

    /// Empties the cells of positions `range` (llama.cpp's `seq_rm`): the search
    /// starts again at the first one freed, when it is before the head.
    fn remove(&mut self, range: std::ops::Range<usize>) {
        let mut first = None;
        for (i, p) in self.pos.iter_mut().enumerate() {
            if *p >= 0 && range.contains(&(*p as usize)) {
                *p = -1;
                first.get_or_insert(i);
            }
        }
        if let Some(first) = first.filter(|&f| f < self.head) {
            self.head = first;
        }
        self.placed = self.placed.min(range.start);
        self.settle();
    }

    /// Moves positions `from..` down by `by` (llama.cpp's `seq_add`, which starts the
    /// next search at the first cell).
    fn move_down(&mut self, from: usize, by: usize) {
        for p in self.pos.iter_mut() {
            if *p >= 0 && *p as usize >= from {
                *p -= by as i32;
            }
        }
        self.head = 0;
    }

    /// Cells for positions `placed..end`, one batch, as llama.cpp's `find_slot` and
    /// `apply_ubatch` take them: from the head (or the first cell, when the head is
    /// past the used cells by more than two a token), the free ones in order, wrapping.
    fn place(&mut self, end: usize) {
        if end <= self.placed {
            return;
        }
        let n_tokens = end - self.placed;
        // The cells in use are those of positions `0..placed`, one each.
        let used = self.placed;
        let mut head = self.head;
        if head > used + 2 * n_tokens {
            head = 0;
        }
        let mut last = head;
        for p in self.placed..end {
            // A free cell exists: the cache holds the context.
            for _ in 0..=self.pos.len() {
                if head >= self.pos.len() {
                    head = 0;
                }
                let cell = head;
                head += 1;
                if self.pos[cell] < 0 {
                    self.pos[cell] = p as i32;
                    last = cell;
                    self.end = self.end.max(cell + 1);
                    break;
                }
            }
        }
        self.head = last + 1;
        self.placed = end;
    }
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
            cells: None,
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
        self.cells = None;
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
        self.cells = None;
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
    /// need their RoPE turned back by as many positions: [`crate::Model::shift_cache`]),
    /// and from then on keeps the cells llama.cpp's cache would hold them in.
    pub(crate) fn remove_positions(&mut self, range: std::ops::Range<usize>) {
        let range = range.start.min(self.len)..range.end.min(self.len);
        for rows in self.keys.iter_mut().chain(&mut self.values) {
            rows.remove_rows(range.clone());
        }
        let (len, context) = (self.len, self.context);
        let cells = self
            .cells
            .get_or_insert_with(|| Cells::in_order(len, context));
        cells.remove(range.clone());
        cells.move_down(range.end, range.len());
        self.len -= range.len();
        cells.placed = self.len;
    }

    /// After a context shift, gives the `n` positions being added their cells in
    /// llama.cpp's cache (once per batch: later calls find them placed).
    pub(crate) fn place(&mut self, n: usize) {
        let end = self.len + n;
        if let Some(cells) = &mut self.cells {
            cells.place(end);
        }
    }

    /// After a context shift, the position each cell of llama.cpp's cache holds (`-1`:
    /// empty), up to the last occupied one (the cells llama.cpp's attention views);
    /// `None` before any shift (the cells then follow the positions).
    pub(crate) fn cells(&self) -> Option<&[i32]> {
        self.cells.as_ref().map(|cells| &cells.pos[..cells.end])
    }

    /// The key rows of `layer`, to rewrite.
    pub(crate) fn keys_mut(&mut self, layer: usize) -> &mut RowStore {
        &mut self.keys[layer]
    }

    /// Drops positions past `len` (for a batch that failed half-way).
    pub(crate) fn truncate(&mut self, len: usize) {
        if let Some(cells) = &mut self.cells {
            cells.remove(len..usize::MAX);
        }
        self.len = self.len.min(len);
        for rows in self.keys.iter_mut().chain(&mut self.values) {
            rows.truncate(len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Cells;

    /// llama.cpp's cells through a shift of a full 256-cell cache: the freed cells are
    /// taken first, then the last free one, and a second shift frees the cells of the
    /// oldest positions wherever they are.
    #[test]
    fn cells_follow_llama_cpp_s_allocator() {
        let mut cells = Cells::in_order(255, 200);
        assert_eq!(cells.pos.len(), 256);
        // Keep 4, drop 125 of the 251 after them.
        cells.remove(4..129);
        cells.move_down(129, 125);
        cells.placed = 130;
        assert_eq!(cells.pos[129], 4);
        assert_eq!(cells.pos[254], 129);
        cells.place(131);
        assert_eq!(cells.pos[4], 130, "the first freed cell");
        cells.place(255);
        assert_eq!(cells.pos[128], 254);
        assert_eq!(cells.pos[255], -1, "not reached yet");
        cells.place(256);
        assert_eq!(cells.pos[255], 255);
        // The second shift drops positions 4..129, the cells 129..254.
        cells.remove(4..129);
        cells.move_down(129, 125);
        cells.placed = 131;
        assert!(cells.pos[129..254].iter().all(|&p| p == -1));
        assert_eq!(cells.pos[254], 4);
        assert_eq!(cells.pos[4], 5);
        assert_eq!(cells.end, 256, "the last cell holds a position");
        cells.place(132);
        assert_eq!(cells.pos[129], 131);
    }
}
