//! Stopping and failing on the GPU: a stop flag set before or during an eager or a
//! background load, injected allocation failures (`hip_backend::fault`) at every
//! allocation a `GpuModel` makes, and a model larger than the device. Each ends in a
//! clear error, never a panic, and leaves the device's free memory as it found it.
//!
//! Free memory must come back whole. The runtime takes device memory of its own on
//! first use (its context, and the code of each kernel when it first runs, since kernels
//! are loaded lazily), so every test first builds and runs the model it will test once,
//! and measures only after that: from there on every byte taken is ours, and every byte
//! must come back.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gguf_format::{GgmlType, GgufWriter};
use hip_backend::{fault, Device};
use model::generate::{generate_with, GenerateOptions, Next, Session, StopReason};
use model::gpu::{GpuModel, GpuOptions};
use model::sampling::SamplingParams;
use model::tokenizer::{TokenId, Tokenizer};
use model::{Model, ModelError};
use tensor_store::device::UploadMode;
use tensor_store::TensorStore;

use super::{open_spec, skip};

/// How soon a stop must be honoured once the work in hand (a layer) is done.
const PROMPT: Duration = Duration::from_millis(100);

/// Device 0, or `None` after saying why the test is skipped.
fn device(test: &str) -> Option<Device> {
    match Device::open(0) {
        Ok(device) => Some(device),
        Err(error) if error.is_unavailable() => {
            skip(test, &error.to_string());
            None
        }
        Err(error) => panic!("{test}: {error}"),
    }
}

/// Free device memory once all queued work is done.
fn free_memory(device: &Device) -> usize {
    device.synchronize().expect("device idle");
    device.memory_info().expect("memory info").free
}

/// Free device memory at least `before`: all of ours came back. (Not exactly `before`:
/// the runtime may release memory of its own meanwhile; it did, 2 MiB, after a failed
/// arena allocation on the H100.)
#[track_caller]
fn assert_no_leak(device: &Device, before: usize, what: impl std::fmt::Display) {
    let after = free_memory(device);
    assert!(
        after >= before,
        "{what}: {} bytes of device memory not given back",
        before - after
    );
}

fn options(mode: UploadMode, stop: Option<&Arc<AtomicBool>>) -> GpuOptions {
    GpuOptions {
        stop: stop.cloned(),
        ..GpuOptions::new(mode, 64)
    }
}

/// A Llama of `layers` blocks `n_embd` wide whose weights are all zeros, written as a
/// sparse file (its header, then a hole): models of gigabytes cost no disk and no time
/// to make, and read back at memory speed. Zero weights compute zeros, never a NaN.
struct Zeros {
    _dir: tempfile::TempDir,
    model: Model,
    bytes: u64,
}

fn zero_llama(layers: usize, n_embd: u64, n_ff: u64) -> Zeros {
    let (heads, kv_heads, vocab) = (n_embd / 128, 8u64, 256u64);
    let kv_dim = kv_heads * 128;
    let mut w = GgufWriter::new();
    for (key, value) in [
        ("block_count", layers as u64),
        ("embedding_length", n_embd),
        ("feed_forward_length", n_ff),
        ("attention.head_count", heads),
        ("attention.head_count_kv", kv_heads),
        ("rope.dimension_count", 128),
        ("context_length", 4096),
        ("vocab_size", vocab),
    ] {
        w.add_metadata(&format!("llama.{key}"), value as u32)
            .unwrap();
    }
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("llama.attention.layer_norm_rms_epsilon", 1e-5f32)
        .unwrap();
    let q8 = GgmlType::Q8_0;
    w.add_tensor("token_embd.weight", q8, &[n_embd, vocab])
        .unwrap();
    for l in 0..layers {
        let name = |s: &str| format!("blk.{l}.{s}.weight");
        let tensors: [(&str, GgmlType, Vec<u64>); 9] = [
            ("attn_norm", GgmlType::F32, vec![n_embd]),
            ("attn_q", q8, vec![n_embd, n_embd]),
            ("attn_k", q8, vec![n_embd, kv_dim]),
            ("attn_v", q8, vec![n_embd, kv_dim]),
            ("attn_output", q8, vec![n_embd, n_embd]),
            ("ffn_norm", GgmlType::F32, vec![n_embd]),
            ("ffn_gate", q8, vec![n_embd, n_ff]),
            ("ffn_up", q8, vec![n_embd, n_ff]),
            ("ffn_down", q8, vec![n_ff, n_embd]),
        ];
        for (role, ty, shape) in tensors {
            w.add_tensor(&name(role), ty, &shape).unwrap();
        }
    }
    w.add_tensor("output_norm.weight", GgmlType::F32, &[n_embd])
        .unwrap();
    w.add_tensor("output.weight", q8, &[n_embd, vocab]).unwrap();
    let layout = w.layout().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path: PathBuf = dir.path().join("zeros.gguf");
    let file = std::fs::File::create(&path).unwrap();
    std::io::Write::write_all(&mut &file, &layout.header).unwrap();
    file.set_len(layout.file_len).unwrap();
    let store = TensorStore::open(&path).unwrap();
    let model = Model::load(&store).unwrap();
    let bytes = model.plan().handles().iter().map(|h| h.size()).sum();
    Zeros {
        _dir: dir,
        model,
        bytes,
    }
}

