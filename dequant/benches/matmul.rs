//! Throughput of the quantized matrix products.
//!
//! `cargo bench -p dequant --bench matmul -- [--quick] [--threads N] [--scalar]
//! [--only matvec|decode|matmul] [--shapes TEXT] [--outside-pool] [--json FILE]`
//!
//! - matvec (decode): GB/s of weights read and microseconds per product, both with the
//!   matrix hot in cache and streamed from memory (cycling over copies that together
//!   far exceed the last-level cache), next to the machine's own memory read bandwidth
//!   measured here;
//! - a whole model's decode step: every layer's matrices as distinct copies, multiplied
//!   in forward order, giving the matvec time per token and the tokens/s it allows;
//! - matmul (prefill): GFLOP/s (2 · rows · cols · tokens) for batches of 4 (a few
//!   sequences decoded together), 64 and 512.
//!
//! `--shapes TEXT` keeps the matrices whose label contains `TEXT` (`llama7b`, `Q4_K`).
//! The products take the fastest path this CPU has: set `ROCMFORGE_CPU_AVX512=0` to time
//! the AVX2 kernels on an AVX-512 machine (the bench passes it on to
//! [`dequant::matmul::set_avx512_allowed`], as `rocmforge` does).
//!
//! The products are called from one of rayon's pool threads, as a forward pass running
//! inside the pool calls them (`--outside-pool`: from the main thread instead).
//!
//! Shapes and types are those of SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M and a 7B Llama
//! Q4_K_M (matrices only: its whole decode step is `rocmforge generate`'s); weights are
//! random blocks with finite scales. Each figure is from the fastest of many calls
//! timed one by one (see `best_time`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use dequant::matmul::{best_path, QuantizedMatrix};
use dequant::DecodePath;
use gguf_format::GgmlType;

/// SplitMix64, for reproducible random blocks (the unit tests' generator).
#[path = "../src/splitmix.rs"]
#[allow(dead_code)]
mod splitmix;
use splitmix::Rng;

/// Bytes of weight copies cycled through for the streamed figures (≫ the L3 cache).
const STREAM_BYTES: usize = 512 << 20;
/// Bytes read for the memory bandwidth reference.
const MEMORY_BYTES: usize = 1 << 30;

struct Options {
    quick: bool,
    threads: Option<usize>,
    scalar: bool,
    json: Option<String>,
    /// Call the products from the main thread rather than from one of the pool's.
    outside_pool: bool,
    /// Run only the sections whose name contains this (`matvec`, `decode`, `matmul`).
    only: Option<String>,
    /// Keep only the matrices whose label (with the type's name) contains this.
    shapes: Option<String>,
}

impl Options {
    fn wants(&self, section: &str) -> bool {
        self.only
            .as_deref()
            .is_none_or(|only| section.contains(only))
    }
}

fn options() -> Options {
    let mut opts = Options {
        quick: false,
        threads: None,
        scalar: false,
        json: None,
        only: None,
        shapes: None,
        outside_pool: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--quick" => opts.quick = true,
            "--scalar" => opts.scalar = true,
            "--outside-pool" => opts.outside_pool = true,
            "--threads" => opts.threads = args.next().and_then(|v| v.parse().ok()),
            "--json" => opts.json = args.next(),
            "--only" => opts.only = args.next(),
            "--shapes" => opts.shapes = args.next(),
            _ => {} // `cargo bench` passes `--bench`
        }
    }
    opts
}

