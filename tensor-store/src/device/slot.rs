//! One upload's outcome, for everyone waiting on it: threads block on a condition
//! variable, async tasks register a waker. The mutex guards only the outcome and the
//! waker list, is never held across an `.await` (futures take it inside `poll` and drop
//! it before returning), and is never held while waking anyone.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use super::cache::DeviceTensor;
use super::target::DeviceTarget;
use crate::StoreError;

/// Why an upload did not produce a tensor. Cloned to every waiter.
#[derive(Clone, Debug)]
pub(crate) enum Failure {
    /// The background upload let the tensor go (it stopped at the budget) before anyone
    /// needed it: a waiter asks again, which starts an upload of its own.
    Retry,
    Cancelled,
    OutOfMemory {
        requested: u64,
        budget: u64,
        resident: u64,
        in_use: u64,
        loading: u64,
    },
    Error(Arc<StoreError>),
}

impl Failure {
    /// The error a waiter for `tensor` returns.
    pub(crate) fn into_error(self, tensor: &str) -> StoreError {
        let tensor = tensor.to_owned();
        match self {
            // Never returned: waiters retry. Reported as a cancellation should a path
            // ever reach here.
            Failure::Retry | Failure::Cancelled => StoreError::LoadCancelled { tensor },
            Failure::OutOfMemory {
                requested,
                budget,
                resident,
                in_use,
                loading,
            } => StoreError::DeviceOutOfMemory {
                tensor,
                requested,
                budget,
                resident,
                in_use,
                loading,
            },
            Failure::Error(source) => StoreError::LoadFailed { tensor, source },
        }
    }
}

pub(crate) type Outcome<T> = Result<DeviceTensor<T>, Failure>;

struct SlotState<T: DeviceTarget> {
    outcome: Option<Outcome<T>>,
    wakers: Vec<Waker>,
}

/// Where the outcome of one upload is published, once.
pub(crate) struct Slot<T: DeviceTarget> {
    state: Mutex<SlotState<T>>,
    done: Condvar,
}

impl<T: DeviceTarget> Slot<T> {
    pub(crate) fn new() -> Arc<Slot<T>> {
        Arc::new(Slot {
            state: Mutex::new(SlotState {
                outcome: None,
                wakers: Vec::new(),
            }),
            done: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, SlotState<T>> {
        // Nothing panics while this lock is held; a poisoned lock still guards a
        // consistent state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Publishes the outcome and wakes every waiter. A slot resolves once: later calls
    /// are ignored.
    pub(crate) fn resolve(&self, outcome: Outcome<T>) {
        let wakers = {
            let mut state = self.lock();
            if state.outcome.is_some() {
                return;
            }
            state.outcome = Some(outcome);
            std::mem::take(&mut state.wakers)
        };
        self.done.notify_all();
        for waker in wakers {
            waker.wake();
        }
    }

    /// Blocks the calling thread until the outcome is published.
    pub(crate) fn wait(&self) -> Outcome<T> {
        let mut state = self.lock();
        loop {
            if let Some(outcome) = &state.outcome {
                return outcome.clone();
            }
            state = self
                .done
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// As [`Slot::wait`], looking at `stop` every `poll` as well: `None` once it is set
    /// (before the outcome is published).
    pub(crate) fn wait_or_stop(
        &self,
        stop: Option<&AtomicBool>,
        poll: Duration,
    ) -> Option<Outcome<T>> {
        let Some(stop) = stop else {
            return Some(self.wait());
        };
        let mut state = self.lock();
        loop {
            if let Some(outcome) = &state.outcome {
                return Some(outcome.clone());
            }
            if stop.load(Ordering::Relaxed) {
                return None;
            }
            state = self
                .done
                .wait_timeout(state, poll)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// The outcome if published; otherwise registers the task's waker.
    pub(crate) fn poll(&self, cx: &mut Context<'_>) -> Poll<Outcome<T>> {
        let mut state = self.lock();
        if let Some(outcome) = &state.outcome {
            return Poll::Ready(outcome.clone());
        }
        let waker = cx.waker();
        if !state.wakers.iter().any(|w| w.will_wake(waker)) {
            state.wakers.push(waker.clone());
        }
        Poll::Pending
    }
}
