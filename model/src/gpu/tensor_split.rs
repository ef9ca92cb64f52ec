//! A model split by tensors over several GPUs of one process: every device runs every
//! layer on its share of the attention heads (and their part of the KV cache) and of the
//! feed-forward rows ([`super::shard`]), and the devices add up their partial products
//! with one all-reduce after the attention and one after the feed-forward block
//! (NCCL on NVIDIA, RCCL on AMD, loaded at run time: [`hip_backend::Collectives`]).
//! A token reads each device's share of the weights at once, where a split by layers
//! reads them one device after another.
//!
//! Each device's share is a [`GpuModel`] of its heads and rows, run by a thread of its
//! own (collectives need every device's work queued at once); the first device runs on
//! the caller's thread and alone computes the logits. A device's decode step is a
//! captured graph with its all-reduces inside. The sums' order differs from one
//! device's, so the logits match the one-device model's within the GPU's tolerance, not
//! bit for bit.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use hip_backend::{Collectives, Communicator, Device};
use tensor_store::device::{CacheStats, UploadMode};

use super::shard::Shard;
use super::{check_stop, gpu, GpuModel, GpuOptions, Part, Want, MAX_BATCH};
use crate::{Model, ModelError};

/// How a model is split by tensors over several GPUs.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorOptions {
    /// The GPUs' ordinals, distinct; the first computes the logits.
    pub devices: Vec<usize>,
    /// The collectives library (NCCL or RCCL) to load; `None`: the platform's usual
    /// names through the dynamic loader's search path.
    pub library: Option<PathBuf>,
}

/// What a device's thread is asked to do.
enum Job {
    Eval(Arc<[u32]>, Want),
    Position(usize),
    /// One all-reduce, so that the devices' connections are made before any capture.
    Warm,
}

/// A device driven by a thread of its own.
struct Worker {
    device: usize,
    jobs: Option<Sender<Job>>,
    done: Receiver<Result<(), ModelError>>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    fn start(mut model: GpuModel) -> Result<Worker, ModelError> {
        let device = model.device.ordinal();
        let (jobs, inbox) = channel::<Job>();
        let (reply, done) = channel();
        let thread = std::thread::Builder::new()
            .name(format!("gpu{device}-shard"))
            .spawn(move || {
                while let Ok(job) = inbox.recv() {
                    let result = model
                        .device
                        .make_current()
                        .map_err(gpu("device"))
                        .and_then(|()| run(&mut model, job));
                    if reply.send(result).is_err() {
                        break;
                    }
                }
            })
            .map_err(|_| ModelError::DeviceThread {
                device,
                what: "could not be started",
            })?;
        Ok(Worker {
            device,
            jobs: Some(jobs),
            done,
            thread: Some(thread),
        })
    }

    fn send(&self, job: Job) -> Result<(), ModelError> {
        self.jobs
            .as_ref()
            .and_then(|j| j.send(job).ok())
            .ok_or(ModelError::DeviceThread {
                device: self.device,
                what: "has stopped",
            })
    }

    fn wait(&self) -> Result<(), ModelError> {
        self.done.recv().map_err(|_| ModelError::DeviceThread {
            device: self.device,
            what: "has stopped",
        })?
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Its channel closed, the thread finishes its job and ends.
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            thread.join().ok();
        }
    }
}

/// One job on one device's share.
fn run(model: &mut GpuModel, job: Job) -> Result<(), ModelError> {
    match job {
        Job::Eval(tokens, want) => model.eval(&tokens, want),
        Job::Position(len) => model.set_position(len),
        Job::Warm => warm(model),
    }
}

fn warm(model: &mut GpuModel) -> Result<(), ModelError> {
    let team = model
        .bufs
        .team
        .take()
        .expect("a device of a split has a team");
    let reduced = model.bufs.x_mut(1).and_then(|x| {
        team.all_reduce_sum(x, &model.stream)
            .map_err(gpu("a first all-reduce"))
    });
    model.bufs.team = Some(team);
    reduced?;
    model.sync()
}

/// A model split by tensors over several GPUs ([`TensorOptions`]), with one sequence's
/// KV cache split by heads.
pub struct TensorSplit {
    /// The first device's share: it computes the logits.
    lead: GpuModel,
    /// The other devices' shares, each on its thread; dropped before `lead`.
    workers: Vec<Worker>,
    stop: Option<Arc<AtomicBool>>,
    library: Arc<Collectives>,
}

