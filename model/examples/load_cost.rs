//! What getting ready for the first token costs, stage by stage: opening the file,
//! building the execution plan, building the tokenizer and encoding a short prompt.
//!
//! ```sh
//! cargo run --release -p model --example load_cost -- MODEL.gguf [REPETITIONS]
//! ```
//!
//! Run it once per model: resident memory is a property of the whole process, so each
//! model is measured in a process of its own. The first repetition's growth is the one
//! that counts (later ones reuse memory the allocator already holds); the time is the
//! fastest of all repetitions, in wall time and in the CPU time of the loading thread
//! (which a busy machine disturbs less). Beside resident memory it counts the heap bytes each stage
//! leaves allocated, and the most it had allocated at once, through a counting allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use model::tokenizer::{EncodeOptions, Tokenizer};
use model::Model;
use tensor_store::TensorStore;

/// The system allocator, counting the bytes allocated now and the most at once.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed unchanged to the system allocator, which upholds
// `GlobalAlloc`'s contract; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout has a non-zero size, as `GlobalAlloc::alloc` requires.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `alloc` above, that is by `System`, with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from `System` with `layout`, and the caller guarantees
        // `new_size` is non-zero and valid for `layout`'s alignment.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            let live = LIVE.fetch_add(new_size, Ordering::Relaxed) + new_size;
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The process's resident set, from `/proc/self/status` (0 where that is unavailable).
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// `struct timespec` of 64-bit Linux.
#[repr(C)]
struct Timespec {
    seconds: i64,
    nanoseconds: i64,
}

extern "C" {
    fn clock_gettime(clock: i32, time: *mut Timespec) -> i32;
}

/// Linux's `CLOCK_THREAD_CPUTIME_ID`.
const CLOCK_THREAD_CPUTIME_ID: i32 = 3;

/// CPU time this thread has run (0 where the clock is unavailable): unlike wall time,
/// it does not count time spent waiting for a core that other processes hold.
fn thread_cpu_ns() -> u64 {
    let mut time = Timespec {
        seconds: 0,
        nanoseconds: 0,
    };
    // SAFETY: `time` is a valid, writable `struct timespec` for the call's duration, and
    // the C library std links provides `clock_gettime` with this signature.
    let status = unsafe { clock_gettime(CLOCK_THREAD_CPUTIME_ID, &mut time) };
    match status {
        0 => (time.seconds as u64) * 1_000_000_000 + time.nanoseconds as u64,
        _ => 0,
    }
}

const STAGES: [&str; 5] = ["open", "plan", "tokenizer", "encode", "total"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args_os().skip(1);
    let Some(path) = args.next().map(PathBuf::from) else {
        eprintln!("usage: load_cost MODEL.gguf [REPETITIONS]");
        std::process::exit(2);
    };
    let repetitions: usize = match args.next() {
        Some(n) => n.to_string_lossy().parse()?,
        None => 5,
    };
    let file_bytes = std::fs::metadata(&path)?.len();
    let mut best_ms = [f64::INFINITY; STAGES.len()];
    let mut best_cpu_ms = [f64::INFINITY; STAGES.len()];
    let mut first_growth = [0u64; STAGES.len()];
    let mut first_heap = ([0usize; STAGES.len()], [0usize; STAGES.len()]);
    for repetition in 0..repetitions.max(1) {
        let rss_start = resident_bytes();
        let mut rss = rss_start;
        let heap_start = LIVE.load(Ordering::Relaxed);
        let mut heap = heap_start;
        let mut ms = [0f64; STAGES.len()];
        let mut cpu_ms = [0f64; STAGES.len()];
        let cpu_start = thread_cpu_ns();
        let mut cpu = cpu_start;
        let mut growth = [0u64; STAGES.len()];
        let mut kept = [0usize; STAGES.len()];
        let mut peak = [0usize; STAGES.len()];
        PEAK.store(heap, Ordering::Relaxed);
        let mut stage = |i: usize, t: Instant| {
            ms[i] = t.elapsed().as_secs_f64() * 1e3;
            let cpu_now = thread_cpu_ns();
            cpu_ms[i] = cpu_now.saturating_sub(cpu) as f64 / 1e6;
            cpu = cpu_now;
            let now = resident_bytes();
            growth[i] = now.saturating_sub(rss);
            rss = now;
            let live = LIVE.load(Ordering::Relaxed);
            kept[i] = live.saturating_sub(heap);
            peak[i] = PEAK.swap(live, Ordering::Relaxed).saturating_sub(heap);
            heap = live;
        };
        let start = Instant::now();
        let t = Instant::now();
        let store = TensorStore::open(&path)?;
        stage(0, t);
        let t = Instant::now();
        let model = Model::load(&store)?;
        stage(1, t);
        let t = Instant::now();
        let tokenizer = Tokenizer::from_metadata(store.metadata())?;
        stage(2, t);
        let t = Instant::now();
        let ids = tokenizer.encode("Hello, world! How are you today?", EncodeOptions::PROMPT)?;
        stage(3, t);
        ms[4] = start.elapsed().as_secs_f64() * 1e3;
        cpu_ms[4] = thread_cpu_ns().saturating_sub(cpu_start) as f64 / 1e6;
        growth[4] = resident_bytes().saturating_sub(rss_start);
        kept[4] = LIVE.load(Ordering::Relaxed).saturating_sub(heap_start);
        peak[4] = peak[..4]
            .iter()
            .zip(&kept)
            .fold((0, 0), |(most, before), (&p, &k)| {
                (most.max(before + p), before + k)
            })
            .0;
        assert!(!ids.is_empty() && model.config().n_vocab > 0);
        for i in 0..STAGES.len() {
            best_ms[i] = best_ms[i].min(ms[i]);
            best_cpu_ms[i] = best_cpu_ms[i].min(cpu_ms[i]);
        }
        if repetition == 0 {
            first_growth = growth;
            first_heap = (kept, peak);
        }
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "{} ({:.1} MiB), best of {repetitions}",
        path.display(),
        mib(file_bytes)
    );
    println!(
        "{:<10} {:>9} {:>9} {:>9} {:>10} {:>10}",
        "stage", "wall ms", "cpu ms", "RSS MiB", "heap MiB", "peak MiB"
    );
    for (i, name) in STAGES.iter().enumerate() {
        println!(
            "{name:<10} {:>9.1} {:>9.1} {:>9.2} {:>10.2} {:>10.2}",
            best_ms[i],
            best_cpu_ms[i],
            mib(first_growth[i]),
            mib(first_heap.0[i] as u64),
            mib(first_heap.1[i] as u64)
        );
    }
    println!(
        "RSS growth {:.1}% of the file (target < 10%)",
        100.0 * first_growth[4] as f64 / file_bytes as f64
    );
    Ok(())
}
