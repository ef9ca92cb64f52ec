//! Reading file ranges into staging buffers: positioned reads, optionally direct
//! (O_DIRECT, past the page cache), never through the mapping.
//!
//! The pipeline reads with its own file descriptors rather than copying from the store's
//! mapping: pages copied out of a mapping become part of the process's resident memory,
//! pages read with `pread` stay in the page cache, so host memory stays bounded by the
//! staging ring whatever the model's size.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use super::target::STAGING_ALIGN;
use crate::StoreError;

/// Direct reads must start, end and land on multiples of this.
const DIRECT_ALIGN: u64 = STAGING_ALIGN as u64;

/// Extra staging bytes a direct read of a range may need beyond the range itself (the
/// range widened to [`DIRECT_ALIGN`] on both sides).
pub(crate) const DIRECT_SLACK: usize = 2 * STAGING_ALIGN;

struct ShardFile {
    path: PathBuf,
    buffered: File,
    direct: Option<File>,
    /// Cleared when the file system refuses a direct read; buffered reads from then on.
    direct_ok: AtomicBool,
}

/// The model's files, opened for the pipeline's readers.
pub(crate) struct ShardFiles {
    files: Vec<ShardFile>,
}

impl ShardFiles {
    pub(crate) fn open(paths: &[PathBuf], direct: bool) -> Result<ShardFiles, StoreError> {
        let files = paths
            .iter()
            .map(|path| {
                let io = |source| StoreError::Io {
                    path: path.clone(),
                    source,
                };
                let buffered = File::open(path).map_err(io)?;
                let direct = direct.then(|| open_direct(path)).flatten();
                Ok(ShardFile {
                    path: path.clone(),
                    direct_ok: AtomicBool::new(direct.is_some()),
                    buffered,
                    direct,
                })
            })
            .collect::<Result<_, StoreError>>()?;
        Ok(ShardFiles { files })
    }

    /// True when reads of every file bypass the page cache.
    pub(crate) fn all_direct(&self) -> bool {
        self.files
            .iter()
            .all(|f| f.direct_ok.load(Ordering::Relaxed))
    }

    /// The share of the files' pages that the page cache holds (0 to 1, weighted by the
    /// files' sizes), from a sample of [`RESIDENCY_SAMPLES`] windows spread over each
    /// file; `None` when the kernel does not say for some file (an empty file, a failed
    /// mapping or query). For a file the process neither owns nor may write, Linux counts
    /// only the pages this process has mapped, so such a file reads as cold.
    pub(crate) fn page_cache_share(&self) -> Option<f64> {
        let (mut held, mut total) = (0.0, 0.0);
        for file in &self.files {
            let len = file.buffered.metadata().ok()?.len();
            held += page_cache_share(&file.buffered, len)? * len as f64;
            total += len as f64;
        }
        (total > 0.0).then(|| held / total)
    }

    /// Reads `len` bytes at `offset` of shard `shard` into `dst` and returns where in
    /// `dst` they start (0 for buffered reads; up to [`DIRECT_ALIGN`] − 1 for direct
    /// ones, which read whole aligned blocks). `dst` must hold `len` +
    /// [`DIRECT_SLACK`] bytes.
    pub(crate) fn read(
        &self,
        shard: usize,
        offset: u64,
        len: usize,
        dst: &mut [u8],
    ) -> Result<usize, StoreError> {
        let file = &self.files[shard];
        let io = |source| StoreError::Io {
            path: file.path.clone(),
            source,
        };
        if let (Some(direct), true) = (&file.direct, file.direct_ok.load(Ordering::Relaxed)) {
            match read_direct(direct, offset, len, dst) {
                Ok(Some(lead)) => return Ok(lead),
                Ok(None) => {}
                Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {
                    tracing::warn!(path = %file.path.display(), "direct reads refused, reading through the page cache");
                    file.direct_ok.store(false, Ordering::Relaxed);
                }
                Err(error) => return Err(io(error)),
            }
        }
        let capacity = dst.len();
        let dst = dst.get_mut(..len).ok_or_else(|| {
            io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("staging buffer of {capacity} bytes cannot hold {len}"),
            ))
        })?;
        file.buffered.read_exact_at(dst, offset).map_err(io)?;
        Ok(0)
    }
}

/// Windows of a file sampled by [`ShardFiles::page_cache_share`], and their pages each.
const RESIDENCY_SAMPLES: u64 = 64;
const RESIDENCY_WINDOW_PAGES: u64 = 16;

