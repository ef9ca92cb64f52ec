//! Progress of a load: tensors and bytes resident of the upload order's total, and which
//! layer groups are complete.

use std::sync::{Mutex, PoisonError};

use super::order::UploadOrder;

/// How far the upload has come. "Done" counts tensors of the upload order the first
/// time each becomes resident; an evicted tensor uploaded again counts only in
/// `bytes_uploaded`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    pub tensors_done: usize,
    pub tensors_total: usize,
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// Bytes of every upload completed, repeated ones and tensors outside the order
    /// included.
    pub bytes_uploaded: u64,
    /// Groups whose tensors have all been resident.
    pub groups_done: usize,
    pub groups_total: usize,
    /// The group the last upload completed, if it did.
    pub completed_group: Option<usize>,
}

impl Progress {
    /// True when every tensor of the order has been resident.
    pub fn is_complete(&self) -> bool {
        self.tensors_done == self.tensors_total
    }
}

/// A function told about each completed upload, on the pipeline's publisher thread: it
/// should return quickly.
pub type ProgressCallback = Box<dyn Fn(&Progress) + Send + Sync>;

struct State {
    done: Vec<bool>,
    group_remaining: Vec<usize>,
    progress: Progress,
}

pub(crate) struct ProgressTracker {
    /// Position in the upload order of each tensor of the store.
    position: Vec<Option<usize>>,
    /// Group of each position.
    group_of: Vec<usize>,
    state: Mutex<State>,
    callback: Option<ProgressCallback>,
}

impl ProgressTracker {
    pub(crate) fn new(
        order: &UploadOrder,
        n_tensors: usize,
        callback: Option<ProgressCallback>,
    ) -> ProgressTracker {
        let mut position = vec![None; n_tensors];
        for (at, handle) in order.tensors().iter().enumerate() {
            position[handle.index()] = Some(at);
        }
        let mut group_of = vec![0; order.tensors().len()];
        for (g, group) in order.groups().iter().enumerate() {
            group_of[group.tensors.clone()].fill(g);
        }
        ProgressTracker {
            position,
            group_of,
            state: Mutex::new(State {
                done: vec![false; order.tensors().len()],
                group_remaining: order.groups().iter().map(|g| g.tensors.len()).collect(),
                progress: Progress {
                    tensors_total: order.tensors().len(),
                    bytes_total: order.total_bytes(),
                    groups_total: order.groups().len(),
                    ..Progress::default()
                },
            }),
            callback,
        }
    }

    /// Counts a completed upload of tensor `idx` and tells the callback.
    pub(crate) fn record(&self, idx: usize, size: u64) {
        let snapshot = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            let state = &mut *state;
            state.progress.bytes_uploaded += size;
            state.progress.completed_group = None;
            if let Some(at) = self.position[idx].filter(|&at| !state.done[at]) {
                state.done[at] = true;
                state.progress.tensors_done += 1;
                state.progress.bytes_done += size;
                let group = self.group_of[at];
                state.group_remaining[group] -= 1;
                if state.group_remaining[group] == 0 {
                    state.progress.groups_done += 1;
                    state.progress.completed_group = Some(group);
                }
            }
            state.progress
        };
        if let Some(callback) = &self.callback {
            callback(&snapshot);
        }
    }

    pub(crate) fn snapshot(&self) -> Progress {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        Progress {
            completed_group: None,
            ..state.progress
        }
    }
}