/// Random blocks of `ty` with small finite f16 scales (and finite float weights).
fn random_weights(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    let len = ty.row_bytes(cols as u64).expect("whole blocks") as usize * rows;
    let mut bytes: Vec<u8> = (0..len).map(|_| rng.next_u64() as u8).collect();
    let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
    let scale_fields: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        GgmlType::Q3_K => &[108],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::IQ4_XS
        | GgmlType::IQ4_NL
        | GgmlType::IQ3_S
        | GgmlType::IQ3_XXS
        | GgmlType::IQ2_XXS
        | GgmlType::IQ2_XS
        | GgmlType::IQ2_S
        | GgmlType::IQ1_S => &[0],
        // IQ1_M's scale lies in the top nibbles of its scales; random bytes there are a
        // random f16, made finite and small below.
        GgmlType::IQ1_M => &[],
        GgmlType::TQ1_0 => &[52],
        GgmlType::TQ2_0 => &[64],
        GgmlType::F16 => &[0],
        GgmlType::BF16 => &[],
        GgmlType::F32 => {
            for w in bytes.chunks_exact_mut(4) {
                w.copy_from_slice(&(rng.unit() - 0.5).to_le_bytes());
            }
            &[]
        }
        other => panic!("no generator for {other}"),
    };
    if ty == GgmlType::BF16 {
        for w in bytes.chunks_exact_mut(2) {
            w[1] &= 0xBF; // exponent below 128: finite
        }
    }
    for block in bytes.chunks_exact_mut(ty.type_size() as usize) {
        for &at in scale_fields {
            block[at..at + 2].copy_from_slice(&f16(0.001 + 0.02 * rng.unit()));
        }
        if ty == GgmlType::IQ1_M {
            // The f16 scale's nibble k in the top nibble of byte 49 + 2k (the scales
            // start at 48): exponent nibble 0x1 keeps it small and finite.
            block[55] = (block[55] & 0x0F) | 0x10;
        }
    }
    bytes
}

/// The fastest of the calls of `f` timed one by one for `budget` (at least five, after
/// one to warm up). On a machine shared with other work, a thread often gets only part
/// of a core; the fastest call is the one least disturbed.
fn best_time(budget: Duration, mut f: impl FnMut()) -> Duration {
    f();
    let start = Instant::now();
    let mut best = Duration::MAX;
    let mut calls = 0u32;
    while calls < 5 || start.elapsed() < budget {
        let call = Instant::now();
        f();
        best = best.min(call.elapsed());
        calls += 1;
    }
    best
}

fn gb_per_s(bytes: usize, t: Duration) -> f64 {
    bytes as f64 / t.as_secs_f64() / 1e9
}

/// Read bandwidth of this machine with rayon's pool: a sum over a 1 GiB buffer.
fn memory_bandwidth(budget: Duration) -> f64 {
    use rayon::prelude::*;
    let buffer: Vec<u64> = (0..MEMORY_BYTES / 8).map(|i| i as u64).collect();
    let t = best_time(budget, || {
        let sum = buffer
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &v| a.wrapping_add(v)))
            .reduce(|| 0, u64::wrapping_add);
        black_box(sum);
    });
    gb_per_s(MEMORY_BYTES, t)
}