/// The share of the sampled pages of `file`'s first `len` bytes in the page cache.
fn page_cache_share(file: &File, len: u64) -> Option<f64> {
    if len == 0 {
        return None;
    }
    // SAFETY: sysconf has no preconditions.
    let page = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
    let pages = len.div_ceil(page);
    // SAFETY: the mapping is only passed to mincore, never read: a change of the file
    // while it is mapped cannot reach any memory we touch. It is unmapped on return.
    let map = unsafe { memmap2::Mmap::map(file) }.ok()?;
    let window = RESIDENCY_WINDOW_PAGES.min(pages);
    let samples = RESIDENCY_SAMPLES.min(pages / window);
    let mut flags = vec![0u8; window as usize];
    let (mut held, mut seen) = (0u64, 0u64);
    for i in 0..samples {
        // Evenly spread, the first window at the start, the last at the end.
        let first = match samples {
            1 => 0,
            _ => (pages - window) * i / (samples - 1),
        };
        let offset = usize::try_from(first * page).ok()?;
        let bytes = usize::try_from(window * page).ok()?.min(map.len() - offset);
        // SAFETY: `offset..offset + bytes` lies inside the mapping (`first` is at most
        // `pages - window`, and `bytes` is cut at the mapping's end); `flags` holds one
        // byte for each of its `window` pages, the most mincore writes.
        let status = unsafe {
            libc::mincore(
                map.as_ptr().add(offset) as *mut libc::c_void,
                bytes,
                flags.as_mut_ptr(),
            )
        };
        if status != 0 {
            return None;
        }
        let counted = bytes.div_ceil(page as usize);
        held += flags[..counted].iter().filter(|&&f| f & 1 != 0).count() as u64;
        seen += counted as u64;
    }
    (seen > 0).then(|| held as f64 / seen as f64)
}

fn open_direct(path: &Path) -> Option<File> {
    match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
    {
        Ok(file) => Some(file),
        Err(error) => {
            tracing::warn!(path = %path.display(), %error, "cannot open for direct reads");
            None
        }
    }
}

/// A direct read of the aligned blocks around `offset..offset + len`. `Ok(None)` when
/// `dst` is not aligned or too small (the caller reads buffered instead).
fn read_direct(
    file: &File,
    offset: u64,
    len: usize,
    dst: &mut [u8],
) -> std::io::Result<Option<usize>> {
    let start = offset / DIRECT_ALIGN * DIRECT_ALIGN;
    let lead = (offset - start) as usize;
    let wanted = lead + len;
    let span = wanted.div_ceil(STAGING_ALIGN) * STAGING_ALIGN;
    if !(dst.as_ptr() as usize).is_multiple_of(STAGING_ALIGN) || dst.len() < span {
        return Ok(None);
    }
    let mut done = 0;
    while done < wanted {
        // Block-aligned position and length: the tail block may pass the file's end,
        // where the read comes back short.
        match file.read_at(&mut dst[done..span], start + done as u64) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("file ends before byte {}", offset + len as u64),
                ))
            }
            Ok(n) => done += n,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(error) => return Err(error),
        }
        if done % STAGING_ALIGN != 0 && done < wanted {
            // A short read that is not at the end of the file: finish buffered.
            return Ok(None);
        }
    }
    Ok(Some(lead))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn aligned(len: usize) -> (Vec<u8>, usize) {
        let mut storage = vec![0u8; len + STAGING_ALIGN];
        let start = storage.as_mut_ptr().align_offset(STAGING_ALIGN);
        (storage, start)
    }

    /// A file just written is in the page cache; once its pages are dropped (written
    /// back first), it is not.
    #[test]
    fn the_page_cache_share_follows_the_cache() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.bin");
        std::fs::write(&path, vec![7u8; 8 << 20]).unwrap();
        let files = ShardFiles::open(std::slice::from_ref(&path), false).unwrap();
        let warm = files.page_cache_share().expect("mincore answers");
        assert!(warm > 0.9, "a file just written: {warm}");
        let file = File::open(&path).unwrap();
        file.sync_all().unwrap();
        // SAFETY: advice on an open file descriptor over its whole length.
        let status = unsafe {
            use std::os::fd::AsRawFd;
            libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED)
        };
        assert_eq!(status, 0);
        let cold = files.page_cache_share().expect("mincore answers");
        assert!(cold < 0.1, "after the pages were dropped: {cold}");
        let empty = dir.path().join("empty.bin");
        std::fs::write(&empty, b"").unwrap();
        let files = ShardFiles::open(std::slice::from_ref(&empty), false).unwrap();
        assert_eq!(files.page_cache_share(), None);
    }

    #[test]
    fn buffered_and_direct_reads_give_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data.bin");
        let bytes: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        for direct in [false, true] {
            let files = ShardFiles::open(std::slice::from_ref(&path), direct).unwrap();
            for (offset, len) in [(0u64, 10usize), (4095, 3), (5000, 15_000), (19_990, 10)] {
                let (mut storage, start) = aligned(len + DIRECT_SLACK);
                let dst = &mut storage[start..start + len + DIRECT_SLACK];
                let lead = files.read(0, offset, len, dst).unwrap();
                let o = offset as usize;
                assert_eq!(
                    &dst[lead..lead + len],
                    &bytes[o..o + len],
                    "direct={direct} {offset}+{len}"
                );
            }
            let (mut storage, start) = aligned(64 + DIRECT_SLACK);
            let dst = &mut storage[start..start + 64 + DIRECT_SLACK];
            assert!(matches!(
                files.read(0, 19_990, 64, dst),
                Err(StoreError::Io { .. })
            ));
        }
    }
}
