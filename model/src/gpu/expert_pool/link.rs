//! The link slots: how many a layer gets, which of a pass's missed experts go through
//! them, and the routed experts' bytes in the mapped file, registered with the runtime
//! so that a pass can copy those experts straight into them.
//!
//! Registering pins every page of the experts' span (most of the file), which takes the
//! runtime a while: it runs on a thread of its own, started by the first pass (or the
//! first wait for the pools) rather than while the weights upload, and the passes take
//! the link once it has ended. Until then, and for good where the runtime refuses it,
//! the CPU computes every missed route as before.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use hip_backend::Device;
use tensor_store::TensorHandle;

use crate::cpu::Pick;
use crate::gpu::mapped::{Pieces, Registered};
use crate::gpu::MAX_BATCH;
use crate::ModelError;

/// Link slots a layer unless the caller asks for another count
/// ([`crate::gpu::GpuTuning::expert_link_slots`]), at most a quarter of the slots the
/// budget holds: a decoded token of Qwen3-30B-A3B's shape misses about two of its eight
/// routes a layer where three quarters of the experts are resident.
pub(super) const LINK_SLOTS: usize = 4;

/// How many of the `total` slots a layer that the budget holds become link slots:
/// `asked`, or [`LINK_SLOTS`], at most a quarter of them (all of them when asked). A
/// budget without a slot gets link slots all the same ([`super::ExpertPools::new`] shares
/// them among the layers, scratch of a few experts' bytes outside the budget).
pub(in crate::gpu) fn link_slots(total: usize, asked: Option<usize>) -> usize {
    match asked {
        Some(slots) if total == 0 => slots,
        Some(slots) => slots.min(total),
        None if total == 0 => LINK_SLOTS,
        None => LINK_SLOTS.min(total / 4),
    }
}

/// Which of the experts of the host's routes `picks` (of a pass of `n` tokens) the link
/// brings, the most routed first (the lowest index among equals). A few tokens
/// ([`MAX_BATCH`] at most) leave the CPU the third least routed of them, and the link
/// takes at most `link_slots` (one round); a prompt's chunk, whose experts each
/// multiply many tokens, gives the link every one, in as many rounds as they take.
pub(super) fn over_the_link(picks: &[Pick], n: usize, link_slots: usize) -> Vec<usize> {
    let mut routed: Vec<(usize, usize)> = Vec::new();
    for p in picks {
        match routed.iter_mut().find(|(x, _)| *x == p.expert) {
            Some((_, routes)) => *routes += 1,
            None => routed.push((p.expert, 1)),
        }
    }
    routed.sort_by_key(|&(x, routes)| (std::cmp::Reverse(routes), x));
    let to_link = if n <= MAX_BATCH {
        (routed.len() - routed.len() / 3).min(link_slots)
    } else if link_slots > 0 {
        routed.len()
    } else {
        0
    };
    routed[..to_link].iter().map(|&(x, _)| x).collect()
}

/// The experts' span registered 64 MiB at a time (about 2 ms of the runtime's lock on
/// an H200's host), a millisecond apart, so that a pass's launches and the upload's
/// copies get through in between; some 18 GB then take about a second.
const PIECES: Pieces = Pieces {
    bytes: 64 << 20,
    pause: std::time::Duration::from_millis(1),
};

/// The registering thread, and the flag that stops it between two pieces.
struct Registering {
    thread: JoinHandle<Result<Option<Registered>, ModelError>>,
    stop: Arc<AtomicBool>,
}

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
                let stop = Arc::new(AtomicBool::new(false));
                let stopped = Arc::clone(&stop);
                let spawned = std::thread::Builder::new()
                    .name("rocmforge-experts-link".into())
                    .spawn(move || {
                        let what = "missed experts' routes all";
                        Registered::new(&device, tensors, what, PIECES, Some(&stopped))
                    });
                match spawned {
                    Ok(thread) => *state = State::Registering(Registering { thread, stop }),
                    Err(error) => {
                        tracing::info!(%error, "missed experts' routes all on the CPU: no thread to register them");
                    }
                }
            }
            State::Registering(r) if r.thread.is_finished() => {
                *state = match r.thread.join() {
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
        // A registration under way stops before its next piece, and what it registered
        // is undone.
        if let State::Registering(r) = std::mem::replace(&mut self.state, State::Off) {
            r.stop.store(true, Ordering::Relaxed);
            r.thread.join().ok();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_slots_are_a_quarter_of_the_budgets_at_most_unless_asked() {
        assert_eq!(link_slots(96, None), LINK_SLOTS);
        assert_eq!(link_slots(8, None), 2);
        assert_eq!(link_slots(3, None), 0);
        assert_eq!(link_slots(96, Some(0)), 0);
        assert_eq!(link_slots(8, Some(6)), 6);
        assert_eq!(link_slots(2, Some(6)), 2);
        // No slot in the budget: link slots shared by the layers, unless asked for none.
        assert_eq!(link_slots(0, None), LINK_SLOTS);
        assert_eq!(link_slots(0, Some(2)), 2);
        assert_eq!(link_slots(0, Some(0)), 0);
    }

    fn picks(routes: &[(usize, usize)]) -> Vec<Pick> {
        routes
            .iter()
            .map(|&(token, expert)| Pick {
                token,
                rank: 0,
                expert,
                weight: 0.5,
            })
            .collect()
    }

    #[test]
    fn the_link_takes_the_most_routed_misses_and_a_decoded_token_leaves_the_cpu_a_third() {
        // One token: five missed experts, the CPU keeps one (five thirds, rounded down)
        // and the link takes up to its slots, lowest index first among equals.
        let one = picks(&[(0, 9), (0, 4), (0, 7), (0, 2), (0, 5)]);
        assert_eq!(over_the_link(&one, 1, 4), vec![2, 4, 5, 7]);
        assert_eq!(over_the_link(&one, 1, 2), vec![2, 4]);
        assert_eq!(over_the_link(&one[..2], 1, 4), vec![4, 9]);
        assert_eq!(over_the_link(&one[..3], 1, 4), vec![4, 7]);
        assert_eq!(over_the_link(&one, 1, 0), Vec::<usize>::new());
        // A few tokens: the most routed first, the CPU's third left out.
        let batch = picks(&[(0, 3), (1, 8), (1, 3), (2, 8), (2, 3), (3, 1), (3, 6)]);
        assert_eq!(over_the_link(&batch, 4, 2), vec![3, 8]);
        assert_eq!(over_the_link(&batch, 4, 8), vec![3, 8, 1]);
        // A prompt's chunk: every missed expert, in as many rounds as they take.
        assert_eq!(over_the_link(&batch, MAX_BATCH + 1, 2), vec![3, 8, 1, 6]);
        assert!(over_the_link(&batch, MAX_BATCH + 1, 0).is_empty());
        assert!(over_the_link(&[], 1, 4).is_empty());
    }
}
