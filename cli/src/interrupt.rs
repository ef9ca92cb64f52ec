//! Ctrl-C: the first press asks the work in hand to stop (generation after the current
//! token; a GPU load or forward pass between two layers), the second exits at once.
//! Either way the exit status is 130, the shell's convention for SIGINT.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};

/// The conventional exit status of a process stopped by SIGINT.
pub const EXIT_INTERRUPTED: u8 = 130;

/// Installs the handler and returns the flag the first Ctrl-C sets.
pub fn install_ctrl_c() -> Result<Arc<AtomicBool>> {
    let stop = Arc::new(AtomicBool::new(false));
    let presses = AtomicUsize::new(0);
    let flag = Arc::clone(&stop);
    ctrlc::set_handler(move || {
        if presses.fetch_add(1, Ordering::SeqCst) > 0 {
            std::process::exit(i32::from(EXIT_INTERRUPTED));
        }
        flag.store(true, Ordering::SeqCst);
    })
    .context("installing the Ctrl-C handler")?;
    Ok(stop)
}

/// True when `error` is a stop request honoured, not a failure: the load or the forward
/// pass stopped because the flag was set.
pub fn is_interrupted(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        matches!(
            cause.downcast_ref::<model::ModelError>(),
            Some(model::ModelError::Interrupted)
        ) || cause
            .downcast_ref::<tensor_store::StoreError>()
            .is_some_and(tensor_store::StoreError::is_interrupted)
    })
}
