//! Paged batches: the new tokens of several sequences in one pass over the shared
//! cache of blocks, laid out in device memory, and their decode steps' graphs.

use super::forward::{self, Layout, PagedBatch, PagedSegment};
use super::kernels;
use super::pass::End;
use super::{BatchSegment, GpuModel, MAX_BATCH};
use crate::constraint::TokenMask;
use crate::ModelError;

impl GpuModel {
    /// Runs the new tokens of several sequences in one pass over the paged cache (see
    /// [`GpuModel::with_pages`]), writing their keys and values into their blocks, and
    /// returns the logits of each segment that asks for them (`n_vocab` each, in the
    /// segments' order). At most `prompt_batch` tokens and `max_sequences` segments;
    /// every table must cover its segment's positions with blocks of the cache.
    pub fn forward_batch(&mut self, segments: &[BatchSegment<'_>]) -> Result<&[f32], ModelError> {
        let m = self.eval_batch(segments, BatchOut::Logits)?;
        self.logits(m)
    }

    /// Runs the new tokens of several sequences as [`GpuModel::forward_batch`] does and
    /// returns every token's last hidden state after the final norm, `n_embd` per token
    /// in the segments' order, whatever their `logits` (no output product runs). The
    /// residual rows come back from the device and take the final norm on the host, as
    /// [`crate::Model::hidden_states`] computes it.
    pub fn forward_batch_hidden(
        &mut self,
        segments: &[BatchSegment<'_>],
    ) -> Result<Vec<f32>, ModelError> {
        let segments = without_logits(segments);
        self.eval_batch(&segments, BatchOut::Logits)?;
        self.hidden_rows(segments.iter().map(|s| s.tokens.len()).sum())
    }

    /// The first `n` rows of the residual stream, after the final norm, on the host.
    pub(super) fn hidden_rows(&self, n: usize) -> Result<Vec<f32>, ModelError> {
        let mut rows = vec![0f32; n * self.config.n_embd];
        let x = self.bufs.x_view(rows.len())?;
        self.stream
            .read_to_host(x, &mut rows)
            .map_err(|source| ModelError::Gpu {
                op: "reading the hidden states",
                source,
            })?;
        crate::cpu::final_norm(&self.config, &self.plan, &mut rows)?;
        Ok(rows)
    }

    /// As [`GpuModel::forward_batch`], returning the greedy token (the first highest
    /// logit, taken on the device) of each segment that asks for logits.
    pub fn forward_batch_argmax(
        &mut self,
        segments: &[BatchSegment<'_>],
    ) -> Result<Vec<u32>, ModelError> {
        let m = self.eval_batch(segments, BatchOut::Tokens)?;
        Ok(self.greedy_tokens(m)?.to_vec())
    }

    /// As [`GpuModel::forward_batch_argmax`], each row's logits first added `biases`
    /// on the device: `(row, token, bias)`, `row` counting the segments that ask for
    /// logits, at most one entry per row and token. The greedy token of each biased row,
    /// the same as adding the biases to [`GpuModel::forward_batch`]'s rows (f32 adds) and
    /// taking their first highest logit; only the tokens come back.
    pub fn forward_batch_argmax_biased(
        &mut self,
        segments: &[BatchSegment<'_>],
        biases: &[(usize, u32, f32)],
    ) -> Result<Vec<u32>, ModelError> {
        if biases.is_empty() {
            return self.forward_batch_argmax(segments);
        }
        self.launch_batch(segments)?.argmax(biases, &[])
    }

    /// Queues the pass of [`GpuModel::forward_batch`] and returns while the device runs
    /// it: the host is free for other work (a grammar's masks for these very rows) until
    /// it asks the [`LaunchedBatch`] for the results.
    pub fn launch_batch(
        &mut self,
        segments: &[BatchSegment<'_>],
    ) -> Result<LaunchedBatch<'_>, ModelError> {
        let rows = self.eval_batch(segments, BatchOut::OnDevice)?;
        Ok(LaunchedBatch { gpu: self, rows })
    }

    /// Checks a batch against the cache, lays it out in device memory, runs it and
    /// copies back its logits or greedy tokens, as `out` says: returns how many rows.
    fn eval_batch(
        &mut self,
        segments: &[BatchSegment<'_>],
        out: BatchOut,
    ) -> Result<usize, ModelError> {
        let argmax = out == BatchOut::Tokens;
        let batch = self.lay_out_batch(segments)?;
        self.run_batch(&batch, argmax)?;
        self.finish_batch(&batch, out)
    }

    /// What [`GpuModel::eval_batch`] hands back once `batch` has run: its rows of
    /// logits or greedy tokens copied back, as `out` says, and how many there are.
    pub(super) fn finish_batch(
        &mut self,
        batch: &PagedBatch,
        out: BatchOut,
    ) -> Result<usize, ModelError> {
        let m = batch.n_logits;
        if m == 0 {
            return self.sync().map(|()| 0);
        }
        if out != BatchOut::OnDevice {
            self.copy_rows_back(m, out == BatchOut::Tokens)?;
        }
        Ok(m)
    }

    /// Checks a batch against the cache and lays it out in device memory: its tokens,
    /// positions, tables and rows of logits.
    pub(super) fn lay_out_batch(
        &mut self,
        segments: &[BatchSegment<'_>],
    ) -> Result<PagedBatch, ModelError> {
        let bad = |what: String| Err(ModelError::InvalidBatch(what));
        let Some((shape, _)) = &self.pages else {
            return bad("the model was set up without a paged cache (GpuModel::with_pages)".into());
        };
        let shape = *shape;
        let bs = 1usize << shape.block_shift;
        let n: usize = segments.iter().map(|s| s.tokens.len()).sum();
        let room = self.prompt_batch.max(MAX_BATCH);
        if n == 0 {
            return Err(ModelError::EmptyInput);
        }
        if n > room {
            return bad(format!("{n} tokens, but a batch holds at most {room}"));
        }
        let live = segments.iter().filter(|s| !s.tokens.is_empty()).count();
        if live > shape.max_sequences {
            return bad(format!(
                "{live} sequences, but a batch holds at most {}",
                shape.max_sequences
            ));
        }
        let mut batch = PagedBatch {
            segments: Vec::with_capacity(live),
            n_tokens: n,
            n_logits: 0,
            block_shift: shape.block_shift,
        };
        let (mut positions, mut starts, mut rows, mut tables) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::new(),
            Vec::new(),
        );
        for (i, seg) in segments.iter().enumerate() {
            if seg.tokens.is_empty() {
                continue;
            }
            let end = seg.first_pos + seg.tokens.len();
            if end > self.capacity {
                return Err(ModelError::ContextFull {
                    needed: end,
                    capacity: self.capacity,
                });
            }
            let blocks = end.div_ceil(bs);
            if seg.table.len() < blocks {
                return bad(format!(
                    "sequence {i} reaches position {} but its table holds {} blocks of {bs}",
                    end - 1,
                    seg.table.len()
                ));
            }
            if let Some(&id) = seg.table[..blocks]
                .iter()
                .find(|&&id| id as usize >= shape.n_blocks)
            {
                return bad(format!(
                    "sequence {i}'s table names block {id}, but the cache has {}",
                    shape.n_blocks
                ));
            }
            self.check_tokens(seg.tokens)?;
            let first_row = positions.len();
            batch.segments.push(PagedSegment {
                first_row,
                len: seg.tokens.len(),
                table_at: tables.len(),
                table_len: blocks,
            });
            for p in seg.first_pos..end {
                positions.push(p as i32);
                starts.push(tables.len() as i32);
            }
            if seg.logits {
                rows.push((first_row + seg.tokens.len() - 1) as i32);
            }
            tables.extend(seg.table[..blocks].iter().map(|&id| id as i32));
        }
        batch.n_logits = rows.len();
        // Host-side layout: [positions | table starts | logit rows | tables].
        let meta_len = 2 * n + rows.len() + tables.len();
        let gpu = |op| move |source| ModelError::Gpu { op, source };
        {
            let (_, host_meta) = self.pages.as_mut().expect("checked above");
            let host = host_meta.as_mut_slice().map_err(gpu("writing the batch"))?;
            let parts = [&positions[..], &starts[..], &rows[..], &tables[..]];
            let mut at = 0;
            for part in parts {
                host[at..at + part.len()].copy_from_slice(part);
                at += part.len();
            }
        }
        let tokens: Vec<u32> = segments
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        self.write_tokens(&tokens)?;
        {
            let (_, host_meta) = self.pages.as_mut().expect("checked above");
            let dst = self.bufs.meta_mut(meta_len)?;
            self.stream
                .copy_h2d_async(host_meta, 0..meta_len, dst)
                .map_err(gpu("copying the batch"))?;
        }
        Ok(batch)
    }

    /// Runs a batch laid out by [`GpuModel::lay_out_batch`] (a stage of a layer split
    /// without the head: its layers only).
    pub(super) fn run_batch(&mut self, batch: &PagedBatch, argmax: bool) -> Result<(), ModelError> {
        let n = batch.n_tokens;
        // A decode step's layout depends on its number of sequences only: the positions,
        // tables and rows are read from device memory, so one graph serves every step of
        // that many sequences.
        let decode_step = self.batch_graphs
            && !self.experts_pooled()
            && batch.n_logits == n
            && batch.segments.iter().all(|s| s.len == 1)
            && self.can_hold()?;
        if decode_step {
            self.replay_batch_step(batch, argmax)
        } else {
            self.run_layers(n, Layout::Paged(batch), End::Rows { argmax })
        }
    }

    /// A paged decode step (`batch`: one token of each sequence, every row's logits)
    /// through the graph captured for its number of sequences (capturing it the first
    /// time).
    fn replay_batch_step(&mut self, batch: &PagedBatch, argmax: bool) -> Result<(), ModelError> {
        let key = (batch.n_tokens, argmax);
        if !self.batch_steps.contains_key(&key) {
            let held = self.held.as_ref().expect("can_hold returned true");
            let (config, bufs) = (&self.config, &mut self.bufs);
            let graph = self.stream.capture(|stream| {
                let n = batch.n_tokens;
                let layout = Layout::Paged(batch);
                let globals = held.globals();
                forward::body(
                    config,
                    held.layers(),
                    globals,
                    bufs,
                    n,
                    layout,
                    stream,
                    None,
                )?;
                if globals.head.is_none() {
                    // A stage of a layer split that hands its residual stream on.
                    return Ok(());
                }
                forward::finish_rows(config, globals, bufs, batch, argmax, stream)
            })?;
            self.batch_steps.insert(key, graph);
        }
        self.batch_steps[&key]
            .launch(&self.stream)
            .map_err(|source| ModelError::Gpu {
                op: "replaying a batch's decode step",
                source,
            })
    }
}

/// A paged batch whose pass is queued on the device ([`GpuModel::launch_batch`]); its
/// logits stay there until it is asked for them or for its greedy tokens.
#[must_use = "the batch's results are read through it"]
pub struct LaunchedBatch<'g> {
    gpu: &'g mut GpuModel,
    rows: usize,
}

impl<'g> LaunchedBatch<'g> {
    /// The batch whose `rows` rows of logits `gpu` has on the device (a layer split's
    /// last stage).
    pub(super) fn of(gpu: &'g mut GpuModel, rows: usize) -> LaunchedBatch<'g> {
        LaunchedBatch { gpu, rows }
    }

    /// Its rows of logits: one for each segment that asked for them.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Waits for the pass and returns its logits (`n_vocab` a row, in the segments'
    /// order), as [`GpuModel::forward_batch`] does.
    pub fn logits(self) -> Result<&'g [f32], ModelError> {
        let gpu = self.gpu;
        if self.rows > 0 {
            gpu.copy_rows_back(self.rows, false)?;
        }
        gpu.logits(self.rows)
    }

    /// The greedy token of each row (its first highest logit), taken on the device after
    /// the row was added its `biases` (as [`GpuModel::forward_batch_argmax_biased`]) and
    /// then held to its mask: `masks` are `(row, mask)`, at most one a row, over the
    /// model's vocabulary; a token a row's mask does not allow is never its token. The
    /// same tokens as adding the biases to the rows, setting every masked logit to -inf
    /// ([`TokenMask::apply`]) and taking the first highest; only the tokens come back.
    /// A row with no logit above -inf (its mask allows nothing), or with a NaN or +inf,
    /// is an error ([`ModelError::BadLogits`]).
    pub fn argmax(
        self,
        biases: &[(usize, u32, f32)],
        masks: &[(usize, &TokenMask)],
    ) -> Result<Vec<u32>, ModelError> {
        let gpu = self.gpu;
        let m = self.rows;
        if m == 0 {
            return Ok(Vec::new());
        }
        let n_vocab = gpu.config.n_vocab;
        let extras = Extras::lay_out(m, n_vocab, biases, masks)?;
        gpu.add_extras(&extras, m)?;
        forward::argmax_rows(&gpu.config, &mut gpu.bufs, m, &gpu.stream)?;
        gpu.copy_rows_back(m, true)?;
        Ok(gpu.greedy_tokens(m)?.to_vec())
    }
}

/// A batch's biases and masks, laid out as the device takes them: one run of 32-bit
/// words, `[bias indices | bias values' bits | mask rows | masks' words]`.
struct Extras {
    staged: Vec<i32>,
    biases: usize,
    masks: usize,
}

impl Extras {
    /// Checks `biases` and `masks` against a batch of `rows` rows of `n_vocab` logits
    /// and lays them out.
    fn lay_out(
        rows: usize,
        n_vocab: usize,
        biases: &[(usize, u32, f32)],
        masks: &[(usize, &TokenMask)],
    ) -> Result<Extras, ModelError> {
        let bad = |what: String| Err(ModelError::InvalidBatch(what));
        let n_words = n_vocab.div_ceil(32);
        let mut staged = Vec::with_capacity(2 * biases.len() + masks.len() * (1 + n_words));
        for &(row, token, _) in biases {
            let index = row * n_vocab + token as usize;
            if row >= rows || token as usize >= n_vocab || index > i32::MAX as usize {
                return bad(format!(
                    "a bias of token {token} in row {row}, but the batch has {rows} rows of \
                     {n_vocab} logits"
                ));
            }
            staged.push(index as i32);
        }
        let mut distinct = staged.clone();
        distinct.sort_unstable();
        if distinct.windows(2).any(|w| w[0] == w[1]) {
            return bad("two biases of one token in one row".into());
        }
        staged.extend(biases.iter().map(|&(_, _, b)| b.to_bits() as i32));
        let mut masked = vec![false; rows];
        for &(row, mask) in masks {
            if row >= rows || mask.n_vocab() != n_vocab {
                return bad(format!(
                    "a mask of {} tokens for row {row}, but the batch has {rows} rows of \
                     {n_vocab} logits",
                    mask.n_vocab()
                ));
            }
            if std::mem::replace(&mut masked[row], true) {
                return bad(format!("two masks for row {row}"));
            }
            staged.push(row as i32);
        }
        for &(_, mask) in masks {
            staged.extend(mask.words().iter().map(|&w| w as i32));
        }
        Ok(Extras {
            staged,
            biases: biases.len(),
            masks: masks.len(),
        })
    }
}

impl GpuModel {
    /// Copies `extras` over and applies them to the first `m` rows of logits on the
    /// device: the biases added, then the masks.
    fn add_extras(&mut self, extras: &Extras, m: usize) -> Result<(), ModelError> {
        let len = extras.staged.len();
        if len == 0 {
            return Ok(());
        }
        let n_vocab = self.config.n_vocab;
        let gpu = |op| move |source| ModelError::Gpu { op, source };
        let room = match self.extras_room.take() {
            Some(room) if room.0.len() >= len => room,
            _ => {
                let size = len.next_power_of_two();
                (
                    self.device
                        .alloc_pinned::<i32>(size)
                        .map_err(gpu("pinned"))?,
                    self.device.alloc::<i32>(size).map_err(gpu("biases"))?,
                )
            }
        };
        let (host, device) = self.extras_room.insert(room);
        host.as_mut_slice().map_err(gpu("writing the biases"))?[..len]
            .copy_from_slice(&extras.staged);
        let view = device.view_mut();
        let view = view.slice_mut(0..len).map_err(gpu("biases"))?;
        self.stream
            .copy_h2d_async(host, 0..len, view)
            .map_err(gpu("copying the biases"))?;
        let staged = device.view();
        let part = |from: usize, count: usize| staged.slice(from..from + count);
        let (b, k) = (extras.biases, extras.masks);
        if b > 0 {
            let at = part(0, b).map_err(gpu("biases"))?;
            let values = part(b, b)
                .and_then(|v| v.cast::<f32>())
                .map_err(gpu("biases"))?;
            kernels::add_at(self.bufs.logits_mut(m * n_vocab)?, at, values, &self.stream)?;
        }
        if k > 0 {
            let rows = part(2 * b, k).map_err(gpu("masks"))?;
            let words = part(2 * b + k, len - 2 * b - k)
                .and_then(|v| v.cast::<u32>())
                .map_err(gpu("masks"))?;
            kernels::mask_rows(
                self.bufs.logits_mut(m * n_vocab)?,
                n_vocab,
                rows,
                words,
                &self.stream,
            )?;
        }
        Ok(())
    }
}

/// `segments`, none of them asking for logits (a pass for the hidden states).
pub(super) fn without_logits<'a>(segments: &[BatchSegment<'a>]) -> Vec<BatchSegment<'a>> {
    segments
        .iter()
        .map(|s| BatchSegment {
            logits: false,
            ..*s
        })
        .collect()
}

/// What a paged batch leaves: its rows of logits copied back, its greedy tokens copied
/// back, or its logits on the device (for more work there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum BatchOut {
    Logits,
    Tokens,
    OnDevice,
}
