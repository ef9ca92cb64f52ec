//! `--device auto|gpu|cpu` for `generate`: which device computes, and why.
//!
//! The GPU runtime takes a few hundred milliseconds to start, so it starts on its own
//! thread as soon as the arguments are read, while the model file is opened and parsed.

use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{bail, Result};
use hip_backend::{Device, HipError};

/// Where `generate` computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceArg {
    /// The GPU when one is usable, else the CPU.
    Auto,
    /// The GPU, or an error saying why it cannot be used.
    Gpu,
    /// The CPU.
    Cpu,
}

/// The outcome of starting the GPU runtime in the background.
pub struct GpuStart {
    thread: Option<JoinHandle<(Result<Device, HipError>, Instant)>>,
    arg: DeviceArg,
}

/// The device that will compute, and how long its runtime took to start.
pub enum Chosen {
    Gpu { device: Device, ready_at: Instant },
    Cpu { reason: String },
}

impl Chosen {
    /// The device for `model`: the GPU when it runs the model (its architecture and
    /// types, a mixture of experts whose weights fit `budget_mib`, or the device's free
    /// memory, and a quantized KV cache, `kv_types`, only with every weight there);
    /// otherwise `auto` (`arg`) computes on the CPU, saying why, and `gpu`
    /// keeps the GPU, whose model then fails naming the reason.
    pub fn for_model(
        self,
        model: &model::Model,
        arg: DeviceArg,
        budget_mib: Option<u64>,
        kv_types: model::KvTypes,
        placement: &crate::options::Placement,
    ) -> Chosen {
        let split = !matches!(placement, crate::options::Placement::One(_));
        let support = match &self {
            // A split's stages check their own devices as they are built.
            Chosen::Gpu { .. } if split => model.check_gpu_support(),
            Chosen::Gpu { device, .. } => model.check_gpu_support().and_then(|()| {
                let budget = budget_mib.map(|mib| mib.saturating_mul(1 << 20));
                model::gpu::check_experts_fit(model, device, budget)?;
                model::gpu::check_cache_fits(model, device, budget, kv_types)
            }),
            Chosen::Cpu { .. } => Ok(()),
        };
        match (self, support) {
            (Chosen::Gpu { .. }, Err(unsupported)) if arg == DeviceArg::Auto => Chosen::Cpu {
                reason: unsupported.to_string(),
            },
            (chosen, _) => chosen,
        }
    }
}

impl GpuStart {
    /// Starts GPU `ordinal`'s runtime on a thread, unless `arg` is `cpu`.
    pub fn begin(arg: DeviceArg, ordinal: usize) -> GpuStart {
        let thread = (arg != DeviceArg::Cpu).then(|| {
            std::thread::spawn(move || {
                let device = Device::open(ordinal);
                (device, Instant::now())
            })
        });
        GpuStart { thread, arg }
    }

    /// Waits for the runtime and decides: `gpu` without a usable GPU is an error that
    /// says why; `auto` falls back to the CPU quietly (the reason goes to the log).
    pub fn finish(mut self) -> Result<Chosen> {
        let Some(thread) = self.thread.take() else {
            return Ok(Chosen::Cpu {
                reason: "--device cpu".to_owned(),
            });
        };
        let (device, ready_at) = match thread.join() {
            Ok(result) => result,
            Err(_) => bail!("the GPU runtime's start failed"),
        };
        match (device, self.arg) {
            (Ok(device), _) => Ok(Chosen::Gpu { device, ready_at }),
            (Err(error), DeviceArg::Gpu) => bail!("--device gpu: no usable GPU: {error}"),
            (Err(error), _) => Ok(Chosen::Cpu {
                reason: format!("no usable GPU ({error})"),
            }),
        }
    }
}

impl Drop for GpuStart {
    /// A command that fails before it asks for the device (a missing model, say) still
    /// waits for the runtime's start: the process must not exit, and run the runtime's
    /// teardown, while another thread is inside its initialization (the C heap was
    /// corrupted that way now and then).
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
