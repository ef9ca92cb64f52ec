//! The host side of promotions: threads that copy an expert's bytes from the mapped
//! file into a page-locked staging buffer, from which the pass queues the copy to the
//! device. Reading the mapping never blocks a pass, and the device's copy engine reads
//! page-locked memory at the link's full rate.

use std::ops::Range;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use hip_backend::{Device, PinnedBuffer};
use tensor_store::TensorHandle;

use crate::gpu::gpu;
use crate::ModelError;

/// Staging buffers, each one expert's matrices: promotions under way at once.
pub(super) const STAGING: usize = 16;
/// Threads that stage them: copying from the page cache runs at a few GB/s a thread.
const STAGERS: usize = 4;

/// One expert's matrices to stage: which slot of which layer they go to, their bytes in
/// the file, and (once staged) the buffer holding them one after the other.
pub(super) struct Job {
    pub layer: usize,
    pub slot: usize,
    pub expert: usize,
    /// Each matrix's tensor and its expert's bytes within it.
    pub parts: Vec<(TensorHandle, Range<usize>)>,
    pub buffer: PinnedBuffer<u8>,
    /// Why the bytes could not be read, if they could not.
    pub failed: Option<ModelError>,
}

pub(super) struct Promoter {
    jobs: Option<mpsc::Sender<Job>>,
    staged: mpsc::Receiver<Job>,
    free: Vec<PinnedBuffer<u8>>,
    workers: Vec<JoinHandle<()>>,
}

impl Promoter {
    /// [`STAGING`] buffers of `bytes` each on `device`, and the threads that fill them.
    pub fn new(device: &Device, bytes: usize) -> Result<Promoter, ModelError> {
        let free = (0..STAGING)
            .map(|_| device.alloc_pinned::<u8>(bytes.max(1)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(gpu("the experts' staging buffers"))?;
        let (jobs, todo) = mpsc::channel::<Job>();
        let todo = Arc::new(Mutex::new(todo));
        let (done, staged) = mpsc::channel::<Job>();
        let workers = (0..STAGERS)
            .map(|i| {
                let (todo, done) = (Arc::clone(&todo), done.clone());
                std::thread::Builder::new()
                    .name(format!("rocmforge-experts-{i}"))
                    .spawn(move || loop {
                        let job = match todo.lock() {
                            Ok(todo) => todo.recv(),
                            Err(_) => return,
                        };
                        let Ok(mut job) = job else { return };
                        job.failed = stage(&mut job).err();
                        if done.send(job).is_err() {
                            return;
                        }
                    })
                    .map_err(|e| ModelError::InvalidGpuOption {
                        name: "expert promotions",
                        value: e.to_string(),
                        reason: "the threads that stage experts could not start",
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Promoter {
            jobs: Some(jobs),
            staged,
            free,
            workers,
        })
    }

    /// A free staging buffer, if one is.
    pub fn buffer(&mut self) -> Option<PinnedBuffer<u8>> {
        self.free.pop()
    }

    /// Gives a buffer back (its pending copies order its next use).
    pub fn give_back(&mut self, buffer: PinnedBuffer<u8>) {
        self.free.push(buffer);
    }

    /// Hands `job` to the threads; on failure, the buffer comes back.
    pub fn send(&mut self, job: Job) {
        if let Some(jobs) = &self.jobs {
            if let Err(mpsc::SendError(job)) = jobs.send(job) {
                self.free.push(job.buffer);
            }
        }
    }

    /// The jobs staged since the last call.
    pub fn staged(&mut self) -> Vec<Job> {
        self.staged.try_iter().collect()
    }
}

/// Copies `job`'s parts into its buffer, one after the other.
fn stage(job: &mut Job) -> Result<(), ModelError> {
    let buffer = job.buffer.as_mut_slice()?;
    let room = buffer.len();
    let mut at = 0;
    for (tensor, range) in &job.parts {
        let bytes = tensor.bytes()?;
        let src = bytes
            .get(range.clone())
            .ok_or_else(|| ModelError::TensorShape {
                name: tensor.name().to_owned(),
                expected: vec![range.end as u64],
                found: vec![bytes.len() as u64],
            })?;
        let dst = buffer
            .get_mut(at..at + src.len())
            .ok_or_else(|| ModelError::TensorShape {
                name: format!("{} (a staging buffer)", tensor.name()),
                expected: vec![(at + src.len()) as u64],
                found: vec![room as u64],
            })?;
        dst.copy_from_slice(src);
        at += src.len();
    }
    Ok(())
}

impl Drop for Promoter {
    fn drop(&mut self) {
        // The thread ends once its queue is closed and emptied.
        self.jobs = None;
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}
