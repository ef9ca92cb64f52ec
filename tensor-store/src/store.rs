//! The model's files, opened and parsed once, and lazy handles to their tensors.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use gguf_format::{GgmlType, GgufError, GgufFile, Metadata, TensorInfo};
use once_cell::sync::OnceCell;

use crate::backing::{Backing, LoadMode};
use crate::split::shard_paths;
use crate::StoreError;

/// First read when parsing without a mapping; grown until the header fits.
const FIRST_HEADER_READ: u64 = 4 << 20;

/// One file of a (possibly split) model.
struct Shard {
    backing: Backing,
    gguf: GgufFile,
}

/// A tensor's place in the model.
struct Entry {
    info: TensorInfo,
    shard: usize,
    /// Absolute offset of its first byte in its shard's file.
    file_offset: u64,
    /// Its bytes, read on first use, in [`LoadMode::Read`] or when mapping failed.
    read_cache: OnceCell<Box<[u8]>>,
}

/// An opened GGUF model: every shard mapped (or opened for reads) and parsed once.
///
/// Nothing reads tensor data until a [`TensorHandle`] is asked for its bytes. Cloning is
/// cheap: the store is shared through an `Arc`.
#[derive(Clone)]
pub struct TensorStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Vec<Shard>,
    entries: Vec<Entry>,
    by_name: HashMap<String, usize>,
}

impl TensorStore {
    /// Opens the model at `path`, mapped. A split model (`name-00001-of-00003.gguf`, any
    /// of its shards named) opens as one model.
    pub fn open(path: impl AsRef<Path>) -> Result<TensorStore, StoreError> {
        TensorStore::open_with(path, LoadMode::Mmap)
    }

    /// Opens the model at `path` in the given mode.
    pub fn open_with(path: impl AsRef<Path>, mode: LoadMode) -> Result<TensorStore, StoreError> {
        let path = path.as_ref();
        let _span = tracing::info_span!("open_model", path = %path.display()).entered();
        let paths = shard_paths(path)?;
        let mut shards = Vec::with_capacity(paths.len());
        for p in &paths {
            let backing = Backing::open(p, mode)?;
            let gguf = parse_backing(&backing)?;
            shards.push(Shard { backing, gguf });
        }
        check_split_metadata(&shards)?;

        let total: usize = shards.iter().map(|s| s.gguf.tensors.len()).sum();
        let mut entries = Vec::with_capacity(total);
        let mut by_name = HashMap::with_capacity(total);
        for (shard_idx, shard) in shards.iter().enumerate() {
            for info in &shard.gguf.tensors {
                if let Some(&other) = by_name.get(&info.name) {
                    let other: &Entry = &entries[other];
                    return Err(StoreError::DuplicateTensor {
                        path: shard.backing.path.clone(),
                        tensor: info.name.clone(),
                        other: shards[other.shard].backing.path.clone(),
                    });
                }
                by_name.insert(info.name.clone(), entries.len());
                entries.push(Entry {
                    file_offset: shard.gguf.tensor_range(info).start,
                    info: info.clone(),
                    shard: shard_idx,
                    read_cache: OnceCell::new(),
                });
            }
        }
        Ok(TensorStore {
            inner: Arc::new(Inner {
                shards,
                entries,
                by_name,
            }),
        })
    }

    /// The model's metadata (the first shard's: later shards hold only `split.*` keys).
    pub fn metadata(&self) -> &Metadata {
        &self.inner.shards[0].gguf.metadata
    }

    /// The first shard's parsed header.
    pub fn gguf(&self) -> &GgufFile {
        &self.inner.shards[0].gguf
    }

    /// Paths of the model's files, in shard order.
    pub fn paths(&self) -> impl Iterator<Item = &Path> {
        self.inner.shards.iter().map(|s| s.backing.path.as_path())
    }

    /// The path of the first shard, for messages.
    pub fn path(&self) -> &Path {
        &self.inner.shards[0].backing.path
    }

    /// True when every shard is mapped.
    pub fn is_mapped(&self) -> bool {
        self.inner.shards.iter().all(|s| s.backing.map.is_some())
    }

    /// Total bytes of tensor data.
    pub fn tensor_bytes(&self) -> u64 {
        self.inner.entries.iter().map(|e| e.info.size).sum()
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.inner.entries.len()
    }

    /// True for a model without tensors.
    pub fn is_empty(&self) -> bool {
        self.inner.entries.is_empty()
    }

    /// A handle to the tensor named `name`.
    pub fn tensor(&self, name: &str) -> Result<TensorHandle, StoreError> {
        self.get(name).ok_or_else(|| StoreError::NoSuchTensor {
            path: self.path().to_owned(),
            name: name.to_owned(),
        })
    }

    /// A handle to the tensor named `name`, if there is one.
    pub fn get(&self, name: &str) -> Option<TensorHandle> {
        self.inner.by_name.get(name).map(|&idx| TensorHandle {
            store: self.clone(),
            idx,
        })
    }

    /// Handles to every tensor, in file order.
    pub fn tensors(&self) -> impl ExactSizeIterator<Item = TensorHandle> + '_ {
        (0..self.inner.entries.len()).map(|idx| TensorHandle {
            store: self.clone(),
            idx,
        })
    }

    /// Fails when any file changed size since it was opened (see [`LoadMode::Mmap`]'s
    /// contract in this crate's docs).
    pub fn check_unchanged(&self) -> Result<(), StoreError> {
        self.inner
            .shards
            .iter()
            .try_for_each(|s| s.backing.check_unchanged())
    }
}

/// A lazy handle to one tensor: its name, type, shape and byte range. Holding it keeps
/// the model's files open (and mapped); its bytes are read only when asked for.
#[derive(Clone)]
pub struct TensorHandle {
    store: TensorStore,
    idx: usize,
}

