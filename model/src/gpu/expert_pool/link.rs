//! The routed experts' bytes in the mapped file, registered with the runtime so that a
//! pass can copy the experts its pool misses straight into the link slots.
//!
//! Registering pins every page of the experts' span (most of the file), which takes the
//! runtime a while: it runs on a thread of its own, started by the first pass (or the
//! first wait for the pools) rather than while the weights upload, and the passes take
//! the link once it has ended. Until then, and for good where the runtime refuses it,
//! the CPU computes every missed route as before.

use std::thread::JoinHandle;

use hip_backend::Device;
use tensor_store::TensorHandle;

use crate::gpu::mapped::Registered;
use crate::ModelError;

type Registering = JoinHandle<Result<Option<Registered>, ModelError>>;

pub(super) struct Link {
    state: State,
}

enum State {
    /// Not started: what to register.
    Idle {
        device: Device,
        tensors: Vec<TensorHandle>,
    },
    Registering(Registering),
    Ready(Registered),
    /// No link: none asked for, or the registration failed (logged).
    Off,
}

impl Link {
    /// A link for the experts of `tensors` on `device`, if `slots` link slots are kept.
    pub fn new(device: &Device, tensors: Vec<TensorHandle>, slots: usize) -> Link {
        let state = if slots == 0 || tensors.is_empty() {
            State::Off
        } else {
            State::Idle {
                device: device.clone(),
                tensors,
            }
        };
        Link { state }
    }

    /// Starts the registration if it has not started, takes its outcome once it has
    /// ended, and gives the registration while it is ready; never waits.
    pub fn poll(&mut self) -> Option<&Registered> {
        let state = &mut self.state;
        match std::mem::replace(state, State::Off) {
            State::Idle { device, tensors } => {
                let spawned = std::thread::Builder::new()
                    .name("rocmforge-experts-link".into())
                    .spawn(move || Registered::new(&device, tensors, "missed experts' routes all"));
                match spawned {
                    Ok(thread) => *state = State::Registering(thread),
                    Err(error) => {
                        tracing::info!(%error, "missed experts' routes all on the CPU: no thread to register them");
                    }
                }
            }
            State::Registering(thread) if thread.is_finished() => {
                *state = match thread.join() {
                    Ok(Ok(Some(registered))) => {
                        tracing::info!(
                            mib = registered.len() >> 20,
                            "the experts' bytes registered: missed experts come over the link"
                        );
                        State::Ready(registered)
                    }
                    Ok(Ok(None)) => State::Off,
                    Ok(Err(error)) => {
                        tracing::info!(%error, "missed experts' routes all on the CPU");
                        State::Off
                    }
                    Err(_) => {
                        tracing::info!(
                            "missed experts' routes all on the CPU: registering them failed"
                        );
                        State::Off
                    }
                };
            }
            other => *state = other,
        }
        match state {
            State::Ready(registered) => Some(registered),
            _ => None,
        }
    }

    /// Whether the registration has ended, one way or the other (after [`Link::poll`]).
    pub fn settled(&self) -> bool {
        matches!(self.state, State::Ready(_) | State::Off)
    }

    /// Whether the registration is in place (after [`Link::poll`]).
    pub fn ready(&self) -> bool {
        matches!(self.state, State::Ready(_))
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // A registration under way is waited for, and undone with the rest.
        if let State::Registering(thread) = std::mem::replace(&mut self.state, State::Off) {
            thread.join().ok();
        }
    }
}
