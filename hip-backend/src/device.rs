//! Devices: discovery, properties, memory figures, and the per-device context that every
//! owning type holds to bind the device and to record failures from `Drop`.

use crate::arena::DeviceArena;
use crate::error::{HipError, Result};
use crate::memory::{AllocationCounters, Counters, DeviceBuffer};
use crate::pinned::PinnedBuffer;
use crate::result;
use crate::stream::{Event, Stream};
use crate::sys::RfhipDeviceProps;
use bytemuck::Pod;
use std::ffi::{c_char, CStr};
use std::sync::{Arc, Mutex, MutexGuard};

/// What one GPU is, as `list_devices` and [`Device::info`] report it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Index among the runtime's devices.
    pub ordinal: usize,
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3` or `AMD Instinct MI210`.
    pub name: String,
    /// Architecture: `gfx90a:sramecc+:xnack-` style on AMD, `sm_90` style on NVIDIA.
    pub arch: String,
    /// Device memory in bytes.
    pub total_memory: usize,
    /// Free device memory in bytes when it was asked (`list_devices` asks; `None` if the
    /// query failed).
    pub free_memory: Option<usize>,
    /// Compute units (AMD) or streaming multiprocessors (NVIDIA).
    pub multiprocessor_count: u32,
    /// Threads per warp (wavefront).
    pub warp_size: u32,
    /// `domain:bus:device.0`, as `lspci` prints it.
    pub pci_bus_id: String,
}

impl DeviceInfo {
    fn from_props(
        ordinal: usize,
        props: &RfhipDeviceProps,
        free_memory: Option<usize>,
    ) -> DeviceInfo {
        DeviceInfo {
            ordinal,
            name: fixed_c_string(&props.name),
            arch: fixed_c_string(&props.arch),
            total_memory: props.total_memory,
            free_memory,
            multiprocessor_count: u32::try_from(props.multiprocessor_count).unwrap_or(0),
            warp_size: u32::try_from(props.warp_size).unwrap_or(0),
            pci_bus_id: format!(
                "{:04x}:{:02x}:{:02x}.0",
                props.pci_domain, props.pci_bus, props.pci_device
            ),
        }
    }
}

/// Reads a C string from a fixed array, stopping at the first NUL or at the array's end.
fn fixed_c_string(bytes: &[c_char]) -> String {
    let bytes: Vec<u8> = bytes.iter().map(|&c| c as u8).collect();
    match CStr::from_bytes_until_nul(&bytes) {
        Ok(text) => text.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// Free and total device memory, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    pub free: usize,
    pub total: usize,
}

/// Versions of the HIP (or CUDA) runtime linked in and of the installed driver, in the
/// runtime's own encoding (CUDA: 1000 × major + 10 × minor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuntimeVersions {
    pub runtime: i32,
    pub driver: i32,
}

/// The runtime and driver versions.
pub fn runtime_versions() -> Result<RuntimeVersions> {
    Ok(RuntimeVersions {
        runtime: result::runtime_version()?,
        driver: result::driver_version()?,
    })
}

/// Every GPU the runtime sees, with its free memory. Fails with
/// [`HipError::BuiltWithoutGpu`] or [`HipError::NoDevice`] when there is none to list.
pub fn list_devices() -> Result<Vec<DeviceInfo>> {
    let count = Device::count()?;
    (0..count)
        .map(|ordinal| {
            let props = result::device_props(ordinal)?;
            let free = result::set_device(ordinal)
                .and_then(|()| result::mem_get_info())
                .ok()
                .map(|(free, _)| free);
            Ok(DeviceInfo::from_props(ordinal, &props, free))
        })
        .collect()
}

#[derive(Default)]
struct Deferred {
    first: Option<HipError>,
    count: usize,
}

/// Shared by a [`Device`] and everything created from it.
pub(crate) struct DeviceContext {
    ordinal: usize,
    deferred: Mutex<Deferred>,
    counters: Counters,
}

impl DeviceContext {
    fn new(ordinal: usize) -> DeviceContext {
        DeviceContext {
            ordinal,
            deferred: Mutex::new(Deferred::default()),
            counters: Counters::new(),
        }
    }

    pub(crate) fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    /// Makes this device current on the calling thread (the runtime keeps the current
    /// device per thread, so every call that allocates or creates binds first).
    pub(crate) fn bind(&self) -> Result<()> {
        result::set_device(self.ordinal)
    }

    fn deferred(&self) -> MutexGuard<'_, Deferred> {
        // A panic while holding this lock cannot leave `Deferred` inconsistent: keep going.
        self.deferred
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records a failure that happened where it could not be returned (in `Drop`).
    pub(crate) fn defer(&self, error: HipError) {
        let mut deferred = self.deferred();
        deferred.count += 1;
        deferred.first.get_or_insert(error);
    }

    /// Returns (and forgets) the failures recorded since the last check.
    pub(crate) fn check_err(&self) -> Result<()> {
        let mut deferred = self.deferred();
        let count = std::mem::take(&mut deferred.count);
        match deferred.first.take() {
            Some(first) => Err(HipError::Deferred {
                count,
                first: Box::new(first),
            }),
            None => Ok(()),
        }
    }
}

/// One GPU, opened. Cheap to clone; everything created from it keeps its context alive.
#[derive(Clone)]
pub struct Device {
    context: Arc<DeviceContext>,
    info: Arc<DeviceInfo>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("info", &self.info).finish()
    }
}

/// Device 0 for the GPU test `test`, or `None` after writing `SKIPPED <test>: <reason>`
/// to stderr when this build or machine has no usable GPU: the tests then pass, and
/// `cargo xtask test` counts the line. Any other failure to open the device panics.
pub fn device_or_skip(test: &str) -> Option<Device> {
    match Device::open(0) {
        Ok(device) => Some(device),
        Err(error) if error.is_unavailable() => {
            // Written to the process's stderr directly, in one piece: the harness
            // captures only the print macros, and a skip must be visible.
            let line = format!("SKIPPED {test}: {error}\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
            None
        }
        Err(error) => panic!("{test}: opening device 0 failed: {error}"),
    }
}

impl Device {
    /// How many devices the runtime sees; zero devices is [`HipError::NoDevice`].
    pub fn count() -> Result<usize> {
        match result::device_count()? {
            0 => Err(HipError::NoDevice {
                platform: crate::PLATFORM.name(),
                call: "hipGetDeviceCount",
                code: 0,
                name: "zeroDevices".into(),
                message: "the runtime reports no devices".into(),
            }),
            count => Ok(count),
        }
    }

    /// Opens device `ordinal` and reads its properties.
    pub fn open(ordinal: usize) -> Result<Device> {
        let count = Device::count()?;
        if ordinal >= count {
            return Err(HipError::InvalidDevice { ordinal, count });
        }
        result::set_device(ordinal)?;
        let props = result::device_props(ordinal)?;
        Ok(Device {
            context: Arc::new(DeviceContext::new(ordinal)),
            info: Arc::new(DeviceInfo::from_props(ordinal, &props, None)),
        })
    }

    pub(crate) fn context(&self) -> &Arc<DeviceContext> {
        &self.context
    }

    pub fn ordinal(&self) -> usize {
        self.context.ordinal
    }

    /// Properties read when the device was opened (`free_memory` is `None` here: ask
    /// [`Device::memory_info`]).
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn name(&self) -> &str {
        &self.info.name
    }

    pub fn arch(&self) -> &str {
        &self.info.arch
    }

    pub fn total_memory(&self) -> usize {
        self.info.total_memory
    }

    /// Makes this device the calling thread's current one. The runtime launches a kernel
    /// on the current device's context, so a thread that drives several devices binds
    /// each before queuing kernels on its streams (allocations, streams and copies bind
    /// by themselves).
    pub fn make_current(&self) -> Result<()> {
        self.context.bind()
    }

    /// Whether this device can read and write `peer`'s memory directly (over NVLink,
    /// PCIe or Infinity Fabric); a device is its own peer.
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        if peer.ordinal() == self.ordinal() {
            return Ok(true);
        }
        result::device_can_access_peer(self.ordinal(), peer.ordinal())
    }

    /// Lets this device reach `peer`'s memory directly, so that copies between the two
    /// ([`Stream::copy_peer_async`]) take the devices' link rather than the host. Allowed
    /// already, or `peer` being this device: nothing to do. Fails where
    /// [`Device::can_access_peer`] says no.
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        if peer.ordinal() == self.ordinal() {
            return Ok(());
        }
        self.context.bind()?;
        result::device_enable_peer_access(peer.ordinal())
    }

    /// Free and total device memory now.
    pub fn memory_info(&self) -> Result<MemoryInfo> {
        self.context.bind()?;
        let (free, total) = result::mem_get_info()?;
        Ok(MemoryInfo { free, total })
    }

    /// Waits for all work on the device, then reports any failure recorded in `Drop`.
    pub fn synchronize(&self) -> Result<()> {
        self.context.bind()?;
        result::device_synchronize()?;
        self.check_err()
    }

    /// Allocations made through this handle and its clones (not through other handles
    /// opened on the same device). An arena counts as one device allocation.
    pub fn allocation_counters(&self) -> AllocationCounters {
        self.context.counters().snapshot()
    }

    /// Returns the failures recorded while releasing this device's resources (buffers,
    /// streams, events dropped since the last check) and forgets them.
    pub fn check_err(&self) -> Result<()> {
        self.context.check_err()
    }

    /// A new non-blocking stream (it does not wait for the legacy default stream).
    pub fn new_stream(&self) -> Result<Stream> {
        Stream::new(self)
    }

    /// A new event that can time the work between two records.
    pub fn new_event(&self) -> Result<Event> {
        Event::new(self, true)
    }

    /// A new event for ordering only: cheaper to record, cannot time.
    pub fn new_sync_event(&self) -> Result<Event> {
        Event::new(self, false)
    }

    /// `len` elements of device memory, contents unspecified (one device allocation).
    pub fn alloc<T: Pod>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::new(self, len)
    }

    /// `len` elements of page-locked host memory, zeroed.
    pub fn alloc_pinned<T: Pod>(&self, len: usize) -> Result<PinnedBuffer<T>> {
        PinnedBuffer::new(self, len)
    }

    /// `count` buffers of `len` elements of page-locked host memory each, zeroed, that
    /// share one allocation: a single private anonymous mapping, made resident and
    /// registered with the runtime in one call (page-locked for every device), which costs
    /// far less than `count` calls of [`Device::alloc_pinned`]. Each buffer starts on a
    /// page boundary of its own and works as any [`PinnedBuffer`] does. The region counts
    /// as one page-locked allocation; it is unregistered and unmapped when the last of its
    /// buffers drops (each first waits for its own copies). Memory of the ring's size made
    /// resident ahead of time ([`crate::prepare_pinned_ring`]) is taken rather than mapped
    /// anew, so that only the registration is left to do.
    ///
    /// Fails with [`HipError::HostMemory`] when the system refuses the mapping, and with
    /// the runtime's error (out of memory, as a rule) when it refuses the registration.
    pub fn alloc_pinned_ring<T: Pod>(
        &self,
        count: usize,
        len: usize,
    ) -> Result<Vec<PinnedBuffer<T>>> {
        PinnedBuffer::ring(self, count, len)
    }

    /// An arena of `capacity` bytes (one device allocation) to carve buffers from.
    pub fn new_arena(&self, capacity: usize) -> Result<DeviceArena> {
        DeviceArena::new(self, capacity)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_strings_stop_at_nul_or_at_the_end() {
        let mut name = [0 as c_char; 8];
        for (slot, byte) in name.iter_mut().zip(b"gfx90a") {
            *slot = *byte as c_char;
        }
        assert_eq!(fixed_c_string(&name), "gfx90a");
        let full = [b'x' as c_char; 4];
        assert_eq!(fixed_c_string(&full), "xxxx");
    }

    #[test]
    fn deferred_failures_are_counted_reported_once_and_forgotten() {
        let context = DeviceContext::new(0);
        assert!(context.check_err().is_ok());
        context.defer(HipError::InvalidAlignment { align: 3 });
        context.defer(HipError::InvalidAlignment { align: 5 });
        match context.check_err() {
            Err(HipError::Deferred { count: 2, first }) => {
                assert!(matches!(*first, HipError::InvalidAlignment { align: 3 }));
            }
            other => panic!("expected two deferred failures, got {other:?}"),
        }
        assert!(context.check_err().is_ok());
    }

    #[test]
    fn pci_bus_ids_print_like_lspci() {
        let mut props = RfhipDeviceProps::zeroed();
        props.pci_bus = 0x65;
        props.pci_device = 3;
        props.total_memory = 1 << 30;
        let info = DeviceInfo::from_props(1, &props, Some(5));
        assert_eq!(info.pci_bus_id, "0000:65:03.0");
        assert_eq!(
            (info.ordinal, info.total_memory, info.free_memory),
            (1, 1 << 30, Some(5))
        );
    }
}
