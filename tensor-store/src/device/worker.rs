//! What the pipeline's threads do with a job: read it, queue its copies, account for
//! them; and the publisher, which waits for each tensor's fence and makes it `Ready`.

use std::sync::mpsc::Receiver;
use std::sync::{Arc, PoisonError};

use super::cache::DeviceTensor;
use super::pipeline::{Job, Message, Queued, Shared};
use super::slot::Failure;
use super::target::DeviceTarget;
use crate::StoreError;

impl<T: DeviceTarget> Shared<T> {
    /// Reads a job's range and queues its copies, then accounts for them.
    pub(super) fn run_job(&self, mut job: Job<T>) {
        let _span = tracing::debug_span!(
            "upload_chunk",
            offset = job.file_start,
            bytes = job.file_end - job.file_start
        )
        .entered();
        let target = &self.cache.target;
        let mut failed: Vec<(usize, Arc<StoreError>)> = Vec::new();
        let len = (job.file_end - job.file_start) as usize;
        let mut lead = 0;
        if len > 0 {
            let read = target
                .staging_bytes(&mut job.staging)
                .and_then(|bytes| self.files.read(job.shard, job.file_start, len, bytes));
            match read {
                Ok(at) => lead = at,
                Err(error) => {
                    let error = Arc::new(error);
                    failed.extend(job.pieces.iter().map(|p| (p.idx, Arc::clone(&error))));
                }
            }
        }
        let current = self.lock().epoch == job.epoch;
        if failed.is_empty() && current {
            for piece in job.pieces.iter().filter(|p| p.len > 0) {
                let mut buffer = piece.buffer.lock().unwrap_or_else(PoisonError::into_inner);
                let Some(buffer) = buffer.as_mut() else {
                    continue;
                };
                let start = lead + piece.chunk_offset as usize;
                let copied = target.copy_to_device(
                    &mut job.staging,
                    start..start + piece.len as usize,
                    buffer,
                    piece.tensor_offset,
                );
                if let Err(error) = copied {
                    failed.push((piece.idx, Arc::new(error)));
                }
            }
        }
        self.finish_job(job, failed);
    }

    /// Accounts for a job's pieces: a tensor whose last copy is queued gets a fence and
    /// goes to the publisher; a tensor with a failed piece is given up.
    fn finish_job(&self, job: Job<T>, failed: Vec<(usize, Arc<StoreError>)>) {
        let mut q = self.lock();
        q.busy -= 1;
        q.staging.push_back(job.staging);
        let mut abandoned = Vec::new();
        let mut buffers = Vec::new();
        for piece in &job.pieces {
            let Some(at) = q.active.iter().position(|a| a.idx == piece.idx) else {
                continue; // given up meanwhile
            };
            if let Some((_, error)) = failed.iter().find(|(idx, _)| *idx == piece.idx) {
                let active = q.active.swap_remove(at);
                if !active.demand {
                    q.prefetch_error.get_or_insert_with(|| Arc::clone(error));
                }
                q.status[active.idx] = Queued::No;
                buffers.extend(active.take_buffer());
                abandoned.push((
                    active.idx,
                    Some(active.size),
                    Failure::Error(Arc::clone(error)),
                ));
                continue;
            }
            let active = &mut q.active[at];
            active.copied += piece.len;
            if active.copied == active.size {
                let active = q.active.swap_remove(at);
                q.status[active.idx] = Queued::No;
                if let Some(buffer) = active.take_buffer() {
                    // After this tensor's last copy (ours, queued above; the others were
                    // queued before their readers took this lock).
                    let fence = self.cache.target.record_fence();
                    q.pending += 1;
                    self.send(Message::Publish {
                        idx: active.idx,
                        fence,
                        buffer,
                    });
                }
            }
        }
        if abandoned.is_empty() {
            drop(q);
            self.signal.notify_all();
        } else {
            self.fail_and_bury(q, abandoned, buffers);
        }
    }

    /// The publisher thread's loop: ends when every sender is gone.
    pub(crate) fn run_publisher(&self, messages: Receiver<Message<T>>) {
        for message in messages {
            match message {
                Message::Publish { idx, fence, buffer } => self.publish(idx, fence, buffer),
                Message::Bury {
                    fence,
                    buffers,
                    bytes,
                } => {
                    // A failure is logged there; the buffers go either way.
                    self.wait_or_synchronize(fence).ok();
                    drop(buffers);
                    self.cache.release(bytes);
                }
            }
            self.lock().pending -= 1;
            self.signal.notify_all();
        }
    }

    fn wait_or_synchronize(&self, fence: Result<T::Fence, StoreError>) -> Result<(), StoreError> {
        let target = &self.cache.target;
        let waited = fence.and_then(|fence| target.wait_fence(&fence));
        if let Err(error) = &waited {
            tracing::warn!(%error, "fence failed; waiting for the whole copy stream");
            if let Err(error) = target.synchronize() {
                tracing::error!(%error, "copy stream failed too");
            }
        }
        waited
    }

    fn publish(&self, idx: usize, fence: Result<T::Fence, StoreError>, buffer: T::Buffer) {
        let size = self.handles[idx].size();
        match self.wait_or_synchronize(fence) {
            Ok(()) => {
                let tensor = DeviceTensor::new(self.handles[idx].clone(), buffer);
                let slot = self.cache.publish(idx, &tensor);
                self.progress.record(idx, size);
                if let Some(slot) = slot {
                    slot.resolve(Ok(tensor));
                }
            }
            Err(error) => {
                drop(buffer);
                let slot = self.cache.abandon(idx, Some(size));
                self.cache.release(size);
                if let Some(slot) = slot {
                    slot.resolve(Err(Failure::Error(Arc::new(error))));
                }
            }
        }
    }
}