/// A model of about 4.5 GB: an eager upload takes some 100 ms even at the H100's
/// 55 GB/s, so a stop comes during it.
fn large_model() -> Zeros {
    zero_llama(64, 2048, 8192)
}

/// Builds and runs `model` once, so the runtime's own first-use allocations are made
/// before anything is measured.
fn warm_up(model: &Model) {
    let mut gpu = GpuModel::new(model, &options(UploadMode::Eager, None)).expect("warm-up");
    let tokens: Vec<u32> = (1..=20).collect();
    gpu.forward(&tokens).expect("warm-up prompt");
    gpu.forward(&[1]).expect("warm-up decode");
    gpu.forward(&[2]).expect("warm-up replay");
    // A few tokens: the kernels of short chunks (the skinny batch products), which the
    // runtime loads on their first launch.
    gpu.forward(&[3, 4, 5]).expect("warm-up few tokens");
}

/// Sets `flag` from another thread once `ready` says so, `delay` later; returns when it
/// did.
fn set_when(
    flag: &Arc<AtomicBool>,
    delay: Duration,
    ready: impl Fn() -> bool + Send + 'static,
) -> std::thread::JoinHandle<Instant> {
    let flag = Arc::clone(flag);
    std::thread::spawn(move || {
        let start = Instant::now();
        while !ready() && start.elapsed() < Duration::from_secs(30) {
            std::thread::sleep(Duration::from_micros(200));
        }
        std::thread::sleep(delay);
        flag.store(true, Ordering::SeqCst);
        Instant::now()
    })
}

/// Runs `work` while `setter` sets the stop flag: it must end in
/// [`ModelError::Interrupted`] within [`PROMPT`] of the flag. `what` names the work.
fn stops_in_time<T>(
    test: &str,
    what: &str,
    setter: std::thread::JoinHandle<Instant>,
    work: impl FnOnce() -> Result<T, ModelError>,
) {
    let start = Instant::now();
    let result = work();
    let returned = Instant::now();
    let stopped_at = setter.join().unwrap();
    match result {
        Err(ModelError::Interrupted) => {}
        Err(error) => panic!("{test}: {error}"),
        Ok(_) => panic!(
            "{test}: {what} ended in {:?}, before the stop: make the model larger",
            start.elapsed()
        ),
    }
    let late = returned.saturating_duration_since(stopped_at);
    eprintln!("gpu stop during {what}: returned {late:?} after the flag");
    assert!(late < PROMPT, "{test}: returned {late:?} after the flag");
}

#[test]
fn gpu_stop_before_or_during_an_eager_load_frees_everything() {
    let test = "gpu_stop_before_or_during_an_eager_load_frees_everything";
    let Some(device) = device(test) else { return };
    let zeros = large_model();
    warm_up(&zeros.model);
    let before = free_memory(&device);

    // Set before: refused before the device is touched.
    let stop = Arc::new(AtomicBool::new(true));
    let start = Instant::now();
    let result = GpuModel::new(&zeros.model, &options(UploadMode::Eager, Some(&stop)));
    assert!(matches!(result, Err(ModelError::Interrupted)), "{test}");
    assert!(start.elapsed() < PROMPT, "{test}: {:?}", start.elapsed());
    assert_no_leak(
        &device,
        before,
        format_args!("{test}: stop before the load"),
    );

    // Set during: the weights' arena is the second device allocation of the build.
    let stop = Arc::new(AtomicBool::new(false));
    let allocations = hip_backend::allocation_counters().device_allocations;
    let setter = set_when(&stop, Duration::from_millis(5), move || {
        hip_backend::allocation_counters().device_allocations >= allocations + 2
    });
    stops_in_time(test, "an eager load", setter, || {
        GpuModel::new(&zeros.model, &options(UploadMode::Eager, Some(&stop)))
    });
    assert_no_leak(
        &device,
        before,
        format_args!("{test}: stop during the load"),
    );
}

