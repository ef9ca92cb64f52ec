//! One sequence's calls: its tokens checked and appended to the KV cache, and what the
//! call hands back (logits, every token's logits, or the greedy token) copied to the host.

use super::gpu;
use super::{GpuModel, Want, MAX_BATCH};
use crate::ModelError;

impl GpuModel {
    /// Appends `tokens` to the KV cache and returns the logits of the last one.
    pub fn forward(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.forward_logits(tokens).map(<[f32]>::to_vec)
    }

    /// As [`GpuModel::forward`], lending the logits from the pinned host buffer.
    pub fn forward_logits(&mut self, tokens: &[u32]) -> Result<&[f32], ModelError> {
        self.eval(tokens, Want::Logits)?;
        self.logits(1)
    }

    /// Appends `tokens` and returns the logits of every one of them, `n_vocab` each.
    pub fn forward_all_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let n_vocab = self.config.n_vocab;
        let mut out = Vec::with_capacity(tokens.len() * n_vocab);
        for chunk in tokens.chunks(MAX_BATCH) {
            self.eval(chunk, Want::AllLogits)?;
            out.extend_from_slice(self.logits(chunk.len())?);
        }
        Ok(out)
    }

    /// Appends `tokens` and returns the greedy choice after the last one, taken on the
    /// device (the first highest logit).
    pub fn forward_argmax(&mut self, tokens: &[u32]) -> Result<u32, ModelError> {
        self.eval(tokens, Want::Argmax)?;
        Ok(self.greedy_tokens(1)?[0])
    }

    /// The first `n` greedy tokens copied back by the last call; an error when a row's
    /// logits held a NaN or +inf (the argmax kernel's `u32::MAX`).
    pub(super) fn greedy_tokens(&self, n: usize) -> Result<&[u32], ModelError> {
        let tokens = &self
            .host_tokens
            .as_slice()
            .map_err(gpu("reading the tokens"))?[..n];
        if tokens.contains(&u32::MAX) {
            return Err(ModelError::BadLogits);
        }
        Ok(tokens)
    }

    /// Every token id within the vocabulary.
    pub(super) fn check_tokens(&self, tokens: &[u32]) -> Result<(), ModelError> {
        match tokens.iter().find(|&&t| t as usize >= self.config.n_vocab) {
            Some(&token) => Err(ModelError::TokenOutOfRange {
                token,
                n_vocab: self.config.n_vocab,
            }),
            None => Ok(()),
        }
    }

    /// The logits copied back by the last call, `n` rows.
    pub(super) fn logits(&self, n: usize) -> Result<&[f32], ModelError> {
        let all = self
            .host_logits
            .as_slice()
            .map_err(gpu("reading the logits"))?;
        Ok(&all[..n * self.config.n_vocab])
    }

    /// Runs `tokens` (in chunks of the prompt batch) after the positions already cached and
    /// leaves what `want` asks for in the pinned host buffers, the copy finished.
    pub(super) fn eval(&mut self, tokens: &[u32], want: Want) -> Result<(), ModelError> {
        self.check_call(tokens, want)?;
        let start = self.len;
        let result = self.run_chunks(tokens, want);
        tracing::trace!(tokens = tokens.len(), "a pass's results in hand");
        if result.is_err() {
            // Leave the cache as it was before the failed call.
            self.set_position(start)?;
        }
        result
    }

    /// Whether a call may append `tokens` and hand back what `want` asks for: some
    /// tokens, room for them in the cache, every token's logits only for a few, every id
    /// within the vocabulary.
    pub(super) fn check_call(&self, tokens: &[u32], want: Want) -> Result<(), ModelError> {
        if tokens.is_empty() {
            return Err(ModelError::EmptyInput);
        }
        let needed = self.len + tokens.len();
        if needed > self.capacity {
            return Err(ModelError::ContextFull {
                needed,
                capacity: self.capacity,
            });
        }
        if want == Want::AllLogits && tokens.len() > MAX_BATCH {
            return Err(ModelError::EmptyInput);
        }
        self.check_tokens(tokens)
    }

    pub(super) fn write_tokens(&mut self, chunk: &[u32]) -> Result<(), ModelError> {
        let gpu = |source| ModelError::Gpu {
            op: "copying tokens",
            source,
        };
        self.host_tokens.as_mut_slice().map_err(gpu)?[..chunk.len()].copy_from_slice(chunk);
        let dst = self.bufs.tokens_mut(chunk.len())?;
        self.stream
            .copy_h2d_async(&mut self.host_tokens, 0..chunk.len(), dst)
            .map_err(gpu)
    }

    pub(super) fn copy_back(&mut self, n: usize, want: Want) -> Result<(), ModelError> {
        match want {
            Want::Argmax => self.copy_rows_back(1, true),
            Want::Logits => self.copy_rows_back(1, false),
            Want::AllLogits => self.copy_rows_back(n, false),
        }
    }

    /// Copies the first `rows` greedy tokens (`tokens`) or rows of logits to the pinned
    /// host buffers, and waits for them.
    pub(super) fn copy_rows_back(&mut self, rows: usize, tokens: bool) -> Result<(), ModelError> {
        let gpu = |source| ModelError::Gpu {
            op: "copying results",
            source,
        };
        if tokens {
            let src = self.bufs.tokens_view(rows)?;
            self.stream
                .copy_d2h_async(src, &mut self.host_tokens, 0..rows)
                .map_err(gpu)?;
            self.host_tokens.wait().map_err(gpu)
        } else {
            let len = rows * self.config.n_vocab;
            let src = self.bufs.logits_view(len)?;
            self.stream
                .copy_d2h_async(src, &mut self.host_logits, 0..len)
                .map_err(gpu)?;
            self.host_logits.wait().map_err(gpu)
        }
    }
}
