//! Collectives across the GPUs of one process: all-reduce through NCCL (NVIDIA) or RCCL
//! (AMD), the libraries tensor-parallel inference sums partial results with.
//!
//! The library is loaded at run time ([`Collectives::load`], `dlopen`), never linked: NCCL
//! is hundreds of megabytes, and only runs spread over several GPUs need it, so a binary
//! starts and runs on one GPU where it is not installed. RCCL exports NCCL's API under
//! the same `nccl*` names, so one set of declarations serves both.
//!
//! Layers, as for the runtime: `sys` declares the C types and the entry points' function
//! pointer types and resolves them from the loaded library; `result` turns each
//! `ncclResult_t` into `Result<_, HipError>` carrying the call's name and the library's
//! message; [`Collectives`] and [`Communicator`] own the handles.
//!
//! ```no_run
//! use hip_backend::collective::{self, Collectives, Communicator};
//! use hip_backend::Device;
//!
//! # fn main() -> Result<(), hip_backend::HipError> {
//! let lib = Collectives::load(None)?;
//! let devices = vec![Device::open(0)?, Device::open(1)?];
//! let comms = Communicator::for_devices(&lib, &devices)?;
//! let streams = devices.iter().map(Device::new_stream).collect::<Result<Vec<_>, _>>()?;
//! let mut buffers = devices.iter().map(|d| d.alloc::<f32>(4096)).collect::<Result<Vec<_>, _>>()?;
//! // One thread drives every rank: the calls go inside one group.
//! collective::group(&lib, || {
//!     comms.iter().zip(&streams).zip(&mut buffers).try_for_each(|((comm, stream), buf)| {
//!         comm.all_reduce_sum(buf.view_mut(), stream)
//!     })
//! })??;
//! for stream in &streams {
//!     stream.synchronize()?;
//! }
//! # Ok(())
//! # }
//! ```

mod loader;
mod result;
mod sys;

use crate::device::{Device, DeviceContext};
use crate::error::{HipError, Result};
use crate::memory::DeviceViewMut;
use crate::stream::Stream;
use loader::Library;
use std::ffi::c_int;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use sys::{Functions, NcclComm};

/// The names [`Collectives::load`] tries, in order, when given no path: the platform's
/// library, by the name of its ABI version first.
fn default_names() -> &'static [&'static str] {
    if cfg!(hip_platform = "nvidia") {
        &["libnccl.so.2", "libnccl.so"]
    } else if cfg!(hip_platform = "amd") {
        &["librccl.so.1", "librccl.so"]
    } else {
        &[]
    }
}

/// The collectives library (NCCL or RCCL), loaded once and shared by every
/// [`Communicator`] made with it, which each keep it loaded.
///
/// Loading runs nothing on a device; the library is never unloaded from the process
/// (its threads and registered device code may outlive the last handle).
pub struct Collectives {
    functions: Functions,
    path: String,
    // Declared last so that it is closed after everything above is dropped.
    _library: Library,
}

impl std::fmt::Debug for Collectives {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Collectives")
            .field("path", &self.path)
            .finish()
    }
}

impl Collectives {
    /// Loads the library at `path`, or with `None` the platform's default names
    /// (NVIDIA: `libnccl.so.2`, then `libnccl.so`; AMD: `librccl.so.1`, then
    /// `librccl.so`) through the dynamic loader's search path (`LD_LIBRARY_PATH`, the
    /// `ldconfig` cache, the system directories). A path without a `/` is searched for the
    /// same way.
    ///
    /// Fails with [`HipError::BuiltWithoutGpu`] when built for platform `none`, and with
    /// [`HipError::CollectivesUnavailable`] naming every path tried and the loader's text
    /// when none loads or the library lacks an entry point this crate calls.
    pub fn load(path: Option<&Path>) -> Result<Arc<Collectives>> {
        if cfg!(hip_platform = "none") {
            return Err(HipError::BuiltWithoutGpu);
        }
        let candidates: Vec<PathBuf> = match path {
            Some(path) => vec![path.to_path_buf()],
            None => default_names().iter().map(PathBuf::from).collect(),
        };
        Collectives::load_first(&candidates).map(Arc::new)
    }

    /// Opens the first of `candidates` that loads and resolves its entry points.
    fn load_first(candidates: &[PathBuf]) -> Result<Collectives> {
        let tried = || {
            candidates
                .iter()
                .map(|path| path.display().to_string())
                .collect::<Vec<_>>()
        };
        let (library, name) = loader::open_first(candidates).map_err(|failures| {
            HipError::CollectivesUnavailable {
                tried: tried(),
                reason: if failures.is_empty() {
                    "no library to try on this platform".to_owned()
                } else {
                    failures.join("; ")
                },
            }
        })?;
        let functions =
            Functions::resolve(&library).map_err(|reason| HipError::CollectivesUnavailable {
                tried: vec![name.display().to_string()],
                reason: format!("{}: {reason}", name.display()),
            })?;
        let path = library
            .file_of(functions.get_version as *const std::ffi::c_void)
            .unwrap_or_else(|| name.display().to_string());
        Ok(Collectives {
            functions,
            path,
            _library: library,
        })
    }

