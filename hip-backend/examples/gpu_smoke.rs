//! GPU smoke test and micro-benchmark: opens device 0, then measures what model loading
//! depends on: runtime start, device allocation cost (one allocation per tensor against
//! one arena), page-locked allocation cost, and copy bandwidth host→device from pinned
//! and from ordinary (pageable) memory, device→host, and device→device. Every copy is
//! checked against its source before its figure is printed.
//!
//! ```text
//! cargo run --release -p hip-backend --example gpu_smoke -- [--size-mib 256] [--iters 5]
//!     [--allocs 300] [--alloc-mib 14] [--json FILE]
//! ```
//! Prints a table; `--json` also writes the figures as one JSON object. Exits with 2 when
//! there is no GPU (built without one, or none found), 1 on any other failure.

use hip_backend::{
    runtime_versions, Device, DeviceBuffer, HipError, Stream, DEFAULT_ARENA_ALIGN, OFFLOAD_ARCHS,
    PLATFORM,
};
use std::time::Instant;

struct Options {
    size_mib: usize,
    iters: usize,
    allocs: usize,
    alloc_mib: usize,
    json: Option<String>,
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        size_mib: 256,
        iters: 5,
        allocs: 300,
        alloc_mib: 14,
        json: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        let number = |text: String| {
            text.parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("{flag}: {text:?} is not a positive number"))
        };
        match flag.as_str() {
            "--size-mib" => options.size_mib = number(value()?)?,
            "--iters" => options.iters = number(value()?)?,
            "--allocs" => options.allocs = number(value()?)?,
            "--alloc-mib" => options.alloc_mib = number(value()?)?,
            "--json" => options.json = Some(value()?),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(options)
}

/// One measured figure: name, value, unit.
struct Figures(Vec<(&'static str, f64, &'static str)>);

impl Figures {
    fn add(&mut self, name: &'static str, value: f64, unit: &'static str) {
        println!("{name:<44} {value:>12.3} {unit}");
        self.0.push((name, value, unit));
    }
}