#[test]
fn gpu_stop_during_a_background_load_and_its_forward_pass_frees_everything() {
    let test = "gpu_stop_during_a_background_load_and_its_forward_pass_frees_everything";
    let Some(device) = device(test) else { return };
    let zeros = large_model();
    warm_up(&zeros.model);
    let before = free_memory(&device);
    let tokens: Vec<u32> = (1..=16).collect();
    {
        let stop = Arc::new(AtomicBool::new(false));
        let mut gpu = GpuModel::new(&zeros.model, &options(UploadMode::Background, Some(&stop)))
            .expect("a background load starts");
        // The prompt's pass waits for each layer's upload; the flag comes meanwhile.
        let setter = set_when(&stop, Duration::from_millis(5), || true);
        stops_in_time(test, "a background load's pass", setter, || {
            gpu.forward(&tokens)
        });
        // The KV cache is as before the call, and the model still works once the flag
        // is cleared: what was cancelled uploads again.
        assert_eq!(gpu.len(), 0, "{test}");
        assert!(!gpu.cache().progress().is_complete(), "{test}");
        stop.store(false, Ordering::SeqCst);
        let logits = gpu.forward(&tokens).expect("the pass after the stop");
        assert!(logits.iter().all(|v| v.is_finite()), "{test}");
        assert_eq!(gpu.len(), tokens.len(), "{test}");
        // A stop with every weight held stops the next pass at once.
        stop.store(true, Ordering::SeqCst);
        assert!(matches!(gpu.forward(&[3]), Err(ModelError::Interrupted)));
        assert_eq!(gpu.len(), tokens.len(), "{test}");
    }
    assert_no_leak(&device, before, format_args!("{test}"));
}

/// Every device allocation, then every page-locked one, that building and running a
/// model makes is failed in turn: each failure is a clear error (or, for a staging
/// buffer the ring can do without, a smaller ring), and nothing is left behind.
#[test]
fn gpu_injected_allocation_failures_are_clear_errors_and_leak_nothing() {
    let test = "gpu_injected_allocation_failures_are_clear_errors_and_leak_nothing";
    let Some(device) = device(test) else { return };
    let (_dir, _store, model) = open_spec("llama-q4_k");
    warm_up(&model);
    let before = free_memory(&device);
    let tokens: Vec<u32> = (1..=20).collect();
    for (kind, arm) in [
        (
            "device",
            fault::fail_device_allocation as fn(u64) -> fault::Armed,
        ),
        ("page-locked", fault::fail_pinned_allocation),
    ] {
        let mut failures = 0;
        for nth in 1..=64 {
            let armed = arm(nth);
            let outcome = GpuModel::new(&model, &options(UploadMode::Eager, None))
                .and_then(|mut gpu| gpu.forward(&tokens).map(|_| gpu.len()));
            // The model is gone, the threads that grew its staging ring joined: whether
            // the chosen allocation came is settled.
            let fired = armed.fired();
            drop(armed);
            match outcome {
                Err(error) => {
                    assert!(fired, "{test}: {kind} allocation {nth}: {error}");
                    let text = error.to_string();
                    assert!(
                        text.contains("no room for") || text.contains("out of memory"),
                        "{test}: {kind} allocation {nth}: unclear error: {text}"
                    );
                    eprintln!("gpu {kind} allocation {nth} failed: {text}");
                    failures += 1;
                }
                Ok(len) => {
                    assert_eq!(len, tokens.len());
                    if !fired {
                        // Past the last allocation: every one has been tried.
                        assert_no_leak(
                            &device,
                            before,
                            format_args!("{test}: {kind}: a clean run"),
                        );
                        break;
                    }
                }
            }
            assert_no_leak(
                &device,
                before,
                "{test}: {kind} allocation {nth} failed and leaked",
            );
            assert!(nth < 64, "{test}: {kind}: more allocations than expected");
        }
        assert!(failures > 0, "{test}: no {kind} allocation failed");
    }
}

