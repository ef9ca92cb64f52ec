//! A pass's layers: with every weight held (and the decode step captured as a graph),
//! or layer by layer as the budget allows, the layers not held streamed or run on the
//! host.

use std::time::Instant;

use hip_backend::Stream;

use super::forward::{self, Buffers, Layout};
use super::gpu;
use super::prompt::embed_from_file;
use super::weights::{self, Held, LayerWeights};
use super::{check_stop, GpuModel, Want, HOST_TOKENS};
use crate::config::ModelConfig;
use crate::ModelError;

impl GpuModel {
    /// Pins every weight once the budget allows it; true when all are held.
    pub(super) fn ensure_held(&mut self) -> Result<bool, ModelError> {
        if self.held.is_none() && self.hold_all {
            let pooled = self.experts_pooled();
            self.held = Some(Held::fetch(
                &self.cache,
                &self.plan,
                &self.part,
                self.rope_context,
                pooled,
                &self.parts,
            )?);
        }
        if self.held.is_some() {
            self.first_weights.get_or_init(Instant::now);
        }
        Ok(self.held.is_some())
    }

    /// One token through the captured step (capturing it the first time).
    pub(super) fn replay_step(&mut self) -> Result<(), ModelError> {
        if self.step.is_none() {
            let held = self.held.as_ref().expect("ensure_held returned true");
            let (config, bufs) = (&self.config, &mut self.bufs);
            let graph = self.stream.capture(|stream| {
                forward::step(config, held.layers(), held.globals(), bufs, 1, true, stream)
            })?;
            self.step = Some(graph);
        }
        let graph = self.step.as_ref().expect("captured just above");
        graph
            .launch(&self.stream)
            .map_err(gpu("replaying the decode step"))
    }

    /// Whether every weight is held, or can be now: all resident in a budget that holds
    /// them (pins them if so).
    pub(super) fn can_hold(&mut self) -> Result<bool, ModelError> {
        if self.held.is_some() || (self.hold_all && self.all_resident()) {
            return self.ensure_held();
        }
        Ok(false)
    }

    /// `n` tokens through launches queued one by one; `last_only` computes the logits of
    /// the last token only.
    pub(super) fn run_direct(&mut self, n: usize, want: Want) -> Result<(), ModelError> {
        let last_only = want != Want::AllLogits;
        self.run_layers(n, Layout::Contiguous, End::Last { last_only })
    }

    /// `n` tokens laid out as `layout` through launches queued one by one, ending as
    /// `end` says.
    pub(super) fn run_layers(
        &mut self,
        n: usize,
        layout: Layout<'_>,
        end: End,
    ) -> Result<(), ModelError> {
        // A stage of a layer split without the head hands its residual stream on.
        let end = if self.part.head { end } else { End::Hidden };
        let finish = |config: &ModelConfig,
                      globals: &weights::Globals,
                      bufs: &mut Buffers,
                      stream: &Stream| match end {
            End::Hidden => match layout {
                Layout::Contiguous => forward::advance(bufs, n, stream),
                Layout::Paged(_) => Ok(()),
            },
            End::Last { last_only } => {
                forward::finish(config, globals, bufs, n, last_only, stream)?;
                forward::tail(config, bufs, n, last_only, stream)
            }
            End::Rows { argmax } => {
                let Layout::Paged(batch) = layout else {
                    unreachable!("rows of logits are a paged batch's")
                };
                forward::finish_rows(config, globals, bufs, batch, argmax, stream)
            }
        };
        if self.can_hold()? {
            self.first_weights.get_or_init(Instant::now);
            let held = self.held.as_ref().expect("can_hold returned true");
            let (config, bufs, stream) = (&self.config, &mut self.bufs, &self.stream);
            forward::body(
                config,
                held.layers(),
                held.globals(),
                bufs,
                n,
                layout,
                stream,
                self.stop.as_deref(),
            )?;
            return finish(config, held.globals(), bufs, stream);
        }
        // Layer by layer: each layer's tensors are asked for (waiting for that layer
        // only) and released once its work has run, except the first `keep_layers` of a
        // model larger than its budget, held from their first use on so that only the
        // others pass through the cache again every pass.
        //
        // Over budget, a pass of a few tokens of one sequence runs the layers that are
        // not held on the host instead (`host.rs`); a longer one streams them, once the
        // device has the keys and values the host computed.
        let first_pos = self.len;
        let on_host = match (&mut self.host, layout) {
            (Some(host), Layout::Contiguous) if n <= HOST_TOKENS => Some(host.first()),
            (Some(host), _) => {
                host.before_device_pass(&mut self.bufs, &self.stream, first_pos)?;
                None
            }
            (None, _) => None,
        };
        let device_layers = on_host.unwrap_or(self.plan.layers.len());
        let keep = if on_host.is_some() {
            self.keep_layers
        } else {
            // The layers let go of are no longer in use: every pass ends synchronized.
            self.kept.truncate(self.stream_keep);
            self.stream_keep
        };
        let on_host_embed = self.embeds_on_host(matches!(layout, Layout::Contiguous));
        if on_host_embed {
            // Before the shared weights are asked for: the host's embeddings need nothing
            // on the device, and are made while those arrive.
            // The tokens of this pass are the first `n` the host staged.
            let tokens = self
                .host_tokens
                .as_slice()
                .map_err(gpu("reading the tokens"))?;
            let (config, plan, bufs) = (&self.config, &self.plan, &mut self.bufs);
            let host_rows = &mut self.host_rows;
            embed_from_file(config, plan, &tokens[..n], bufs, host_rows, &self.stream)?;
        }
        let globals = if self.head_after_layers(on_host_embed) {
            None
        } else {
            let globals =
                weights::Globals::fetch(&self.cache, &self.plan, &self.part, !on_host_embed)?;
            if globals.token_embd.is_some() {
                forward::embed(&self.config, &globals, &mut self.bufs, n, &self.stream)?;
            }
            Some(globals)
        };
        tracing::trace!(n, on_host_embed, "a pass's embeddings queued");
        for layer_idx in 0..device_layers {
            if let Err(stopped) = check_stop(self.stop.as_deref()) {
                // `globals` is released on return: its readers must have finished.
                self.sync().ok();
                return Err(stopped);
            }
            let kept = layer_idx < keep;
            let pooled = self.experts_pooled();
            let fetch = |model: &GpuModel| {
                let layer = &model.plan.layers[layer_idx];
                let parts = model.parts.get(layer_idx);
                LayerWeights::fetch(
                    &model.cache,
                    layer_idx,
                    layer,
                    model.rope_context,
                    pooled,
                    parts,
                )
            };
            if kept && layer_idx == self.kept.len() {
                let weights = fetch(self)?;
                self.kept.push(weights);
            }
            let fetched;
            let layer = if kept {
                &self.kept[layer_idx]
            } else {
                fetched = fetch(self)?;
                &fetched
            };
            tracing::trace!(layer = layer_idx, "a pass's layer queued");
            forward::layer(
                &self.config,
                layer_idx,
                layer,
                &mut self.bufs,
                n,
                layout,
                false,
                &self.stream,
            )?;
            let last_only = matches!(end, End::Last { last_only: true });
            self.load_head_while_waiting(layer_idx, globals.is_none(), last_only)?;
            if !self.hold_all && !kept {
                // The cache may evict these tensors once dropped: their readers must
                // have finished.
                self.sync()?;
            }
        }
        if let Some(host) = &mut self.host {
            if on_host.is_some() {
                let (config, plan) = (&self.config, &self.plan);
                host.run(config, plan, &mut self.bufs, &self.stream, first_pos, n)?;
            } else {
                host.after_device_pass(first_pos + n);
            }
        }
        let globals = self.globals_after_layers(globals)?;
        self.first_weights.get_or_init(Instant::now);
        finish(&self.config, &globals, &mut self.bufs, &self.stream)?;
        if !self.hold_all {
            // `globals` is released on return: its readers must have finished.
            self.sync()?;
        }
        Ok(())
    }