/// One matrix of a model: name, type, rows, cols.
type Shape = (&'static str, GgmlType, usize, usize);

const SMOLLM2_LAYER: [Shape; 7] = [
    ("attn_q", GgmlType::Q4_1, 576, 576),
    ("attn_k", GgmlType::Q4_1, 192, 576),
    ("attn_v", GgmlType::Q4_1, 192, 576),
    ("attn_output", GgmlType::Q4_1, 576, 576),
    ("ffn_gate", GgmlType::Q4_1, 1536, 576),
    ("ffn_up", GgmlType::Q4_1, 1536, 576),
    ("ffn_down", GgmlType::Q4_1, 576, 1536),
];
const SMOLLM2_OUTPUT: Shape = ("output", GgmlType::Q8_0, 49152, 576);

const GEMMA3_LAYER: [Shape; 7] = [
    ("attn_q", GgmlType::Q5_0, 1024, 640),
    ("attn_k", GgmlType::Q5_0, 256, 640),
    ("attn_v", GgmlType::Q8_0, 256, 640),
    ("attn_output", GgmlType::Q4_K, 640, 1024),
    ("ffn_gate", GgmlType::Q5_0, 2048, 640),
    ("ffn_up", GgmlType::Q5_0, 2048, 640),
    ("ffn_down", GgmlType::Q6_K, 640, 2048),
];
const GEMMA3_OUTPUT: Shape = ("output", GgmlType::Q8_0, 262144, 640);

/// A 7B Llama in Q4_K_M (`xtask synth-model --preset 7b-q4k`): its decode step is
/// mostly these products.
const LLAMA7B_LAYER: [Shape; 7] = [
    ("attn_q", GgmlType::Q4_K, 4096, 4096),
    ("attn_k", GgmlType::Q4_K, 4096, 4096),
    ("attn_v", GgmlType::Q4_K, 4096, 4096),
    ("attn_output", GgmlType::Q4_K, 4096, 4096),
    ("ffn_gate", GgmlType::Q4_K, 11008, 4096),
    ("ffn_up", GgmlType::Q4_K, 11008, 4096),
    ("ffn_down", GgmlType::Q6_K, 4096, 11008),
];
const LLAMA7B_OUTPUT: Shape = ("output", GgmlType::Q6_K, 49152, 4096);

/// The other types, on one square shape.
const OTHER_TYPES: [GgmlType; 21] = [
    GgmlType::Q4_0,
    GgmlType::Q5_1,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::IQ3_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ1_S,
    GgmlType::IQ1_M,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

/// The distinct (type, shape) pairs of the models, then the other types; only those
/// whose label or type contains `filter`, when given.
fn bench_shapes(filter: Option<&str>) -> Vec<(String, Shape)> {
    let mut shapes: Vec<(String, Shape)> = Vec::new();
    for (model, layer, output) in [
        ("smollm2", &SMOLLM2_LAYER, SMOLLM2_OUTPUT),
        ("gemma3", &GEMMA3_LAYER, GEMMA3_OUTPUT),
        ("llama7b", &LLAMA7B_LAYER, LLAMA7B_OUTPUT),
    ] {
        let mut names: Vec<(Vec<&str>, Shape)> = Vec::new();
        for &s in layer.iter().chain([&output]) {
            match names
                .iter_mut()
                .find(|(_, o)| (o.1, o.2, o.3) == (s.1, s.2, s.3))
            {
                Some((list, _)) => list.push(s.0),
                None => names.push((vec![s.0], s)),
            }
        }
        for (list, s) in names {
            shapes.push((format!("{model} {} {}x{}", list.join("/"), s.2, s.3), s));
        }
    }
    for ty in OTHER_TYPES {
        shapes.push(("square 2048x2048".to_string(), ("square", ty, 2048, 2048)));
    }
    shapes.retain(|(label, shape)| {
        filter.is_none_or(|f| label.contains(f) || shape.1.name().contains(f))
    });
    shapes
}

struct Row {
    label: String,
    ty: GgmlType,
    bytes: usize,
    cached: Duration,
    streamed: Duration,
}

/// Matvec GB/s of one shape, hot in cache and streamed over copies.
fn bench_matvec(
    backend: DecodePath,
    label: &str,
    (_, ty, rows, cols): Shape,
    budget: Duration,
) -> Row {
    let one = random_weights(ty, rows, cols, rows as u64 ^ cols as u64);
    let copies = (STREAM_BYTES / one.len()).max(2);
    let pool: Vec<u8> = one
        .iter()
        .copied()
        .cycle()
        .take(one.len() * copies)
        .collect();
    let matrices: Vec<QuantizedMatrix<'_>> = pool
        .chunks_exact(one.len())
        .map(|b| QuantizedMatrix::new(ty, rows, cols, b).expect("valid shape"))
        .collect();
    let x: Vec<f32> = (0..cols)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let mut y = vec![0.0f32; rows];
    let cached = best_time(budget, || {
        matrices[0]
            .matvec_with(backend, &x, &mut y)
            .expect("shapes match")
    });
    let mut next = 0;
    let streamed = best_time(budget, || {
        matrices[next]
            .matvec_with(backend, &x, &mut y)
            .expect("shapes match");
        next = (next + 1) % matrices.len();
    });
    Row {
        label: label.to_string(),
        ty,
        bytes: one.len(),
        cached,
        streamed,
    }
}

/// A whole decode step's matvecs over distinct copies of every layer's matrices.
/// Returns (weight bytes per token, seconds per token).
fn bench_model(
    backend: DecodePath,
    layer: &[Shape],
    n_layers: usize,
    output: Shape,
    budget: Duration,
) -> (usize, Duration) {
    let mut shapes: Vec<Shape> = (0..n_layers).flat_map(|_| layer.iter().copied()).collect();
    shapes.push(output);
    let weights: Vec<Vec<u8>> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(_, ty, rows, cols))| random_weights(ty, rows, cols, i as u64))
        .collect();
    let matrices: Vec<QuantizedMatrix<'_>> = shapes
        .iter()
        .zip(&weights)
        .map(|(&(_, ty, rows, cols), b)| {
            QuantizedMatrix::new(ty, rows, cols, b).expect("valid shape")
        })
        .collect();
    let max_dim = shapes.iter().map(|s| s.2.max(s.3)).max().unwrap_or(0);
    let x: Vec<f32> = (0..max_dim)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let mut y = vec![0.0f32; max_dim];
    let t = best_time(budget, || {
        for m in &matrices {
            m.matvec_with(backend, &x[..m.cols()], &mut y[..m.rows()])
                .expect("shapes match");
        }
    });
    (weights.iter().map(Vec::len).sum(), t)
}

