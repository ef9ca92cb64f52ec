//! A testing hook: make a chosen device or page-locked allocation fail, as a full device
//! would, to test the paths that clean up after one.
//!
//! The counters are process-wide: arm them only from a test that runs alone (the GPU
//! suite runs with `--test-threads 1`), since any thread's allocation counts. An armed
//! counter costs one atomic read-modify-write per allocation; a disarmed one, a load.
//! Nothing in the project arms them outside tests.
//!
//! ```no_run
//! use hip_backend::fault;
//! // The third device allocation from now fails with `HipError::OutOfMemory`.
//! let armed = fault::fail_device_allocation(3);
//! // ... build something that allocates ...
//! let fired = armed.fired(); // whether the third allocation happened
//! drop(armed); // disarms it, fired or not
//! ```

use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::HipError;

/// Which allocations a countdown applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `hipMalloc`: buffers and arenas in device memory.
    Device,
    /// `hipHostMalloc`: page-locked host memory (staging, results); also `hipHostRegister`
    /// of the region a ring of page-locked buffers shares.
    Pinned,
}

/// 0: disarmed; n > 0: the n-th allocation from now fails.
static DEVICE_COUNTDOWN: AtomicU64 = AtomicU64::new(0);
static PINNED_COUNTDOWN: AtomicU64 = AtomicU64::new(0);
/// Failures injected so far, per kind.
static DEVICE_FIRED: AtomicU64 = AtomicU64::new(0);
static PINNED_FIRED: AtomicU64 = AtomicU64::new(0);

fn counters(kind: Kind) -> (&'static AtomicU64, &'static AtomicU64) {
    match kind {
        Kind::Device => (&DEVICE_COUNTDOWN, &DEVICE_FIRED),
        Kind::Pinned => (&PINNED_COUNTDOWN, &PINNED_FIRED),
    }
}

/// An armed countdown; dropping it disarms the countdown (fired or not).
#[must_use = "the countdown is disarmed when this is dropped"]
#[derive(Debug)]
pub struct Armed {
    kind: Kind,
    fired_before: u64,
}

impl Armed {
    /// True once the chosen allocation has been made to fail.
    pub fn fired(&self) -> bool {
        counters(self.kind).1.load(Ordering::SeqCst) > self.fired_before
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        counters(self.kind).0.store(0, Ordering::SeqCst);
    }
}

fn arm(kind: Kind, nth: u64) -> Armed {
    assert!(nth > 0, "the first allocation from now is 1");
    let (countdown, fired) = counters(kind);
    let armed = Armed {
        kind,
        fired_before: fired.load(Ordering::SeqCst),
    };
    countdown.store(nth, Ordering::SeqCst);
    armed
}

/// Makes the `nth` device allocation from now (1: the next one) fail with
/// [`HipError::OutOfMemory`] without calling the runtime.
pub fn fail_device_allocation(nth: u64) -> Armed {
    arm(Kind::Device, nth)
}

/// Makes the `nth` page-locked host allocation from now (1: the next one) fail with
/// [`HipError::OutOfMemory`] without calling the runtime.
pub fn fail_pinned_allocation(nth: u64) -> Armed {
    arm(Kind::Pinned, nth)
}

/// Called by each allocation before it asks the runtime: the injected failure, when this
/// allocation is the chosen one.
pub(crate) fn check(kind: Kind, call: &'static str, bytes: usize) -> Result<(), HipError> {
    let (countdown, fired) = counters(kind);
    count_down(countdown, fired, call, bytes)
}

fn count_down(
    countdown: &AtomicU64,
    fired: &AtomicU64,
    call: &'static str,
    bytes: usize,
) -> Result<(), HipError> {
    if countdown.load(Ordering::Relaxed) == 0 {
        return Ok(());
    }
    let step = countdown.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    if step != Ok(1) {
        return Ok(());
    }
    fired.fetch_add(1, Ordering::SeqCst);
    Err(HipError::OutOfMemory {
        call,
        bytes,
        name: "injectedFault".into(),
        message: "failed on purpose by hip_backend::fault".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chosen_allocation_fails_once() {
        // Counters of its own: the process-wide ones belong to the tests that run alone.
        let (countdown, fired) = (AtomicU64::new(2), AtomicU64::new(0));
        assert!(count_down(&countdown, &fired, "hipMalloc", 10).is_ok());
        assert_eq!(fired.load(Ordering::SeqCst), 0);
        match count_down(&countdown, &fired, "hipMalloc", 10) {
            Err(HipError::OutOfMemory {
                call: "hipMalloc",
                bytes: 10,
                name,
                ..
            }) => assert_eq!(name, "injectedFault"),
            other => panic!("expected the injected failure, got {other:?}"),
        }
        assert_eq!(fired.load(Ordering::SeqCst), 1);
        for _ in 0..3 {
            assert!(count_down(&countdown, &fired, "hipMalloc", 10).is_ok());
        }
        assert_eq!(countdown.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_disarmed_countdown_never_fails() {
        let (countdown, fired) = (AtomicU64::new(0), AtomicU64::new(0));
        for _ in 0..3 {
            assert!(count_down(&countdown, &fired, "hipHostMalloc", 1).is_ok());
        }
        assert_eq!(fired.load(Ordering::SeqCst), 0);
    }
}