    /// Whether a pass gathers its embeddings on the host: always over budget, where they
    /// stay in the file; and for a pass of one sequence (`single`) while they are still
    /// on their way, the last tensors uploaded ([`first_use_order`]), unless they are the
    /// output matrix too, which every pass waits for.
    pub(super) fn embeds_on_host(&self, single: bool) -> bool {
        let embd = &self.plan.token_embd.weight;
        if !self.part.embed {
            return false;
        }
        self.embed_on_host
            || (single
                && self.hold_all
                && embd.index() != self.plan.output.weight.index()
                && !self.cache.is_resident(embd))
    }

    /// Whether a pass asks for the final norm and the output matrix only after queuing
    /// its layers: with every weight held and its embeddings made from the file, since
    /// those tensors arrive after the layers ([`first_use_order`]). Otherwise it asks for
    /// them first: its embeddings on the device are in hand (and so is every weight), or
    /// over budget, as the cache's room was planned.
    pub(super) fn head_after_layers(&self, on_host_embed: bool) -> bool {
        on_host_embed && self.hold_all
    }

    /// The shared weights a pass asked for before its layers, or, when it did not
    /// ([`GpuModel::head_after_layers`]), the final norm and the output matrix now.
    pub(super) fn globals_after_layers(
        &self,
        early: Option<weights::Globals>,
    ) -> Result<weights::Globals, ModelError> {
        match early {
            Some(globals) => Ok(globals),
            None => weights::Globals::fetch(&self.cache, &self.plan, &self.part, false),
        }
    }

    /// For a pass that asks for the output matrix after its layers and takes the logits
    /// of its last token only: once its first layer is queued, the code of that product
    /// is loaded, while the pass waits for its other layers. Otherwise the runtime loads
    /// it at the product's first launch, after the matrix lands, on the way to the first
    /// token (about a millisecond on an H100: a weight type's decode products are a
    /// module of their own, which no layer of a prompt may have used).
    pub(super) fn load_head_while_waiting(
        &self,
        layer_idx: usize,
        head_after_layers: bool,
        last_only: bool,
    ) -> Result<(), ModelError> {
        if self.part.head && head_after_layers && last_only && layer_idx == 0 {
            forward::load_last_token_head(&self.plan, &self.stream)?;
            tracing::trace!("the output product's code loaded");
        }
        Ok(())
    }

    pub(super) fn all_resident(&self) -> bool {
        // A device of a split by tensors holds its parts of the cut matrices outside the
        // cache: the cache's order is the rest.
        if self.part.shard.is_some() {
            let order = self.cache.order().tensors();
            return order.iter().all(|h| self.cache.is_resident(h));
        }
        self.plan
            .handles()
            .iter()
            .all(|h| self.cache.is_resident(h))
    }
}

/// How a forward pass ends: the logits (and greedy token) of one sequence's last token or
/// of all its tokens, or the logit rows of a paged batch.
#[derive(Clone, Copy)]
pub(super) enum End {
    Last {
        last_only: bool,
    },
    Rows {
        argmax: bool,
    },
    /// A stage of a layer split that hands its residual stream to the next: no logits.
    Hidden,
}
