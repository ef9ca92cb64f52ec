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