    /// The library's version as it reports it (`ncclGetVersion`: 22703 for NCCL 2.27.3).
    pub fn version(&self) -> Result<i32> {
        result::get_version(&self.functions)
    }

    /// The file the library was loaded from: its full path as the dynamic loader found
    /// it, or the name or path it was asked for where the loader cannot say.
    pub fn path(&self) -> &str {
        &self.path
    }
}

/// Runs `f` inside one NCCL group (`ncclGroupStart` … `ncclGroupEnd`) and returns what it
/// returned. The collectives called in `f` are queued, and launched together when the
/// group ends; they must be, when one thread drives several ranks of a communicator
/// (called one by one, the ranks' collectives can deadlock). A group is per thread;
/// groups nest, and only the outermost one launches.
///
/// The group is ended even if `f` fails or panics. An error from ending it (a collective
/// the library could not launch) is returned in place of `f`'s result; check `f`'s own
/// result too, as a `Result` inside the `Result`.
pub fn group<R>(lib: &Collectives, f: impl FnOnce() -> R) -> Result<R> {
    /// Ends the group when dropped, so that a panic in `f` leaves no group open on the
    /// thread.
    struct Open<'a> {
        functions: &'a Functions,
        armed: bool,
    }
    impl Drop for Open<'_> {
        fn drop(&mut self) {
            if self.armed {
                let _ = result::group_end(self.functions);
            }
        }
    }

    result::group_start(&lib.functions)?;
    let mut open = Open {
        functions: &lib.functions,
        armed: true,
    };
    let value = f();
    open.armed = false;
    result::group_end(&lib.functions)?;
    Ok(value)
}

/// Checks that no device appears twice (by ordinal) in a communicator's device list.
fn check_distinct(ordinals: &[usize]) -> Result<()> {
    if ordinals.is_empty() {
        return Err(HipError::InvalidCommunicator {
            reason: "no devices given: a communicator needs at least one".to_owned(),
        });
    }
    for (rank, ordinal) in ordinals.iter().enumerate() {
        if let Some(earlier) = ordinals[..rank].iter().position(|o| o == ordinal) {
            return Err(HipError::InvalidCommunicator {
                reason: format!(
                    "gpu {ordinal} is given for ranks {earlier} and {rank}; each rank needs a \
                     device of its own"
                ),
            });
        }
    }
    Ok(())
}

/// One rank of a communicator over several devices of this process: what a collective
/// is called on, once per rank, each with that rank's stream.
///
/// `Send` but not `Sync`: a rank may move to the thread that drives its device, but the
/// library does not allow two threads to use one rank at once.
///
/// Dropping it destroys the rank (`ncclCommDestroy`) once the library has finished the
/// work queued on it; a failure is recorded and returned by the device's next
/// [`Device::check_err`]. Drop every [`crate::Graph`] that captured a collective of
/// this communicator first: the library waits for those graphs to be destroyed, so the
/// drop would never return.
pub struct Communicator {
    lib: Arc<Collectives>,
    context: Arc<DeviceContext>,
    raw: NcclComm,
    rank: usize,
    size: usize,
}

// SAFETY: the library lets any thread use a communicator handle, one thread at a time.
// Moving the owner to another thread keeps that: the type is not `Sync`, so no two threads
// reach one handle. The other fields (`Arc`s of `Sync` types, integers) are `Send`.
unsafe impl Send for Communicator {}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.context.ordinal())
            .finish()
    }
}

impl Communicator {
    /// Creates one communicator of `devices.len()` ranks, rank `i` on `devices[i]`
    /// (`ncclCommInitAll`), and returns its ranks in order. The devices must be distinct
    /// ([`HipError::InvalidCommunicator`] otherwise, also for an empty list); one device
    /// makes a communicator of one rank, whose all-reduce leaves the buffer as it is.
    ///
    /// The library sets up every device's connections before returning, which takes a
    /// while (a second or more): create the communicator once. The calling thread's
    /// current device may have changed afterwards; as after any call of this crate, bind
    /// the device ([`Device::make_current`]) before launching kernels (the crate's own
    /// calls bind by themselves). If it fails, whatever the library had created is left
    /// to the process's end.
    pub fn for_devices(lib: &Arc<Collectives>, devices: &[Device]) -> Result<Vec<Communicator>> {
        let ordinals: Vec<usize> = devices.iter().map(Device::ordinal).collect();
        check_distinct(&ordinals)?;
        let c_ordinals = ordinals
            .iter()
            .map(|&ordinal| {
                c_int::try_from(ordinal).map_err(|_| HipError::InvalidDevice { ordinal, count: 0 })
            })
            .collect::<Result<Vec<c_int>>>()?;
        let raws = result::comm_init_all(&lib.functions, &c_ordinals)?;
        let size = devices.len();
        Ok(raws
            .into_iter()
            .zip(devices)
            .enumerate()
            .map(|(rank, (raw, device))| Communicator {
                lib: Arc::clone(lib),
                context: Arc::clone(device.context()),
                raw,
                rank,
                size,
            })
            .collect())
    }