impl TensorSplit {
    /// Splits `model` over `split.devices`, each device set up as `options` says (its
    /// `device` replaced, its weights uploaded before this returns), with prompts in
    /// chunks of `prompt_batch`. Refuses, naming why, a model or a set of devices the
    /// split cannot take, and a missing collectives library.
    pub fn new(
        model: &Model,
        options: &GpuOptions,
        split: &TensorOptions,
        prompt_batch: usize,
    ) -> Result<TensorSplit, ModelError> {
        let devices = &split.devices;
        let mut distinct = devices.clone();
        distinct.sort_unstable();
        distinct.dedup();
        if distinct.len() != devices.len() {
            return Err(ModelError::InvalidGpuOption {
                name: "devices",
                value: format!("{devices:?}"),
                reason: "a split by tensors takes distinct devices",
            });
        }
        let shards = Shard::all(model.config(), model.plan(), devices.len())?;
        model.check_gpu_support()?;
        check_stop(options.stop.as_deref())?;
        let library = Collectives::load(split.library.as_deref()).map_err(gpu("collectives"))?;
        let opened = devices
            .iter()
            .map(|&d| Device::open(d).map_err(gpu("device")))
            .collect::<Result<Vec<_>, _>>()?;
        let comms = Communicator::for_devices(&library, &opened).map_err(gpu("collectives"))?;
        tracing::info!(
            library = library.path(),
            devices = ?devices,
            "a split by tensors"
        );
        // The devices' shares are built at once, each on a thread of its own. A device
        // never stops between all-reduces on its own (the others would wait for it
        // forever): the split checks `stop` between calls.
        let parts = shards
            .into_iter()
            .zip(devices)
            .map(|(shard, &device)| {
                let rank_options = GpuOptions {
                    device,
                    mode: UploadMode::Eager,
                    stop: None,
                    ..options.clone()
                };
                let part = Part {
                    layers: 0..model.config().n_layers,
                    embed: true,
                    head: shard.leads(),
                    shard: Some(shard),
                };
                (rank_options, part)
            })
            .collect();
        let mut ranks = GpuModel::build_each(model, parts, prompt_batch, None)?;
        for (rank, comm) in ranks.iter_mut().zip(comms) {
            rank.bufs.team = Some(comm);
        }
        let mut ranks = ranks.into_iter();
        let lead = ranks.next().expect("a split has two devices or more");
        let workers = ranks.map(Worker::start).collect::<Result<Vec<_>, _>>()?;
        let mut split = TensorSplit {
            lead,
            workers,
            stop: options.stop.clone(),
            library,
        };
        split.on_every(|| Job::Warm, warm)?;
        Ok(split)
    }

    /// `job` on every device but the first, while `lead` runs on the first; the first
    /// failure, once every device has finished.
    fn on_every(
        &mut self,
        job: impl Fn() -> Job,
        lead: impl FnOnce(&mut GpuModel) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let mut sent = Vec::with_capacity(self.workers.len());
        for worker in &self.workers {
            sent.push(worker.send(job()));
        }
        let first = self
            .lead
            .device
            .make_current()
            .map_err(gpu("device"))
            .and_then(|()| lead(&mut self.lead));
        let mut result = first;
        for (worker, sent) in self.workers.iter().zip(sent) {
            let done = sent.and_then(|()| worker.wait());
            result = result.and(done);
        }
        result
    }

    fn eval(&mut self, tokens: &[u32], want: Want) -> Result<(), ModelError> {
        check_stop(self.stop.as_deref())?;
        // Refused calls are refused before any device starts.
        self.lead.check_call(tokens, want)?;
        let shared: Arc<[u32]> = tokens.into();
        self.on_every(
            || Job::Eval(Arc::clone(&shared), want),
            |lead| lead.eval(tokens, want),
        )
    }

    /// Appends `tokens` to the KV cache and returns the logits of the last one.
    pub fn forward_logits(&mut self, tokens: &[u32]) -> Result<&[f32], ModelError> {
        self.eval(tokens, Want::Logits)?;
        self.lead.logits(1)
    }

    /// Appends `tokens` and returns the greedy choice after the last one.
    pub fn forward_argmax(&mut self, tokens: &[u32]) -> Result<u32, ModelError> {
        self.eval(tokens, Want::Argmax)?;
        Ok(self.lead.greedy_tokens(1)?[0])
    }

    /// Appends `tokens` and returns the logits of every one of them, `n_vocab` each.
    pub fn forward_all_logits(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let mut out = Vec::with_capacity(tokens.len() * self.n_vocab());
        for chunk in tokens.chunks(MAX_BATCH) {
            self.eval(chunk, Want::AllLogits)?;
            out.extend_from_slice(self.lead.logits(chunk.len())?);
        }
        Ok(out)
    }

    /// Forgets every position.
    pub fn clear(&mut self) -> Result<(), ModelError> {
        self.on_every(|| Job::Position(0), |lead| lead.set_position(0))
    }

    /// Logits a position.
    pub fn n_vocab(&self) -> usize {
        self.lead.n_vocab()
    }

    /// Positions in the KV cache.
    pub fn len(&self) -> usize {
        self.lead.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Most positions the KV cache holds.
    pub fn capacity(&self) -> usize {
        self.lead.capacity()
    }

    /// Most tokens of a prompt's chunk.
    pub fn prompt_batch(&self) -> usize {
        self.lead.prompt_batch()
    }

    /// The devices, the first the one that computes the logits.
    pub fn devices(&self) -> Vec<usize> {
        std::iter::once(self.lead.device.ordinal())
            .chain(self.workers.iter().map(|w| w.device))
            .collect()
    }

    /// The collectives library in use, and its version.
    pub fn library(&self) -> (String, Option<i32>) {
        (self.library.path().to_owned(), self.library.version().ok())
    }

    /// The first device's weight cache's counters (the others' shares are uploaded
    /// alike, outside their caches).
    pub fn cache_stats(&self) -> CacheStats {
        self.lead.cache().stats()
    }

    /// When the first device had every weight (the others had theirs before the split
    /// was returned).
    pub fn uploaded_at(&self) -> Option<std::time::Instant> {
        self.lead.uploaded_at()
    }

    /// When the first pass had every weight it waits for.
    pub fn first_pass_weights_at(&self) -> Option<std::time::Instant> {
        self.lead.first_pass_weights_at()
    }
}

impl Drop for TensorSplit {
    fn drop(&mut self) {
        // The other devices' threads end before the first device's share goes.
        self.workers.clear();
    }
}
