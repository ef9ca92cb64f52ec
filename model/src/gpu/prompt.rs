//! A prompt's chunks: run one by one, or, while the weights still arrive, layer by
//! layer over every chunk; and embeddings gathered from the file on the host.

use std::time::Instant;

use hip_backend::{DeviceBuffer, PinnedBuffer, Stream};

use super::forward::{self, Buffers, Layout};
use super::weights::{self, LayerWeights};
use super::{check_stop, GpuModel, Want};
use crate::config::ModelConfig;
use crate::plan::ExecutionPlan;
use crate::ModelError;

impl GpuModel {
    pub(super) fn run_chunks(&mut self, tokens: &[u32], want: Want) -> Result<(), ModelError> {
        // Every token's logits come from one pass (`eval` keeps those calls to
        // MAX_BATCH tokens, which the buffers always hold).
        let chunk_len = if want == Want::AllLogits {
            tokens.len()
        } else {
            self.prompt_batch
        };
        if tokens.len() > chunk_len
            && want != Want::AllLogits
            && self.still_arriving()
            && self.run_by_layer(tokens, chunk_len, want)?
        {
            return Ok(());
        }
        let chunks: Vec<&[u32]> = tokens.chunks(chunk_len).collect();
        let last = chunks.len() - 1;
        for (i, chunk) in chunks.into_iter().enumerate() {
            check_stop(self.stop.as_deref())?;
            self.write_tokens(chunk)?;
            let output = if i == last { want } else { Want::Logits };
            let wants_output = i == last;
            self.run_chunk(chunk.len(), output, wants_output)?;
            if wants_output && self.part.head {
                self.copy_back(chunk.len(), want)?;
            } else if wants_output {
                // A device of a split by tensors without the head: its share is done once
                // its stream is.
                self.sync()?;
            }
        }
        Ok(())
    }

    /// One chunk of `n` tokens, staged already (or, on a later stage of a layer split,
    /// its residual stream in `x`), after the positions cached. The last chunk of a call
    /// that wants one token's result (`last`) replays the captured decode step, unless a
    /// pooled mixture of experts reads each layer's routing back (no graph).
    pub(super) fn run_chunk(&mut self, n: usize, want: Want, last: bool) -> Result<(), ModelError> {
        if n == 1 && last && !self.experts_pooled() && self.ensure_held()? {
            self.replay_step()?;
        } else {
            self.run_direct(n, want)?;
        }
        self.len += n;
        Ok(())
    }

    /// Whether the weights are still being uploaded into a budget that holds them all,
    /// with every layer on the device.
    fn still_arriving(&self) -> bool {
        self.hold_all && self.held.is_none() && self.host.is_none() && !self.all_resident()
    }

    /// A prompt of several chunks while its weights still arrive: each layer, once
    /// resident, runs every chunk before the next layer is waited for (a chunk's
    /// attention needs only the keys and values of the chunks before it, which that layer
    /// has just written). Run chunk by chunk instead, every chunk after the first would
    /// wait for the whole upload and then run all the layers: the prompt's work would
    /// not hide under the upload. The residual streams of the chunks wait in a device
    /// buffer of the whole prompt, taken for this pass only; without room for it, this
    /// returns false having run nothing.
    fn run_by_layer(
        &mut self,
        tokens: &[u32],
        chunk_len: usize,
        want: Want,
    ) -> Result<bool, ModelError> {
        let d = self.config.n_embd;
        let n_chunks = tokens.len().div_ceil(chunk_len);
        // Without room for them, the prompt runs chunk by chunk.
        let (Ok(mut streams), Ok(mut firsts)) = (
            self.device.alloc::<f32>(tokens.len() * d),
            self.device.alloc::<i32>(n_chunks),
        ) else {
            tracing::debug!(
                tokens = tokens.len(),
                "no room for the prompt's residual streams"
            );
            return Ok(false);
        };
        let result = self.layers_over_chunks(tokens, chunk_len, &mut streams, &mut firsts);
        // Whatever happened, nothing may still use the buffers when they are freed.
        let done = self.sync();
        result?;
        done?;
        let n_last = tokens.len() - (n_chunks - 1) * chunk_len;
        self.copy_back(n_last, want)?;
        Ok(true)
    }