/// Matmul time of one shape for a batch of `n_tokens`.
fn bench_matmul(
    backend: DecodePath,
    (_, ty, rows, cols): Shape,
    n_tokens: usize,
    budget: Duration,
) -> Duration {
    let w = random_weights(ty, rows, cols, 7);
    let m = QuantizedMatrix::new(ty, rows, cols, &w).expect("valid shape");
    let x: Vec<f32> = (0..n_tokens * cols)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let mut y = vec![0.0f32; n_tokens * rows];
    best_time(budget, || {
        m.matmul_with(backend, &x, n_tokens, &mut y)
            .expect("shapes match")
    })
}

fn gflop_per_s((_, _, rows, cols): Shape, n_tokens: usize, t: Duration) -> f64 {
    2.0 * (rows * cols * n_tokens) as f64 / t.as_secs_f64() / 1e9
}

fn micros(t: Duration) -> f64 {
    t.as_secs_f64() * 1e6
}

fn matvec_section(
    backend: DecodePath,
    shapes: &[(String, Shape)],
    memory: f64,
    budget: Duration,
    json: &mut Vec<String>,
) {
    println!("\nmatvec (decode): GB/s of weights read, µs per product");
    println!(
        "{:<36} {:<5} {:>7} {:>12} {:>10} {:>14} {:>12} {:>9}",
        "matrix",
        "type",
        "KiB",
        "cached GB/s",
        "cached µs",
        "streamed GB/s",
        "streamed µs",
        "% of mem"
    );
    for (label, shape) in shapes {
        let r = bench_matvec(backend, label, *shape, budget);
        let (cached, streamed) = (gb_per_s(r.bytes, r.cached), gb_per_s(r.bytes, r.streamed));
        println!(
            "{:<36} {:<5} {:>7} {:>12.1} {:>10.1} {:>14.1} {:>12.1} {:>8.0}%",
            r.label,
            r.ty.name(),
            r.bytes / 1024,
            cached,
            micros(r.cached),
            streamed,
            micros(r.streamed),
            100.0 * streamed / memory
        );
        json.push(format!(
            r#"{{"bench":"matvec","backend":"{}","matrix":"{}","type":"{}","bytes":{},"cached_gb_s":{:.2},"cached_us":{:.2},"streamed_gb_s":{:.2},"streamed_us":{:.2}}}"#,
            backend.name(),
            r.label,
            r.ty.name(),
            r.bytes,
            cached,
            micros(r.cached),
            streamed,
            micros(r.streamed)
        ));
    }
}

