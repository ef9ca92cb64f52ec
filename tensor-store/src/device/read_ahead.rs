//! Reading a cold model file into the page cache ahead of the upload.
//!
//! From a cold disk, the upload is as fast as the disk; but its readers start only once
//! the GPU runtime has started (a few hundred milliseconds in which the disk would sit
//! idle), and two or more readers of 4 MiB pieces keep a disk's queue less full than
//! streams of long reads. [`ReadAhead`] is those streams: threads of its own
//! ([`STREAMS`] unless asked otherwise) read the tensors of an [`UploadOrder`] in long
//! pieces, each taking the next piece in that order, so the readers, started when the
//! device is ready, mostly find pages already in the page cache, or wait for reads
//! already under way. It only brings pages into the page cache (no memory of the
//! process's grows with the model: each thread reads into one scratch buffer), and a
//! failed read only ends its thread: the readers report errors themselves.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::files::ShardFiles;
use super::order::UploadOrder;
use crate::StoreError;

/// Bytes of one read: long enough for the disk to stream.
const PIECE: u64 = 16 << 20;

/// Threads reading at once, unless asked otherwise: one long stream. (On the GPU
/// machine, two streams of `dd` read a cold 4.3 GB file in 0.83-0.91x the time of one,
/// but beside the upload's own readers two read-ahead threads brought the first token
/// no earlier.)
pub const STREAMS: usize = 1;

/// Most threads [`ReadAhead::start`] runs, whatever it is asked.
const MAX_STREAMS: usize = 8;

/// Threads reading an upload order's tensors into the page cache; dropping it stops
/// them after their current reads (one piece each, at most [`PIECE`] bytes) and joins
/// them.
pub struct ReadAhead {
    stop: Arc<AtomicBool>,
    read: Arc<AtomicU64>,
    total: u64,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ReadAhead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadAhead")
            .field("read", &self.bytes_read())
            .field("total", &self.total)
            .finish()
    }
}

impl ReadAhead {
    /// Starts reading `order`'s tensors with `streams` threads (see [`start`]) when the
    /// page cache holds less than half of their files (sampled as the device cache does
    /// to choose its readers); `Ok(None)` when it holds more, when the kernel does not
    /// say, or when there is nothing to read.
    ///
    /// [`start`]: ReadAhead::start
    pub fn when_cold(order: &UploadOrder, streams: usize) -> Result<Option<ReadAhead>, StoreError> {
        let paths = shard_paths(order);
        if paths.is_empty() {
            return Ok(None);
        }
        let share = ShardFiles::open(&paths, false)?.page_cache_share();
        tracing::debug!(page_cache_share = share.unwrap_or(f64::NAN), "read-ahead");
        match share {
            Some(share) if share < 0.5 => ReadAhead::start(order, streams).map(Some),
            _ => Ok(None),
        }
    }

    /// Starts reading `order`'s tensors, whatever the page cache holds, with `streams`
    /// threads (at least one, at most eight), each taking the next piece in order.
    pub fn start(order: &UploadOrder, streams: usize) -> Result<ReadAhead, StoreError> {
        let pieces = Arc::new(pieces(&spans(order)));
        let total = pieces.iter().map(|p| p.range.end - p.range.start).sum();
        let mut files: Vec<(PathBuf, File)> = Vec::new();
        for path in shard_paths(order) {
            let file = File::open(&path).map_err(|source| StoreError::Io {
                path: path.clone(),
                source,
            })?;
            files.push((path, file));
        }
        let files = Arc::new(files);
        let next = Arc::new(AtomicUsize::new(0));
        let mut ahead = ReadAhead {
            stop: Arc::new(AtomicBool::new(false)),
            read: Arc::new(AtomicU64::new(0)),
            total,
            threads: Vec::new(),
        };
        for _ in 0..streams.clamp(1, MAX_STREAMS).min(pieces.len().max(1)) {
            let (files, pieces, next) =
                (Arc::clone(&files), Arc::clone(&pieces), Arc::clone(&next));
            let (stop, read) = (Arc::clone(&ahead.stop), Arc::clone(&ahead.read));
            let thread = std::thread::Builder::new()
                .name("read-ahead".into())
                .spawn(move || run(&files, &pieces, &next, &stop, &read))
                .map_err(|source| StoreError::Io {
                    path: PathBuf::from("<read-ahead thread>"),
                    source,
                })?;
            // On an error, dropping `ahead` stops and joins the threads already started.
            ahead.threads.push(thread);
        }
        Ok(ahead)
    }

    /// Bytes read so far.
    pub fn bytes_read(&self) -> u64 {
        self.read.load(Ordering::Relaxed)
    }

    /// Bytes it reads in all.
    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// Whether it has read every tensor (or its threads stopped at failed reads).
    pub fn is_finished(&self) -> bool {
        self.threads.iter().all(JoinHandle::is_finished)
    }
}

impl Drop for ReadAhead {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                tracing::error!("a read-ahead thread panicked");
            }
        }
    }
}

/// A run of bytes of one file, read in order.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Span {
    file: usize,
    range: std::ops::Range<u64>,
}

/// The distinct files of `order`'s tensors, in order of first use.
fn shard_paths(order: &UploadOrder) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = Vec::new();
    for handle in order.tensors() {
        if !paths.iter().any(|p| p == handle.path()) {
            paths.push(handle.path().to_path_buf());
        }
    }
    paths
}