fn gb_per_s(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

fn pattern(len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect()
}

/// Why a run stopped.
enum Failure {
    Gpu(HipError),
    /// A copy's result differs from its source.
    Mismatch(&'static str),
}

impl From<HipError> for Failure {
    fn from(error: HipError) -> Failure {
        Failure::Gpu(error)
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Gpu(error) => write!(f, "{error}"),
            Failure::Mismatch(what) => {
                write!(f, "{what}: the data read back differs from the source")
            }
        }
    }
}

fn check_device_copy(
    stream: &Stream,
    buffer: &DeviceBuffer<u32>,
    expected: &[u32],
    what: &'static str,
) -> Result<(), Failure> {
    let mut host = vec![0u32; buffer.len()];
    stream.read_to_host(buffer.view(), &mut host)?;
    if host != expected {
        return Err(Failure::Mismatch(what));
    }
    Ok(())
}

fn run(options: &Options, figures: &mut Figures) -> Result<(), Failure> {
    let started = Instant::now();
    let device = Device::open(0)?;
    let stream = device.new_stream()?;
    figures.add(
        "runtime start + open device 0",
        started.elapsed().as_secs_f64() * 1e3,
        "ms",
    );
    let versions = runtime_versions()?;
    println!(
        "# {} on {} ({}, {:.1} GiB), runtime {} driver {}, built for {PLATFORM} [{OFFLOAD_ARCHS}]",
        device.name(),
        device.arch(),
        device.info().pci_bus_id,
        device.total_memory() as f64 / (1u64 << 30) as f64,
        versions.runtime,
        versions.driver
    );

    // Allocation cost: one allocation per tensor, against one arena carved N times.
    let alloc_bytes = options.alloc_mib << 20;
    let timer = Instant::now();
    let many: Vec<DeviceBuffer<u8>> = (0..options.allocs)
        .map(|_| device.alloc::<u8>(alloc_bytes))
        .collect::<Result<_, _>>()?;
    figures.add(
        "separate device allocations: total",
        timer.elapsed().as_secs_f64() * 1e3,
        "ms",
    );
    let timer = Instant::now();
    drop(many);
    device.check_err()?;
    figures.add(
        "separate device allocations: free all",
        timer.elapsed().as_secs_f64() * 1e3,
        "ms",
    );
    let before = device.allocation_counters();
    let timer = Instant::now();
    let arena =
        device.new_arena(options.allocs * alloc_bytes.next_multiple_of(DEFAULT_ARENA_ALIGN))?;
    let pieces = (0..options.allocs)
        .map(|_| arena.alloc(alloc_bytes, DEFAULT_ARENA_ALIGN))
        .collect::<Result<Vec<_>, _>>()?;
    figures.add(
        "arena: one allocation + sub-allocations",
        timer.elapsed().as_secs_f64() * 1e3,
        "ms",
    );
    figures.add(
        "arena: device allocations made",
        device
            .allocation_counters()
            .since(&before)
            .device_allocations as f64,
        "count",
    );
    drop((pieces, arena));

    // Copies.
    let len = (options.size_mib << 20) / 4;
    let bytes = len * 4;
    let data = pattern(len);
    let timer = Instant::now();
    let mut pinned = device.alloc_pinned::<u32>(len)?;
    figures.add(
        "pinned host allocation (zeroed)",
        timer.elapsed().as_secs_f64() * 1e3,
        "ms",
    );
    pinned.as_mut_slice()?.copy_from_slice(&data);
    let mut target = device.alloc::<u32>(len)?;
    let mut second = device.alloc::<u32>(len)?;
    let (start, end) = (device.new_event()?, device.new_event()?);

    // Warm-up, then timed repetitions (device time from events, host time around them).
    stream.copy_h2d_async(&mut pinned, 0..len, target.view_mut())?;
    stream.synchronize()?;
    let timer = Instant::now();
    start.record(&stream)?;
    for _ in 0..options.iters {
        stream.copy_h2d_async(&mut pinned, 0..len, target.view_mut())?;
    }
    end.record(&stream)?;
    end.synchronize()?;
    let wall = timer.elapsed().as_secs_f64();
    let device_seconds = f64::from(end.elapsed_ms_since(&start)?) / 1e3;
    check_device_copy(&stream, &target, &data, "pinned h2d")?;
    figures.add(
        "h2d from pinned memory (device time)",
        gb_per_s(bytes * options.iters, device_seconds),
        "GB/s",
    );
    figures.add(
        "h2d from pinned memory (wall time)",
        gb_per_s(bytes * options.iters, wall),
        "GB/s",
    );

    stream.write_from_host(&data, second.view_mut())?;
    let timer = Instant::now();
    for _ in 0..options.iters {
        stream.write_from_host(&data, second.view_mut())?;
    }
    let wall = timer.elapsed().as_secs_f64();
    check_device_copy(&stream, &second, &data, "pageable h2d")?;
    figures.add(
        "h2d from pageable memory (wall time)",
        gb_per_s(bytes * options.iters, wall),
        "GB/s",
    );

    pinned.as_mut_slice()?.fill(0);
    start.record(&stream)?;
    for _ in 0..options.iters {
        stream.copy_d2h_async(target.view(), &mut pinned, 0..len)?;
    }
    end.record(&stream)?;
    end.synchronize()?;
    let device_seconds = f64::from(end.elapsed_ms_since(&start)?) / 1e3;
    if pinned.as_slice()? != &data[..] {
        return Err(Failure::Mismatch("pinned d2h"));
    }
    figures.add(
        "d2h into pinned memory (device time)",
        gb_per_s(bytes * options.iters, device_seconds),
        "GB/s",
    );

    stream.memset_async(second.view_mut(), 0)?;
    start.record(&stream)?;
    for _ in 0..options.iters {
        stream.copy_d2d_async(target.view(), second.view_mut())?;
    }
    end.record(&stream)?;
    end.synchronize()?;
    let device_seconds = f64::from(end.elapsed_ms_since(&start)?) / 1e3;
    check_device_copy(&stream, &second, &data, "d2d")?;
    figures.add(
        "d2d copy (bytes read + written)",
        gb_per_s(2 * bytes * options.iters, device_seconds),
        "GB/s",
    );
    Ok(device.synchronize()?)
}

fn write_json(
    path: &str,
    options: &Options,
    figures: &Figures,
    error: Option<&Failure>,
) -> std::io::Result<()> {
    let escape = |text: &str| text.replace('\\', "\\\\").replace('"', "\\\"");
    let mut json = format!(
        "{{\"platform\": \"{PLATFORM}\", \"archs\": \"{OFFLOAD_ARCHS}\", \"size_mib\": {}, \"iters\": {}, \"allocs\": {}, \"alloc_mib\": {}, \"figures\": {{",
        options.size_mib, options.iters, options.allocs, options.alloc_mib
    );
    let entries: Vec<String> = figures
        .0
        .iter()
        .map(|(name, value, unit)| {
            format!(
                "\"{}\": {{\"value\": {value:.6}, \"unit\": \"{unit}\"}}",
                escape(name)
            )
        })
        .collect();
    json.push_str(&entries.join(", "));
    json.push_str("}, \"error\": ");
    json.push_str(&error.map_or("null".to_owned(), |e| {
        format!("\"{}\"", escape(&e.to_string()))
    }));
    json.push_str("}\n");
    std::fs::write(path, json)
}

fn main() {
    let options = match parse_options() {
        Ok(options) => options,
        Err(message) => {
            eprintln!("gpu_smoke: {message}");
            std::process::exit(1);
        }
    };
    let mut figures = Figures(Vec::new());
    let outcome = run(&options, &mut figures);
    if let Some(path) = &options.json {
        if let Err(error) = write_json(path, &options, &figures, outcome.as_ref().err()) {
            eprintln!("gpu_smoke: cannot write {path}: {error}");
        }
    }
    match outcome {
        Ok(()) => {}
        Err(Failure::Gpu(error)) if error.is_unavailable() => {
            eprintln!("gpu_smoke: no gpu to measure: {error}");
            std::process::exit(2);
        }
        Err(error) => {
            eprintln!("gpu_smoke: {error}");
            std::process::exit(1);
        }
    }
}