fn decode_section(backend: DecodePath, memory: f64, budget: Duration, json: &mut Vec<String>) {
    println!("\nwhole decode step (every layer's matrices, distinct copies, plus the output)");
    println!(
        "{:<10} {:>9} {:>10} {:>8} {:>9} {:>16}",
        "model", "MiB", "ms/token", "GB/s", "% of mem", "tokens/s bound"
    );
    for (model, layer, n_layers, output) in [
        ("smollm2", &SMOLLM2_LAYER, 30, SMOLLM2_OUTPUT),
        ("gemma3", &GEMMA3_LAYER, 18, GEMMA3_OUTPUT),
    ] {
        let (bytes, t) = bench_model(backend, layer, n_layers, output, budget * 2);
        let gbs = gb_per_s(bytes, t);
        println!(
            "{:<10} {:>9.1} {:>10.2} {:>8.1} {:>8.0}% {:>16.0}",
            model,
            bytes as f64 / (1 << 20) as f64,
            t.as_secs_f64() * 1e3,
            gbs,
            100.0 * gbs / memory,
            1.0 / t.as_secs_f64()
        );
        json.push(format!(
            r#"{{"bench":"decode_step","backend":"{}","model":"{model}","bytes":{bytes},"ms_per_token":{:.3},"gb_s":{gbs:.2}}}"#,
            backend.name(),
            t.as_secs_f64() * 1e3
        ));
    }
}

fn matmul_section(
    backend: DecodePath,
    shapes: &[(String, Shape)],
    budget: Duration,
    json: &mut Vec<String>,
) {
    println!("\nmatmul (prefill): GFLOP/s, and µs per product of 4 tokens");
    println!(
        "{:<36} {:<5} {:>10} {:>10} {:>10} {:>10}",
        "matrix", "type", "4 tokens", "4 tok µs", "64 tokens", "512 tokens"
    );
    for (label, shape) in shapes.iter().filter(|(_, s)| s.2 <= 4096) {
        let four = bench_matmul(backend, *shape, 4, budget);
        let small = gflop_per_s(*shape, 64, bench_matmul(backend, *shape, 64, budget));
        let large = gflop_per_s(*shape, 512, bench_matmul(backend, *shape, 512, budget));
        println!(
            "{:<36} {:<5} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
            label,
            shape.1.name(),
            gflop_per_s(*shape, 4, four),
            micros(four),
            small,
            large
        );
        json.push(format!(
            r#"{{"bench":"matmul","backend":"{}","matrix":"{label}","type":"{}","gflop_s_4":{:.2},"us_4":{:.2},"gflop_s_64":{small:.2},"gflop_s_512":{large:.2}}}"#,
            backend.name(),
            shape.1.name(),
            gflop_per_s(*shape, 4, four),
            micros(four)
        ));
    }
}

/// Set to `0`, the products keep off the AVX-512 kernels.
const AVX512_ENV: &str = "ROCMFORGE_CPU_AVX512";

fn main() {
    let opts = options();
    dequant::matmul::set_avx512_allowed(std::env::var_os(AVX512_ENV).is_none_or(|v| v != "0"));
    if let Some(n) = opts.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .expect("first pool");
    }
    let budget = Duration::from_millis(if opts.quick { 100 } else { 400 });
    let mut backends = vec![best_path()];
    if opts.scalar && backends[0] != DecodePath::Scalar {
        backends.push(DecodePath::Scalar);
    }
    let threads = rayon::current_num_threads();
    let memory = memory_bandwidth(budget);
    let caller = if opts.outside_pool {
        "outside"
    } else {
        "inside"
    };
    println!(
        "matmul benchmark: {threads} threads, calls from {caller} the pool, \
         memory read bandwidth {memory:.1} GB/s (sum over 1 GiB)"
    );
    let mut json = Vec::new();
    let shapes = bench_shapes(opts.shapes.as_deref());
    let sections = |json: &mut Vec<String>| {
        for &backend in &backends {
            println!("\n== path {} ==", backend.name());
            if opts.wants("matvec") {
                matvec_section(backend, &shapes, memory, budget, json);
            }
            if opts.wants("decode") {
                decode_section(backend, memory, budget, json);
            }
            if opts.wants("matmul") {
                matmul_section(backend, &shapes, budget, json);
            }
        }
    };
    if opts.outside_pool {
        sections(&mut json);
    } else {
        // As a forward pass should: from one of the pool's threads, so that sharing out
        // a product costs no hand-over to the pool and back.
        rayon::scope(|_| sections(&mut json));
    }
    if let Some(path) = opts.json {
        let body = format!(
            "{{\"threads\":{threads},\"memory_gb_s\":{memory:.2},\"results\":[{}]}}\n",
            json.join(",")
        );
        std::fs::write(&path, body).expect("writable json path");
        println!("\nwrote {path}");
    }
}
