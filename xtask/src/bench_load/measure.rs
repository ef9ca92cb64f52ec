//! What bench-load measures around the loader: the machine's own limits (file read and
//! host→device copy bandwidth), peak resident memory, and dropping the page cache.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{bail, Context, Result};

/// Peak and current resident memory of this process, in bytes (`VmHWM`, `VmRSS`).
pub fn rss() -> Result<(u64, u64)> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let field = |name: &str| -> Result<u64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(name))
            .with_context(|| format!("no {name} in /proc/self/status"))?;
        let kib: u64 = line[name.len()..]
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .with_context(|| format!("bad {name} line {line:?}"))?;
        Ok(kib * 1024)
    };
    Ok((field("VmHWM:")?, field("VmRSS:")?))
}

/// Resets the peak resident figure to the current one (Linux 4.0+), so each run's peak
/// is its own.
pub fn reset_peak_rss() -> Result<()> {
    std::fs::write("/proc/self/clear_refs", "5")
        .context("resetting VmHWM through /proc/self/clear_refs")
}

/// How the page cache was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dropped {
    /// `echo 3 > /proc/sys/vm/drop_caches`: every clean page of the machine.
    AllCaches,
    /// `posix_fadvise(DONTNEED)` on the file: its clean pages only.
    FileOnly,
}

impl Dropped {
    pub fn name(self) -> &'static str {
        match self {
            Dropped::AllCaches => "drop_caches",
            Dropped::FileOnly => "fadvise_dontneed",
        }
    }
}

/// Evicts `path` from the page cache: all caches where allowed (root), else the file's
/// pages.
pub fn drop_page_cache(path: &Path) -> Result<Dropped> {
    // SAFETY: `sync` takes no arguments and only flushes dirty pages; it cannot fail.
    unsafe { libc::sync() };
    if std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok() {
        return Ok(Dropped::AllCaches);
    }
    let file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    file.sync_all().ok();
    // SAFETY: the descriptor is open for as long as `file` lives, which covers the call;
    // offset 0 and length 0 name the whole file, and the advice only drops clean pages.
    let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if rc != 0 {
        bail!(
            "cannot drop the page cache: /proc/sys/vm/drop_caches is not writable and \
             posix_fadvise failed with {}",
            std::io::Error::from_raw_os_error(rc)
        );
    }
    Ok(Dropped::FileOnly)
}

/// A buffer of `len` bytes aligned for direct reads.
struct Aligned {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl Aligned {
    fn new(len: usize) -> Aligned {
        let mut storage = vec![0u8; len + 4096];
        let start = storage.as_mut_ptr().align_offset(4096);
        Aligned {
            storage,
            start,
            len,
        }
    }

    fn bytes(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

/// Reads the first `limit` bytes of `path` with `threads` threads in `chunk`-byte
/// pieces (as the loader's readers do) and returns the bandwidth in bytes per second.
pub fn file_read_bandwidth(
    path: &Path,
    threads: usize,
    chunk: usize,
    direct: bool,
    limit: u64,
) -> Result<f64> {
    let mut options = OpenOptions::new();
    options.read(true);
    if direct {
        options.custom_flags(libc::O_DIRECT);
    }
    let file = options
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    let len = file.metadata()?.len().min(limit);
    let next = AtomicU64::new(0);
    let started = Instant::now();
    std::thread::scope(|s| -> Result<()> {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    let mut buffer = Aligned::new(chunk);
                    loop {
                        let offset = next.fetch_add(chunk as u64, Ordering::Relaxed);
                        if offset >= len {
                            return Ok(());
                        }
                        let want = (len - offset).min(chunk as u64) as usize;
                        read_fully(&file, offset, want, buffer.bytes(), direct)?;
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().expect("reader thread panicked")?;
        }
        Ok(())
    })?;
    Ok(len as f64 / started.elapsed().as_secs_f64())
}

/// Reads `want` bytes at `offset`; direct reads round the length up to whole blocks
/// (the last may come back short at the end of the file).
fn read_fully(
    file: &File,
    offset: u64,
    want: usize,
    buffer: &mut [u8],
    direct: bool,
) -> Result<()> {
    let span = if direct {
        want.div_ceil(4096) * 4096
    } else {
        want
    };
    let mut done = 0;
    while done < want {
        let n = file.read_at(&mut buffer[done..span], offset + done as u64)?;
        if n == 0 {
            bail!("file ended at {}", offset + done as u64);
        }
        done += n;
    }
    Ok(())
}

/// Host memory copy bandwidth (`memcpy` of `bytes`, best of `iters`), in bytes per
/// second: the limit of the CPU "device".
pub fn host_copy_bandwidth(bytes: usize, iters: usize) -> f64 {
    let source: Vec<u8> = (0..bytes).map(|i| i as u8).collect();
    let mut target = vec![1u8; bytes];
    let mut best = f64::MAX;
    for _ in 0..iters.max(1) {
        let started = Instant::now();
        target.copy_from_slice(&source);
        best = best.min(started.elapsed().as_secs_f64());
    }
    std::hint::black_box(&target);
    bytes as f64 / best
}

/// Pinned host → device copy bandwidth on `device`, in bytes per second: `iters` copies
/// of `bytes` queued back to back on one stream.
pub fn pinned_h2d_bandwidth(
    device: &hip_backend::Device,
    bytes: usize,
    iters: usize,
) -> Result<f64> {
    let mut pinned = device.alloc_pinned::<u8>(bytes)?;
    let mut on_device = device.alloc::<u8>(bytes)?;
    let stream = device.new_stream()?;
    // The first copy pays for mapping and warm-up.
    stream.copy_h2d_async(&mut pinned, 0..bytes, on_device.view_mut())?;
    stream.synchronize()?;
    let started = Instant::now();
    for _ in 0..iters.max(1) {
        stream.copy_h2d_async(&mut pinned, 0..bytes, on_device.view_mut())?;
    }
    stream.synchronize()?;
    Ok((bytes * iters.max(1)) as f64 / started.elapsed().as_secs_f64())
}
