//! Embeddings requests in the scheduler's loop: between two steps, the next inputs of
//! the oldest request run through the model (CPU or GPU) in blocks of the KV pool freed
//! right after, and each input's last hidden states become its pooled vector.

use std::sync::atomic::Ordering;

use super::super::batch::{self, Segment};
use super::super::{EmbedRequest, SchedulerMetrics};
use super::step::in_batches;
use super::Loop;

impl Loop<'_> {
    /// Computes the next inputs of the oldest embeddings request, between two steps: as
    /// many as one step's budget of tokens and a batch's sequences allow (at least one),
    /// each in blocks of the pool that are freed right after. While the running
    /// sequences hold the blocks an input needs, it waits for the next step.
    pub(super) fn embed_some(&mut self) {
        let Some((request, mut vectors)) = self.embeds.pop_front() else {
            return;
        };
        let inputs = &request.inputs[vectors.len()..];
        let mut tables: Vec<Vec<u32>> = Vec::new();
        let mut tokens = 0;
        for input in inputs {
            let full = tokens + input.len() > self.config.step_tokens
                || tables.len() == self.config.max_sequences;
            if !tables.is_empty() && full {
                break;
            }
            let blocks = input.len().div_ceil(self.pool.block_size());
            let table: Vec<u32> = (0..blocks).map_while(|_| self.pool.allocate()).collect();
            if table.len() < blocks {
                table.iter().for_each(|&b| self.pool.release(b));
                break;
            }
            tokens += input.len();
            tables.push(table);
        }
        if tables.is_empty() {
            if self.running.is_empty() {
                // Alone it does not fit: cannot happen with a pool of a whole context.
                let why = "the KV pool is too small for this input".to_owned();
                self.end_embed(request, Err(why));
            } else {
                self.embeds.push_front((request, vectors));
            }
            return;
        }
        let segments: Vec<Segment<'_>> = inputs
            .iter()
            .zip(&tables)
            .map(|(input, table)| Segment {
                tokens: input,
                first_pos: 0,
                table,
                logits: true,
            })
            .collect();
        let context = self.batch_context();
        let rows = match &mut self.gpu {
            Some(gpu) => {
                let mut rows = Vec::new();
                in_batches(gpu, &segments, |gpu, batch, _| {
                    rows.extend(gpu.forward_batch_hidden(batch)?);
                    Ok(())
                })
                .map(|()| rows)
            }
            None => batch::hidden_batch(
                self.model.config(),
                self.model.plan(),
                &mut self.pool,
                &segments,
                context,
            ),
        };
        drop(segments);
        for block in tables.iter().flatten() {
            self.pool.release(*block);
        }
        SchedulerMetrics::add(&self.metrics.embedding_tokens, tokens as u64);
        let rows = match rows {
            Ok(rows) => rows,
            Err(e) => {
                SchedulerMetrics::add(&self.metrics.failed, 1);
                self.end_embed(request, Err(e.to_string()));
                return;
            }
        };
        let d = self.model.config().n_embd;
        let mut at = 0;
        for input in &inputs[..tables.len()] {
            let end = at + input.len() * d;
            vectors.push(crate::pooling::mean_pool_normalized(&rows[at..end], d));
            at = end;
        }
        if vectors.len() == request.inputs.len() {
            self.end_embed(request, Ok(vectors));
        } else {
            self.embeds.push_front((request, vectors));
        }
    }

    /// Hands an embeddings request its vectors, or why it failed, and counts it out of
    /// the queue.
    pub(super) fn end_embed(
        &mut self,
        request: EmbedRequest,
        result: Result<Vec<Vec<f32>>, String>,
    ) {
        self.waiting_count.fetch_sub(1, Ordering::SeqCst);
        (request.reply)(result);
    }
}
