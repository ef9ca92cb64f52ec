//! Ctrl-C: the first press asks the work in hand to stop (generation after the current
//! token; a GPU load or forward pass between two layers), the second exits at once.
//! Either way the exit status is 130, the shell's convention for SIGINT.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};

/// What `chat` writes on stderr when it waits for a message.
pub const PROMPT: &str = "> ";

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

/// Ctrl-C in `chat`: while an answer is written it stops that answer (a second press
/// before it stops exits); at the prompt the first press says how to leave, a second
/// one in a row exits. Exits have status 130.
pub struct ChatInterrupt {
    /// Set by a press during an answer: the generation loop and the GPU look at it.
    pub stop: Arc<AtomicBool>,
    answering: Arc<AtomicBool>,
    presses_at_prompt: Arc<AtomicUsize>,
}

impl ChatInterrupt {
    /// Installs the handler; `interactive`: the prompt is drawn again after the hint.
    pub fn install(interactive: bool) -> Result<ChatInterrupt> {
        let chat = ChatInterrupt {
            stop: Arc::new(AtomicBool::new(false)),
            answering: Arc::new(AtomicBool::new(false)),
            presses_at_prompt: Arc::new(AtomicUsize::new(0)),
        };
        let (stop, answering, presses) = (
            Arc::clone(&chat.stop),
            Arc::clone(&chat.answering),
            Arc::clone(&chat.presses_at_prompt),
        );
        ctrlc::set_handler(move || {
            if answering.load(Ordering::SeqCst) {
                if stop.swap(true, Ordering::SeqCst) {
                    std::process::exit(i32::from(EXIT_INTERRUPTED));
                }
            } else if presses.fetch_add(1, Ordering::SeqCst) > 0 {
                eprintln!();
                std::process::exit(i32::from(EXIT_INTERRUPTED));
            } else {
                let prompt = if interactive { PROMPT } else { "" };
                eprint!("\n(Ctrl-C again, Ctrl-D or /exit to quit)\n{prompt}");
            }
        })
        .context("installing the Ctrl-C handler")?;
        Ok(chat)
    }

    /// An answer starts: Ctrl-C now stops it.
    pub fn answering(&self) {
        self.stop.store(false, Ordering::SeqCst);
        self.answering.store(true, Ordering::SeqCst);
    }

    /// Back at the prompt (a line was read, or an answer ended).
    pub fn at_prompt(&self) {
        self.answering.store(false, Ordering::SeqCst);
        self.stop.store(false, Ordering::SeqCst);
        self.presses_at_prompt.store(0, Ordering::SeqCst);
    }

    /// A line of input arrived: the presses at the prompt start counting again.
    pub fn input_read(&self) {
        self.presses_at_prompt.store(0, Ordering::SeqCst);
    }
}