impl TensorHandle {
    fn entry(&self) -> &Entry {
        &self.store.inner.entries[self.idx]
    }

    fn backing(&self) -> &Backing {
        &self.store.inner.shards[self.entry().shard].backing
    }

    /// The tensor's entry as parsed.
    pub fn info(&self) -> &TensorInfo {
        &self.entry().info
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.entry().info.name
    }

    /// Its element type.
    pub fn ggml_type(&self) -> GgmlType {
        self.entry().info.ggml_type
    }

    /// Its dimensions, ne0 first.
    pub fn shape(&self) -> &[u64] {
        &self.entry().info.shape
    }

    /// Its size in bytes.
    pub fn size(&self) -> u64 {
        self.entry().info.size
    }

    /// Absolute byte range in its file.
    pub fn file_range(&self) -> std::ops::Range<u64> {
        let e = self.entry();
        e.file_offset..e.file_offset + e.info.size
    }

    /// The file this tensor lives in.
    pub fn path(&self) -> &Path {
        &self.backing().path
    }

    /// Index of this tensor in the store, stable for the store's life.
    pub fn index(&self) -> usize {
        self.idx
    }

    /// True when [`TensorHandle::bytes`] is a zero-copy view of the mapping.
    pub fn is_mapped(&self) -> bool {
        self.backing().map.is_some()
    }

    /// The tensor's raw bytes: a slice of the mapping, or (without one) read from the file
    /// the first time and kept.
    pub fn bytes(&self) -> Result<&[u8], StoreError> {
        let range = self.file_range();
        if let Some(map) = self.backing().mapped() {
            // Checked at parse time: the range lies inside the file.
            return Ok(&map[range.start as usize..range.end as usize]);
        }
        let cached = self.entry().read_cache.get_or_try_init(|| {
            let _span = tracing::debug_span!("read_tensor", name = self.name()).entered();
            let mut buf = vec![0u8; self.size() as usize].into_boxed_slice();
            self.backing().read_exact_at(range.start, &mut buf)?;
            Ok::<_, StoreError>(buf)
        })?;
        Ok(cached)
    }

    /// Copies `dst.len()` bytes starting `offset` bytes into the tensor, without keeping
    /// a copy: the upload pipeline reads straight into its staging buffers this way.
    pub fn read_into(&self, offset: u64, dst: &mut [u8]) -> Result<(), StoreError> {
        let size = self.size();
        let len = dst.len() as u64;
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Err(StoreError::ReadOutOfRange {
                tensor: self.name().to_owned(),
                offset,
                len,
                size,
            });
        }
        self.backing()
            .read_exact_at(self.file_range().start + offset, dst)
    }
}

impl std::fmt::Debug for TensorHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let info = self.info();
        f.debug_struct("TensorHandle")
            .field("name", &info.name)
            .field("type", &info.ggml_type)
            .field("shape", &info.shape)
            .field("file_range", &self.file_range())
            .finish()
    }
}

/// Parses a shard's header.
///
/// A mapped file is parsed from the mapping, whose header pages are then released: pages
/// of a mapping stay resident once touched, and a large vocabulary's header (6.5 MB for
/// Gemma 3) would otherwise stay in the process's memory for its whole life. Reading
/// through the mapping copies nothing and faults the page cache in 64 KiB at a time,
/// where a fresh buffer to read into faults in every 4 KiB page it is written to: that
/// made opening Gemma 3 in a new process twice as slow.
///
/// Without a mapping, the header is parsed from a prefix read with positioned reads and
/// freed once parsed. A prefix too short is grown, reading only the bytes not yet read,
/// to at least twice its size: parsing it again is cheap, because the parser checks a
/// string array's lengths and bounds before it copies any of it.
fn parse_backing(backing: &Backing) -> Result<GgufFile, StoreError> {
    let format = |source| StoreError::Format {
        path: backing.path.clone(),
        source,
    };
    if let Some(parsed) = backing.mapped().map(gguf_format::parse) {
        // The parsed header is owned: nothing borrows the mapping any more.
        let file = parsed.map_err(format)?;
        backing.release_mapped_prefix(file.data_offset);
        return Ok(file);
    }
    let mut prefix = Vec::new();
    let mut want = FIRST_HEADER_READ.min(backing.len);
    loop {
        let have = prefix.len();
        prefix.resize(want as usize, 0);
        backing.pread_exact_at(have as u64, &mut prefix[have..])?;
        match gguf_format::parse_prefix(&prefix, backing.len) {
            Err(GgufError::UnexpectedEof { offset, needed, .. }) if want < backing.len => {
                let asked = offset.saturating_add(needed);
                want = asked.max(want.saturating_mul(2)).min(backing.len);
            }
            other => return other.map_err(format),
        }
    }
}

/// Each shard of a split model agrees on `split.count` and names its own index.
fn check_split_metadata(shards: &[Shard]) -> Result<(), StoreError> {
    if shards.len() == 1 {
        return Ok(());
    }
    let count = shards.len() as u64;
    for (i, shard) in shards.iter().enumerate() {
        let path = &shard.backing.path;
        for (key, expected) in [("count", count), ("no", i as u64)] {
            let full = format!("split.{key}");
            match shard.gguf.metadata.get_opt::<u64>(&full) {
                Ok(Some(found)) if found != expected => {
                    return Err(StoreError::ShardMismatch {
                        path: path.clone(),
                        key,
                        found,
                        expected,
                    })
                }
                Ok(_) => {}
                Err(source) => {
                    return Err(StoreError::Format {
                        path: path.clone(),
                        source,
                    })
                }
            }
        }
    }
    Ok(())
}
