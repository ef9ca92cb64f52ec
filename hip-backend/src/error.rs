//! The crate's one error type.

/// Everything that can go wrong in hip-backend. Messages are lower case and name the
/// offending values; runtime failures carry the runtime's own error name and message.
#[derive(Debug, thiserror::Error)]
pub enum HipError {
    /// The crate was compiled for platform `none`: no GPU runtime is linked in.
    #[error(
        "built without gpu support: hip-backend was compiled for platform `none`; rebuild \
         with HIP_PLATFORM=amd or HIP_PLATFORM=nvidia and the matching toolchain installed"
    )]
    BuiltWithoutGpu,

    /// The runtime is linked in but finds no usable device (no GPU, or no driver).
    #[error(
        "no {platform} gpu device available: {call} returned {}",
        status_text(name, *code, message)
    )]
    NoDevice {
        platform: &'static str,
        call: &'static str,
        code: i32,
        name: String,
        message: String,
    },

    /// A device ordinal beyond the devices present.
    #[error("gpu device {ordinal} does not exist: {count} device(s) present")]
    InvalidDevice { ordinal: usize, count: usize },

    /// A device or page-locked host allocation the runtime could not satisfy.
    #[error("out of memory: {call} could not allocate {bytes} bytes ({name}: {message})")]
    OutOfMemory {
        call: &'static str,
        bytes: usize,
        name: String,
        message: String,
    },

    /// An operating-system call on host memory failed (mapping the region that a ring of
    /// page-locked buffers shares, or unmapping it).
    #[error("{call} of {bytes} bytes of host memory failed: {source}")]
    HostMemory {
        call: &'static str,
        bytes: usize,
        #[source]
        source: std::io::Error,
    },

    /// Any other failed runtime call.
    #[error("{call} failed with {}", status_text(name, *code, message))]
    Api {
        call: &'static str,
        code: i32,
        name: String,
        message: String,
    },

    /// A device arena has no free block large enough.
    #[error(
        "device arena full: {requested} bytes aligned to {align} do not fit ({used} of \
         {capacity} bytes in use, largest free block {largest_free} bytes)"
    )]
    ArenaFull {
        requested: usize,
        align: usize,
        used: usize,
        capacity: usize,
        largest_free: usize,
    },

    /// An alignment that is zero or not a power of two.
    #[error("invalid alignment {align}: it must be a power of two")]
    InvalidAlignment { align: usize },

    /// An element count whose size in bytes does not fit in `usize`.
    #[error("size overflow: {count} elements of {elem_size} bytes do not fit in memory")]
    SizeOverflow { count: usize, elem_size: usize },

    /// Source and destination of a copy differ in length.
    #[error("length mismatch in {op}: source has {src} elements, destination {dst}")]
    LengthMismatch {
        op: &'static str,
        src: usize,
        dst: usize,
    },

    /// A sub-range that does not lie inside its buffer.
    #[error("range {start}..{end} is out of bounds for a buffer of {len} elements")]
    OutOfBounds {
        start: usize,
        end: usize,
        len: usize,
    },

    /// A typed view whose size or alignment does not fit the bytes beneath it.
    #[error(
        "cannot view {bytes} bytes at device address {addr:#x} as {type_name} \
         (size {elem_size}, alignment {elem_align})"
    )]
    BadCast {
        bytes: usize,
        addr: usize,
        type_name: &'static str,
        elem_size: usize,
        elem_align: usize,
    },

    /// Memory of one device used with a stream or event of another.
    #[error("device mismatch: {what} belongs to gpu {found} but the stream to gpu {expected}")]
    DeviceMismatch {
        what: &'static str,
        expected: usize,
        found: usize,
    },

    /// Failures recorded while releasing resources (in `Drop`), reported by a later call.
    #[error("{count} failure(s) while releasing gpu resources; first: {first}")]
    Deferred { count: usize, first: Box<HipError> },

    /// A pinned buffer whose last copy could not be confirmed finished. Its memory is
    /// withheld from the program (and never freed) because the device may still use it.
    #[error("pinned buffer unusable: the copy last queued on it could not be confirmed finished: {reason}")]
    PinnedBufferPoisoned { reason: String },

    /// The collectives library (NCCL or RCCL) could not be loaded: none of the paths
    /// tried loads, or the one that does lacks an entry point this crate calls. `reason`
    /// holds the dynamic loader's text for each path tried.
    #[error(
        "collectives library unavailable: tried {}: {reason}; tensor-parallel runs need \
         NCCL (NVIDIA) or RCCL (AMD): install it where the dynamic loader finds it \
         (LD_LIBRARY_PATH or the ldconfig cache) or give the full path of libnccl.so.2 \
         or librccl.so.1",
        tried.join(", ")
    )]
    CollectivesUnavailable { tried: Vec<String>, reason: String },

    /// A communicator that cannot be made as asked (no devices, a device given twice).
    #[error("invalid communicator: {reason}")]
    InvalidCommunicator { reason: String },
}

impl HipError {
    /// True for the two "no GPU here" cases a caller usually reports rather than fails on:
    /// built without GPU support, or no device found.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, HipError::BuiltWithoutGpu | HipError::NoDevice { .. })
    }
}

/// Shorthand used throughout the crate.
pub type Result<T, E = HipError> = std::result::Result<T, E>;

/// A runtime status as `name (code): message`, without the message where the runtime
/// gives its name again in place of a description (HIP does for `hipErrorNoDevice`).
fn status_text(name: &str, code: i32, message: &str) -> String {
    if message.is_empty() || message == name {
        format!("{name} ({code})")
    } else {
        format!("{name} ({code}): {message}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_name_is_said_once() {
        let no_device = HipError::NoDevice {
            platform: "amd",
            call: "hipGetDeviceCount",
            code: 100,
            name: "hipErrorNoDevice".into(),
            message: "hipErrorNoDevice".into(),
        };
        assert_eq!(
            no_device.to_string(),
            "no amd gpu device available: hipGetDeviceCount returned hipErrorNoDevice (100)"
        );
        let api = HipError::Api {
            call: "hipMalloc",
            code: 2,
            name: "cudaErrorMemoryAllocation".into(),
            message: "out of memory".into(),
        };
        assert_eq!(
            api.to_string(),
            "hipMalloc failed with cudaErrorMemoryAllocation (2): out of memory"
        );
    }
}