/// `order`'s tensors as runs of bytes, each tensor's range joined to the run before it
/// when it starts where that one ends in the same file.
fn spans(order: &UploadOrder) -> Vec<Span> {
    let paths = shard_paths(order);
    let file_of = |path: &Path| paths.iter().position(|p| p == path).expect("listed above");
    let mut spans: Vec<Span> = Vec::new();
    for handle in order.tensors() {
        let (file, range) = (file_of(handle.path()), handle.file_range());
        if range.is_empty() {
            continue;
        }
        match spans.last_mut() {
            Some(last) if last.file == file && last.range.end == range.start => {
                last.range.end = range.end;
            }
            _ => spans.push(Span { file, range }),
        }
    }
    spans
}

/// `spans` cut into reads of at most [`PIECE`] bytes, in order.
fn pieces(spans: &[Span]) -> Vec<Span> {
    let mut pieces = Vec::new();
    for span in spans {
        let mut at = span.range.start;
        while at < span.range.end {
            let end = span.range.end.min(at + PIECE);
            pieces.push(Span {
                file: span.file,
                range: at..end,
            });
            at = end;
        }
    }
    pieces
}

/// One thread's reads: the next piece not yet taken, until none is left, `stop` is set
/// or a read fails.
fn run(
    files: &[(PathBuf, File)],
    pieces: &[Span],
    next: &AtomicUsize,
    stop: &AtomicBool,
    read: &AtomicU64,
) {
    let longest = pieces.iter().map(|p| p.range.end - p.range.start).max();
    let mut buf = vec![0u8; longest.unwrap_or(0) as usize];
    while let Some(piece) = pieces.get(next.fetch_add(1, Ordering::Relaxed)) {
        let (path, file) = &files[piece.file];
        let mut at = piece.range.start;
        while at < piece.range.end {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            let len = (piece.range.end - at) as usize;
            match file.read_at(&mut buf[..len], at) {
                Ok(0) => {
                    tracing::debug!(path = %path.display(), at, "read-ahead: the file ends early");
                    return;
                }
                Ok(n) => {
                    at += n as u64;
                    read.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) => {
                    tracing::debug!(path = %path.display(), at, %error, "read-ahead stopped");
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TensorStore;

    /// A small model file of `n` tensors of `bytes` bytes each, through the store.
    fn store(dir: &Path, n: usize, bytes: usize) -> TensorStore {
        use gguf_format::{GgmlType, GgufWriter};
        let path = dir.join("m.gguf");
        let mut writer = GgufWriter::new();
        writer
            .add_metadata("general.architecture", "llama")
            .unwrap();
        for i in 0..n {
            writer
                .add_tensor(&format!("blk.{i}.w"), GgmlType::I8, &[bytes as u64])
                .unwrap();
        }
        let data: Vec<Vec<u8>> = (0..n)
            .map(|i| (0..bytes).map(|j| (i * 31 + j) as u8).collect())
            .collect();
        let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
        std::fs::write(&path, writer.to_bytes(&refs).unwrap()).unwrap();
        TensorStore::open(&path).unwrap()
    }

    #[test]
    fn it_reads_every_tensor_in_runs_in_upload_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = store(dir.path(), 5, 3000);
        let handles: Vec<_> = store.tensors().collect();
        let order = UploadOrder::by_layer(&handles);
        let runs = spans(&order);
        let total: u64 = handles
            .iter()
            .map(|h| h.file_range().end - h.file_range().start)
            .sum();
        // Tensors padded to their alignment are not contiguous: each gap starts a run.
        assert!(!runs.is_empty() && runs.len() <= 5, "{runs:?}");
        assert_eq!(
            runs.iter()
                .map(|s| s.range.end - s.range.start)
                .sum::<u64>(),
            total
        );
        for streams in [1, 2, 3] {
            let ahead = ReadAhead::start(&order, streams).unwrap();
            assert_eq!(ahead.total_bytes(), total);
            while !ahead.is_finished() {
                std::thread::yield_now();
            }
            assert_eq!(ahead.bytes_read(), total, "{streams} streams");
            drop(ahead);
        }

        // Reversed, the runs follow the order given, not the file's.
        let reversed: Vec<_> = handles.iter().rev().cloned().collect();
        let order = UploadOrder::by_layer(&reversed);
        let starts: Vec<u64> = spans(&order).iter().map(|s| s.range.start).collect();
        assert!(starts.windows(2).all(|w| w[0] > w[1]), "{starts:?}");
    }

    #[test]
    fn long_runs_are_cut_into_pieces_in_order() {
        let spans = [
            Span {
                file: 0,
                range: 10..10 + 2 * PIECE + 5,
            },
            Span {
                file: 1,
                range: 0..7,
            },
        ];
        let got: Vec<(usize, std::ops::Range<u64>)> = pieces(&spans)
            .into_iter()
            .map(|p| (p.file, p.range))
            .collect();
        assert_eq!(
            got,
            [
                (0, 10..10 + PIECE),
                (0, 10 + PIECE..10 + 2 * PIECE),
                (0, 10 + 2 * PIECE..10 + 2 * PIECE + 5),
                (1, 0..7),
            ]
        );
    }

    #[test]
    fn a_warm_file_is_not_read_again() {
        let dir = tempfile::tempdir().unwrap();
        // Just written: in the page cache.
        let store = store(dir.path(), 4, 1 << 20);
        let handles: Vec<_> = store.tensors().collect();
        let order = UploadOrder::by_layer(&handles);
        assert!(ReadAhead::when_cold(&order, STREAMS).unwrap().is_none());
        assert!(ReadAhead::when_cold(&UploadOrder::empty(), STREAMS)
            .unwrap()
            .is_none());
    }
}