    /// This rank's index in the communicator, `0..size()`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// How many ranks the communicator has.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The ordinal of this rank's device.
    pub fn device(&self) -> usize {
        self.context.ordinal()
    }

    /// The library this communicator was made with.
    pub fn collectives(&self) -> &Arc<Collectives> {
        &self.lib
    }

    /// Queues the in-place sum of `buf` over every rank on `stream`: when it has run,
    /// each rank's buffer holds the element-wise sum of all ranks' buffers. `stream` and
    /// `buf` must belong to this rank's device ([`HipError::DeviceMismatch`] otherwise).
    ///
    /// Asynchronous, like a kernel launch: work queued on `stream` after it sees the sum.
    /// Inside a stream capture ([`Stream::capture`]) it is recorded, and the graph runs it
    /// again at each launch. Every rank must call it with the same length, in the same
    /// order relative to its other collectives; one thread driving several ranks makes
    /// the calls inside one [`group`]. An empty buffer queues nothing (on every rank
    /// alike, since all have the same length).
    pub fn all_reduce_sum(&self, mut buf: DeviceViewMut<'_, f32>, stream: &Stream) -> Result<()> {
        if stream.device_ordinal() != self.device() {
            return Err(HipError::DeviceMismatch {
                what: "the communicator",
                expected: stream.device_ordinal(),
                found: self.device(),
            });
        }
        if buf.device_ordinal() != self.device() {
            return Err(HipError::DeviceMismatch {
                what: "the buffer",
                expected: stream.device_ordinal(),
                found: buf.device_ordinal(),
            });
        }
        if buf.is_empty() {
            return Ok(());
        }
        self.context.bind()?;
        // SAFETY: `self.raw` is live until `Drop`; `stream` is live while borrowed and, like
        // `buf`, of this rank's device (checked above); `buf` is device memory of
        // `buf.len()` f32 kept allocated by its borrow, and the runtime's free waits for
        // the queued work that still uses it.
        unsafe {
            result::all_reduce_sum_f32(
                &self.lib.functions,
                buf.as_mut_ptr(),
                buf.len(),
                self.raw,
                stream.as_raw(),
            )
        }
    }

    /// The error this rank met in the background since it was created (a failed
    /// transfer, a peer that went away), if any: a collective that seems not to finish
    /// may have failed there.
    pub fn async_error(&self) -> Result<()> {
        // SAFETY: `self.raw` is live until `Drop`.
        unsafe { result::comm_async_error(&self.lib.functions, self.raw) }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // Bind the rank's device, as every release in this crate does (the library also
        // switches to it); the rank is destroyed even if that fails.
        if let Err(error) = self.context.bind() {
            self.context.defer(error);
        }
        // SAFETY: our own handle from `ncclCommInitAll`, destroyed only here.
        if let Err(error) = unsafe { result::comm_destroy(&self.lib.functions, self.raw) } {
            self.context.defer(error);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_platform_has_its_library_names() {
        let names = default_names();
        match crate::PLATFORM {
            crate::Platform::Nvidia => assert_eq!(names, ["libnccl.so.2", "libnccl.so"]),
            crate::Platform::Amd => assert_eq!(names, ["librccl.so.1", "librccl.so"]),
            crate::Platform::None => assert!(names.is_empty()),
        }
    }

    #[test]
    fn a_library_that_does_not_load_is_named_in_the_error() {
        // The loading itself, below `load`'s platform check, so that it runs on every
        // platform.
        let missing = PathBuf::from("/nonexistent/libnccl.so.2");
        let also = PathBuf::from("/nonexistent/libnccl.so");
        let error =
            Collectives::load_first(&[missing.clone(), also.clone()]).expect_err("nothing to load");
        let text = error.to_string();
        assert!(
            matches!(&error, HipError::CollectivesUnavailable { tried, .. } if tried.len() == 2),
            "{error:?}"
        );
        for path in [&missing, &also] {
            assert!(text.contains(&*path.to_string_lossy()), "{text}");
        }
        assert!(text.contains("NCCL") && text.contains("RCCL"), "{text}");
    }

    #[test]
    fn a_library_without_the_entry_points_is_refused_by_name() {
        // The C library loads but exports no `nccl*` symbol.
        let error = Collectives::load_first(&[PathBuf::from("libc.so.6")])
            .expect_err("libc is no collectives library");
        let text = error.to_string();
        assert!(text.contains("libc.so.6"), "{text}");
        assert!(text.contains("ncclGetVersion"), "{text}");
    }

    #[test]
    fn device_lists_must_be_non_empty_and_distinct() {
        assert!(check_distinct(&[0]).is_ok());
        assert!(check_distinct(&[3, 1, 0, 2]).is_ok());
        assert!(matches!(
            check_distinct(&[]),
            Err(HipError::InvalidCommunicator { .. })
        ));
        let text = check_distinct(&[0, 1, 0])
            .expect_err("gpu 0 twice")
            .to_string();
        assert!(
            text.contains("gpu 0") && text.contains("ranks 0 and 2"),
            "{text}"
        );
    }
}