    fn layers_over_chunks(
        &mut self,
        tokens: &[u32],
        chunk_len: usize,
        streams: &mut DeviceBuffer<f32>,
        firsts: &mut DeviceBuffer<i32>,
    ) -> Result<(), ModelError> {
        let gpu = |op| move |source| ModelError::Gpu { op, source };
        let d = self.config.n_embd;
        let chunks: Vec<&[u32]> = tokens.chunks(chunk_len).collect();
        let start = self.len;
        let positions: Vec<i32> = (0..chunks.len())
            .map(|c| i32::try_from(start + c * chunk_len).unwrap_or(i32::MAX))
            .collect();
        if self.host_positions.len() < positions.len() {
            self.host_positions = self
                .device
                .alloc_pinned::<i32>(positions.len())
                .map_err(gpu("pinned"))?;
        }
        self.stream
            .write_staged(&mut self.host_positions, &positions, firsts.view_mut())
            .map_err(gpu("positions"))?;
        let at = |c: usize, n: usize| c * chunk_len * d..(c * chunk_len + n) * d;
        let on_host_embed = self.embeds_on_host(true);
        // Embeddings made on the host need nothing on the device: they are made while the
        // shared weights arrive, which are asked for after them.
        let on_device = if on_host_embed {
            None
        } else {
            Some(weights::Globals::fetch(
                &self.cache,
                &self.plan,
                &self.part,
                true,
            )?)
        };
        for (c, chunk) in chunks.iter().enumerate() {
            self.write_tokens(chunk)?;
            let (config, bufs, stream) = (&self.config, &mut self.bufs, &self.stream);
            match &on_device {
                Some(globals) => forward::embed(config, globals, bufs, chunk.len(), stream)?,
                None => {
                    embed_from_file(config, &self.plan, chunk, bufs, &mut self.host_rows, stream)?
                }
            }
            let dst = streams
                .view_mut()
                .slice_mut(at(c, chunk.len()))
                .map_err(gpu("residual"))?;
            stream
                .copy_d2d_async(bufs.x_view(chunk.len() * d)?, dst)
                .map_err(gpu("residual"))?;
        }
        let globals = match on_device {
            Some(globals) => Some(globals),
            None if self.head_after_layers(on_host_embed) => None,
            None => Some(weights::Globals::fetch(
                &self.cache,
                &self.plan,
                &self.part,
                false,
            )?),
        };
        tracing::trace!(
            chunks = chunks.len(),
            on_host_embed,
            "a prompt's embeddings queued"
        );
        for layer_idx in 0..self.plan.layers.len() {
            check_stop(self.stop.as_deref())?;
            let layer = &self.plan.layers[layer_idx];
            let weights = LayerWeights::fetch(
                &self.cache,
                layer_idx,
                layer,
                self.rope_context,
                self.experts_pooled(),
                self.parts.get(layer_idx),
            )?;
            tracing::trace!(layer = layer_idx, "a prompt's layer queued over its chunks");
            let (config, bufs, stream) = (&self.config, &mut self.bufs, &self.stream);
            for (c, chunk) in chunks.iter().enumerate() {
                let n = chunk.len();
                let first = firsts.view().slice(c..c + 1).map_err(gpu("positions"))?;
                stream
                    .copy_d2d_async(first, bufs.pos_mut()?)
                    .map_err(gpu("positions"))?;
                let x = streams.view().slice(at(c, n)).map_err(gpu("residual"))?;
                stream
                    .copy_d2d_async(x, bufs.x_mut(n * d)?)
                    .map_err(gpu("residual"))?;
                forward::layer(
                    config,
                    layer_idx,
                    &weights,
                    bufs,
                    n,
                    Layout::Contiguous,
                    false,
                    stream,
                )?;
                let x = streams
                    .view_mut()
                    .slice_mut(at(c, n))
                    .map_err(gpu("residual"))?;
                stream
                    .copy_d2d_async(bufs.x_view(n * d)?, x)
                    .map_err(gpu("residual"))?;
            }
            self.load_head_while_waiting(layer_idx, globals.is_none(), true)?;
        }
        let globals = self.globals_after_layers(globals)?;
        self.first_weights.get_or_init(Instant::now);
        // The last chunk's stream is still in `x`: its logits, and the position past it.
        let last = chunks.len() - 1;
        let n = chunks[last].len();
        let (config, bufs, stream) = (&self.config, &mut self.bufs, &self.stream);
        let first = firsts
            .view()
            .slice(last..last + 1)
            .map_err(gpu("positions"))?;
        stream
            .copy_d2d_async(first, bufs.pos_mut()?)
            .map_err(gpu("positions"))?;
        forward::finish(config, &globals, bufs, n, true, stream)?;
        forward::tail(config, bufs, n, true, stream)?;
        self.len += tokens.len();
        Ok(())
    }
}

/// The embeddings of `tokens` from the mapped file (the embeddings not on the device):
/// their rows' blocks gathered on the host, copied to the device, and decoded there into
/// `x` by the same decoders as [`forward::embed`]'s (whose results are the CPU's, bit for
/// bit). The blocks are a fraction of the decoded rows' bytes (a ninth for Q4_K), and the
/// host does no decoding while it feeds the upload.
pub(super) fn embed_from_file(
    config: &ModelConfig,
    plan: &ExecutionPlan,
    tokens: &[u32],
    bufs: &mut Buffers,
    host_rows: &mut PinnedBuffer<u8>,
    stream: &Stream,
) -> Result<(), ModelError> {
    let gpu = |source| ModelError::Gpu {
        op: "copying the embeddings",
        source,
    };
    let table = &plan.token_embd.weight;
    let row_bytes = bufs.row_bytes();
    let bytes = table.bytes()?;
    let len = tokens.len() * row_bytes;
    // Waits for the copy of the rows gathered before, if it may still run.
    let capacity = host_rows.len();
    let staged = host_rows.as_mut_slice().map_err(gpu)?;
    let staged = staged.get_mut(..len).ok_or(ModelError::Gpu {
        op: "copying the embeddings",
        source: hip_backend::HipError::LengthMismatch {
            op: "staging embedding rows",
            src: len,
            dst: capacity,
        },
    })?;
    for (&token, dst) in tokens.iter().zip(staged.chunks_exact_mut(row_bytes)) {
        let id = token as usize;
        let row = bytes
            .get(id * row_bytes..(id + 1) * row_bytes)
            .filter(|_| id < config.n_vocab)
            .ok_or(ModelError::TokenOutOfRange {
                token,
                n_vocab: config.n_vocab,
            })?;
        dst.copy_from_slice(row);
    }
    let dst = bufs.raw_rows_mut(tokens.len())?;
    stream.copy_h2d_async(host_rows, 0..len, dst).map_err(gpu)?;
    forward::decode_embeddings(
        config,
        table.ggml_type(),
        table.name(),
        bufs,
        tokens.len(),
        stream,
    )
}
