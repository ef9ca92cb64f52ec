//! The server's request checks without its HTTP layer, for the fuzz targets of
//! `cli/fuzz` (built with `cfg(fuzzing)` only): a model loaded as `serve` loads it, on
//! the CPU, and a body checked as the completion handlers check it.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Result;
use model::gpu::GpuTuning;

use super::{api, load, AppState, LoadConfig};

/// A loaded model and the server's state around it, as `serve` builds them with its
/// default settings (no aliases, names not strict).
pub struct Checker {
    state: AppState,
}

impl Checker {
    /// Loads the GGUF model at `path` on the CPU, with `template_source` in place of the
    /// file's chat template when given (`--chat-template-file`).
    pub fn load(path: &Path, template_source: Option<String>) -> Result<Checker> {
        let state = AppState {
            progress: AtomicU32::new(0),
            loaded: OnceLock::new(),
            load_error: OnceLock::new(),
            api_key: None,
            shutting_down: AtomicBool::new(false),
            started: Instant::now(),
            max_body_bytes: 4 << 20,
            aliases: Vec::new(),
            strict_model_names: false,
            cors_origins: Vec::new(),
            unknown_fields: Mutex::new(Default::default()),
        };
        let config = LoadConfig {
            ctx_size: 0,
            kv_pool: None,
            flash_attn: crate::options::FlashAttn::Auto,
            kv_types: model::KvTypes::default(),
            context_shift: None,
            max_sequences: 1,
            max_queue: 1,
            step_tokens: 16,
            device: "cpu".to_owned(),
            gpu_tuning: GpuTuning::default(),
            delay: Duration::ZERO,
            template_source,
        };
        let loaded = load(path, &config, &state)?;
        if state.loaded.set(loaded).is_err() {
            unreachable!("a new state holds no model");
        }
        Ok(Checker { state })
    }

    /// Whether the model's vocabulary can hold output to a format (when not, every
    /// constrained request is refused before anything compiles).
    pub fn has_grammars(&self) -> bool {
        self.state.loaded.get().is_some_and(|l| l.grammars.is_ok())
    }

    /// Whether the chat template lets requests offer tools.
    pub fn has_tools(&self) -> bool {
        self.state
            .loaded
            .get()
            .is_some_and(|l| l.tool_syntax.is_ok())
    }

    /// Checks `body` as the chat (`chat`) or text completions endpoint does before it
    /// hands the request to the scheduler: the HTTP status and message of a refusal.
    pub fn check(&self, chat: bool, body: &[u8]) -> Result<(), (u16, String)> {
        let loaded = self.state.loaded.get().expect("loaded by Checker::load");
        api::check_body(&self.state, loaded, chat, body)
    }
}
