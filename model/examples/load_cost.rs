//! What getting ready for the first token costs, stage by stage: opening the file,
//! building the execution plan, building the tokenizer and encoding a short prompt.
//!
//! ```sh
//! cargo run --release -p model --example load_cost -- MODEL.gguf [REPETITIONS]
//! ```
//!
//! Run it once per model: resident memory is a property of the whole process, so each
//! model is measured in a process of its own. The first run is what a process starting
//! a model pays (fresh memory faults in page by page); memory figures are the first
//! run's, since later runs reuse memory the allocator already holds. Times are also given
//! as the best of all runs, in wall time and in the loading thread's CPU time, which a
//! busy machine disturbs less. Beside resident memory it counts the heap bytes each stage
//! keeps, and the most it had allocated at once, through a counting allocator.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
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

/// Minor page faults of this thread so far, from `/proc/thread-self/stat` (0 where that
/// is unavailable): each first touch of fresh memory costs one.
fn thread_minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    // The fields after the command name, which is in parentheses; minflt is the 10th
    // field of the line, the 8th after the name.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(7))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

const STAGES: [&str; 5] = ["open", "plan", "tokenizer", "encode", "total"];

/// What one stage cost.
#[derive(Clone, Copy, Default)]
struct Cost {
    wall_ms: f64,
    cpu_ms: f64,
    faults: u64,
    rss_growth: u64,
    heap_kept: usize,
    heap_peak: usize,
}

/// Counters at the start of a stage.
struct Meter {
    wall: Instant,
    cpu_ns: u64,
    faults: u64,
    rss: u64,
    heap: usize,
}

impl Meter {
    fn start() -> Meter {
        let heap = LIVE.load(Ordering::Relaxed);
        PEAK.store(heap, Ordering::Relaxed);
        Meter {
            wall: Instant::now(),
            cpu_ns: thread_cpu_ns(),
            faults: thread_minor_faults(),
            rss: resident_bytes(),
            heap,
        }
    }

    /// The cost since the start, and a meter for the next stage.
    fn lap(self) -> (Cost, Meter) {
        let peak = PEAK.load(Ordering::Relaxed);
        let next = Meter::start();
        let cost = Cost {
            wall_ms: (next.wall - self.wall).as_secs_f64() * 1e3,
            cpu_ms: next.cpu_ns.saturating_sub(self.cpu_ns) as f64 / 1e6,
            faults: next.faults.saturating_sub(self.faults),
            rss_growth: next.rss.saturating_sub(self.rss),
            heap_kept: next.heap.saturating_sub(self.heap),
            heap_peak: peak.saturating_sub(self.heap),
        };
        (cost, next)
    }
}

/// Opens the model, plans it, builds its tokenizer and encodes a prompt, measuring each.
fn run_once(path: &Path) -> Result<[Cost; STAGES.len()], Box<dyn std::error::Error>> {
    let mut costs = [Cost::default(); STAGES.len()];
    let first = Meter::start();
    let (start_wall, start_cpu, start_faults, start_rss) =
        (first.wall, first.cpu_ns, first.faults, first.rss);
    let store = TensorStore::open(path)?;
    let (cost, meter) = first.lap();
    costs[0] = cost;
    let model = Model::load(&store)?;
    let (cost, meter) = meter.lap();
    costs[1] = cost;
    let tokenizer = Tokenizer::from_metadata(store.metadata())?;
    let (cost, meter) = meter.lap();
    costs[2] = cost;
    let ids = tokenizer.encode("Hello, world! How are you today?", EncodeOptions::PROMPT)?;
    let (cost, end) = meter.lap();
    costs[3] = cost;
    assert!(!ids.is_empty() && model.config().n_vocab > 0);
    // The total's peak: the most any stage reached above what the stages before it kept.
    let (heap_peak, heap_kept) = costs[..4].iter().fold((0, 0), |(peak, kept), c| {
        (peak.max(kept + c.heap_peak), kept + c.heap_kept)
    });
    costs[4] = Cost {
        wall_ms: (end.wall - start_wall).as_secs_f64() * 1e3,
        cpu_ms: end.cpu_ns.saturating_sub(start_cpu) as f64 / 1e6,
        faults: end.faults.saturating_sub(start_faults),
        rss_growth: end.rss.saturating_sub(start_rss),
        heap_kept,
        heap_peak,
    };
    Ok(costs)
}

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
    let first = run_once(&path)?;
    let mut best = first;
    for _ in 1..repetitions {
        for (best, cost) in best.iter_mut().zip(run_once(&path)?) {
            best.wall_ms = best.wall_ms.min(cost.wall_ms);
            best.cpu_ms = best.cpu_ms.min(cost.cpu_ms);
        }
    }
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "{} ({:.1} MiB); first run, and best of {repetitions}",
        path.display(),
        mib(file_bytes)
    );
    println!(
        "{:<10} {:>9} {:>9} {:>9} {:>7} {:>8} {:>9} {:>9}",
        "stage", "first ms", "best ms", "best cpu", "faults", "RSS MiB", "heap MiB", "peak MiB"
    );
    for (i, name) in STAGES.iter().enumerate() {
        println!(
            "{name:<10} {:>9.1} {:>9.1} {:>9.1} {:>7} {:>8.2} {:>9.2} {:>9.2}",
            first[i].wall_ms,
            best[i].wall_ms,
            best[i].cpu_ms,
            first[i].faults,
            mib(first[i].rss_growth),
            mib(first[i].heap_kept as u64),
            mib(first[i].heap_peak as u64)
        );
    }
    println!(
        "RSS growth {:.1}% of the file (target < 10%)",
        100.0 * first[4].rss_growth as f64 / file_bytes as f64
    );
    Ok(())
}