/// A budget beyond the device is capped at the model's size and works. A model larger
/// than the device runs without a budget (its first layers held in what the device has
/// free, the rest passing through), and is a clear error naming the weights with a
/// budget beyond the device.
#[test]
fn gpu_a_budget_or_a_model_beyond_the_device_is_a_clear_error_or_works() {
    let test = "gpu_a_budget_or_a_model_beyond_the_device_is_a_clear_error_or_works";
    let Some(device) = device(test) else { return };
    let (_dir, _store, model) = open_spec("llama-q4_k");
    warm_up(&model);
    // One layer of the huge model's shapes and types: the runtime loads the kernels its
    // passes take (which depend on the matrices' sizes) on their first launch.
    let one_layer = zero_llama(1, 8192, 28672);
    warm_up(&one_layer.model);
    let per_layer = one_layer.bytes;
    drop(one_layer);
    let before = free_memory(&device);
    let total = device.total_memory() as u64;
    {
        let options = GpuOptions {
            budget: Some(u64::MAX),
            ..options(UploadMode::Eager, None)
        };
        let mut gpu = GpuModel::new(&model, &options).expect("a budget beyond the device");
        assert!(gpu.forward(&[1, 2, 3]).is_ok(), "{test}");
    }
    assert_no_leak(&device, before, format_args!("{test}: a large budget"));

    // 70B-shaped layers of about 0.9 GB, enough of them to outgrow the device.
    let huge = zero_llama((total / per_layer + 2) as usize, 8192, 28672);
    assert!(huge.bytes > total, "{test}");
    {
        let start = Instant::now();
        let mut gpu = GpuModel::new(&huge.model, &options(UploadMode::Background, None))
            .expect("a model beyond the device, without a budget");
        let logits = gpu.forward(&[1, 2]).expect("its prompt");
        assert!(logits.iter().all(|v| v.is_finite()), "{test}");
        let logits = gpu.forward(&[3]).expect("a token");
        assert!(logits.iter().all(|v| v.is_finite()), "{test}");
        eprintln!(
            "gpu model of {} bytes on a device of {total}: two passes in {:?}",
            huge.bytes,
            start.elapsed()
        );
    }
    assert_no_leak(
        &device,
        before,
        format_args!("{test}: a model beyond the device"),
    );
    let options = GpuOptions {
        budget: Some(total.saturating_mul(2)),
        ..options(UploadMode::Background, None)
    };
    match GpuModel::new(&huge.model, &options) {
        Err(ModelError::GpuOutOfMemory {
            what, requested, ..
        }) => {
            assert_eq!(what, "the weights", "{test}");
            assert!(requested > total, "{test}: {requested}");
        }
        Err(error) => panic!("{test}: a budget beyond the device: unexpected {error}"),
        Ok(_) => panic!("{test}: {} bytes fit in {total}", huge.bytes),
    }
    assert_no_leak(
        &device,
        before,
        format_args!("{test}: a budget beyond the device"),
    );
}

/// A back end that stops inside a pass, as the GPU's does between layers.
struct StopsOnPass {
    n_vocab: usize,
    passes: usize,
    stop_on: usize,
    logits: Vec<f32>,
}

impl Session for StopsOnPass {
    fn eval(&mut self, _tokens: &[TokenId], _greedy: bool) -> Result<Next<'_>, ModelError> {
        self.passes += 1;
        if self.passes == self.stop_on {
            return Err(ModelError::Interrupted);
        }
        self.logits = vec![0.0; self.n_vocab];
        self.logits[self.passes + 100] = 1.0;
        Ok(Next::Logits(&self.logits))
    }

    fn shift(
        &mut self,
        _keep: usize,
        _discard: usize,
        _kept: &[TokenId],
    ) -> Result<(), ModelError> {
        Ok(())
    }
}

/// Without a GPU too: an interruption inside a pass ends generation as a Ctrl-C after a
/// token does, with what was generated before it.
#[test]
fn a_pass_stopped_inside_ends_generation_as_interrupted() {
    let (_dir, store, model) = open_spec("llama-q4_0");
    let tokenizer = Tokenizer::from_metadata(store.metadata()).expect("tokenizer");
    let options = GenerateOptions {
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        }
        .validate()
        .expect("greedy"),
        max_tokens: 10,
        context_size: 32,
        attention: model::AttentionMethod::default(),
        kv_types: Default::default(),
        context_shift: None,
    };
    for stop_on in [1, 3] {
        let mut session = StopsOnPass {
            n_vocab: model.config().n_vocab,
            passes: 0,
            stop_on,
            logits: Vec::new(),
        };
        let stop = AtomicBool::new(false);
        let output = generate_with(
            &mut session,
            &tokenizer,
            &[1, 2, 3],
            &options,
            &stop,
            |_| ControlFlow::Continue(()),
        )
        .expect("an interruption is not an error");
        assert_eq!(output.stop_reason, StopReason::Interrupted);
        assert_eq!(output.tokens.len(), stop_on - 1);
    }
}
