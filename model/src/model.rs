//! A loaded model: configuration, execution plan, and the forward pass over them.

use tensor_store::TensorStore;

use crate::config::ModelConfig;
use crate::cpu::{self, Logits};
use crate::kv_cache::KvCache;
use crate::plan::ExecutionPlan;
use crate::ModelError;

/// A model ready to run on the CPU: its configuration and a plan of lazy weight handles
/// into the mapped file. Building one reads only metadata.
#[derive(Clone)]
pub struct Model {
    store: TensorStore,
    config: ModelConfig,
    plan: ExecutionPlan,
}

impl Model {
    /// Reads the configuration and resolves every weight; no weight bytes are touched.
    pub fn load(store: &TensorStore) -> Result<Model, ModelError> {
        let config = ModelConfig::from_metadata(store.metadata())?;
        let plan = ExecutionPlan::build(store, &config)?;
        Ok(Model {
            store: store.clone(),
            config,
            plan,
        })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The weights, as lazy handles.
    pub fn plan(&self) -> &ExecutionPlan {
        &self.plan
    }

    /// The file the weights come from.
    pub fn store(&self) -> &TensorStore {
        &self.store
    }

    /// An empty KV cache for up to `max_positions` positions.
    pub fn new_cache(&self, max_positions: usize) -> KvCache {
        KvCache::new(&self.config, max_positions)
    }

    /// Removes positions `keep..keep + discard` of `cache` (llama.cpp's context shift):
    /// the later positions move down by `discard`, their keys turned back by as many
    /// positions of RoPE, so that decoding continues in the room made.
    pub fn shift_cache(
        &self,
        cache: &mut KvCache,
        keep: usize,
        discard: usize,
    ) -> Result<(), ModelError> {
        cpu::shift(&self.config, &self.plan, cache, keep, discard)
    }

    /// Appends `tokens` to `cache` and returns the logits of the last one.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache) -> Result<Vec<f32>, ModelError> {
        cpu::forward(&self.config, &self.plan, tokens, cache, Logits::Last)
    }

    /// Appends `tokens` to `cache` and returns the logits of every one of them,
    /// `n_vocab` per token.
    pub fn forward_all_logits(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
    ) -> Result<Vec<f32>, ModelError> {
        cpu::forward(&self.config, &self.plan, tokens, cache, Logits::All)
    }

    /// Appends `tokens` to `cache` and returns every token's last hidden state after the
    /// final norm, `n_embd` per token: the rows the output projection would read, which
    /// [`crate::pooling`] turns into an embedding.
    pub fn hidden_states(
        &self,
        tokens: &[u32],
        cache: &mut KvCache,
    ) -> Result<Vec<f32>, ModelError> {
        cpu::hidden_states(&self.config, &self.plan, tokens, cache)
    }
}
