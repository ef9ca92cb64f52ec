//! Where a shard's bytes come from: a read-only memory map, or plain positioned reads.
//!
//! This module holds the crate's only `unsafe` code: creating the mapping, and releasing
//! the pages of its header once parsed.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use memmap2::{Mmap, UncheckedAdvice};

use crate::StoreError;

/// How tensor bytes are reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LoadMode {
    /// Map the file; tensor bytes are zero-copy slices of the mapping. Falls back to
    /// [`LoadMode::Read`] when the mapping cannot be made.
    #[default]
    Mmap,
    /// Never map: read each tensor with positioned reads the first time it is asked for.
    Read,
}

/// One open GGUF file.
pub(crate) struct Backing {
    pub(crate) path: PathBuf,
    pub(crate) file: File,
    pub(crate) len: u64,
    pub(crate) map: Option<Mmap>,
}

impl Backing {
    pub(crate) fn open(path: &Path, mode: LoadMode) -> Result<Backing, StoreError> {
        let io = |source| StoreError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let metadata = file.metadata().map_err(io)?;
        if metadata.is_dir() {
            return Err(StoreError::IsDirectory {
                path: path.to_owned(),
            });
        }
        let len = metadata.len();
        let map = match mode {
            LoadMode::Read => {
                tracing::info!(path = %path.display(), bytes = len, "reading, not mapping");
                None
            }
            LoadMode::Mmap => match map_read_only(&file) {
                Ok(map) => {
                    tracing::info!(path = %path.display(), bytes = len, "mapped");
                    Some(map)
                }
                Err(error) => {
                    tracing::warn!(path = %path.display(), %error, "mapping failed, reading instead");
                    None
                }
            },
        };
        Ok(Backing {
            path: path.to_owned(),
            file,
            len,
            map,
        })
    }

    /// The whole file, when it is mapped.
    pub(crate) fn mapped(&self) -> Option<&[u8]> {
        self.map.as_deref()
    }

    /// Drops the mapping's first `len` bytes (the header, parsed once at open) from the
    /// process's resident memory; touching them again faults the same bytes back in from
    /// the page cache. Does nothing without a mapping; failing costs only memory.
    ///
    /// Call it only while no slice of the mapping is borrowed.
    pub(crate) fn release_mapped_prefix(&self, len: u64) {
        let Some(map) = &self.map else {
            return;
        };
        let len = usize::try_from(len).map_or(map.len(), |len| len.min(map.len()));
        if len == 0 {
            return;
        }
        // SAFETY: `MADV_DONTNEED` is unsafe in general because it discards a private
        // mapping's modified pages, changing bytes that borrowed slices read. This mapping
        // is shared and read-only (`map_read_only`), so none of its pages was ever
        // modified: dropping them only removes them from this process's page tables, and
        // a later read faults the same file bytes back in (the mapping's contract, at
        // `map_read_only`, is that the file does not change). No slice of it is borrowed
        // now either: the caller parsed the header into owned values and hands out no
        // tensor handle before this returns.
        let released = unsafe { map.unchecked_advise_range(UncheckedAdvice::DontNeed, 0, len) };
        if let Err(error) = released {
            tracing::debug!(path = %self.path.display(), %error, "header pages not released");
        }
    }

    /// Fills `dst` from absolute file offset `offset` (from the mapping when there is one).
    pub(crate) fn read_exact_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), StoreError> {
        if let Some(map) = self.mapped() {
            // The caller checked the range against the file length at open.
            let start = offset as usize;
            dst.copy_from_slice(&map[start..start + dst.len()]);
            return Ok(());
        }
        self.pread_exact_at(offset, dst)
    }

    /// Fills `dst` from absolute file offset `offset` with a positioned read, never
    /// through the mapping.
    pub(crate) fn pread_exact_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), StoreError> {
        self.file
            .read_exact_at(dst, offset)
            .map_err(|source| StoreError::Io {
                path: self.path.clone(),
                source,
            })
    }

    /// Refuses to go on when the file's length changed since it was opened: a shrunken
    /// file would fault (SIGBUS) on access to the mapped pages past its new end.
    pub(crate) fn check_unchanged(&self) -> Result<(), StoreError> {
        let now = self
            .file
            .metadata()
            .map_err(|source| StoreError::Io {
                path: self.path.clone(),
                source,
            })?
            .len();
        if now != self.len {
            return Err(StoreError::FileChanged {
                path: self.path.clone(),
                expected: self.len,
                found: now,
            });
        }
        Ok(())
    }
}

/// Maps `file` read-only.
///
/// The contract of a file mapping: the bytes behind it must not change, and the file must
/// not shrink, while it is mapped. If another process truncates the file, touching a page
/// past the new end raises SIGBUS and ends the process; if it rewrites bytes in place,
/// tensors change under us. No API can rule this out for a file we do not own. What this
/// crate does: it opens model files read-only and never writes through the mapping; it
/// records the length at open and [`crate::TensorStore::check_unchanged`] compares it
/// again (the CLI calls it before long runs); and [`LoadMode::Read`] (`--no-mmap`) avoids
/// the mapping entirely, for files on network file systems or files that may be replaced.
fn map_read_only(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: the mapping is read-only and private to this process's address space; its
    // soundness rests on the file not being truncated or modified while mapped, the
    // contract documented above, which we state to users and check with
    // `check_unchanged`. The `Mmap` is owned by the `Backing` that every tensor handle
    // keeps alive through an `Arc`, so no slice of it outlives the mapping.
    unsafe { Mmap::map(file) }
}
