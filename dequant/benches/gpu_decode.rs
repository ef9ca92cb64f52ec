//! Throughput of the GPU decoders (every type, to f32 and to f16) and of the products
//! on the blocks, on device 0.
//!
//! ```text
//! cargo bench -p dequant --bench gpu_decode -- [--mvalues 64] [--iters 10] [--only Q4_K]
//!     [--json FILE] [--products [--tokens 1,4,512] [--shapes 7b|135m|30b-a3b]]
//! ```
//!
//! `--products` times the products instead, for each count of `--tokens` (default 1, 4
//! and 512), on a 7B Llama's matrix shapes (or, with `--shapes 135m`, SmolLM2-135M's; with
//! `--shapes 30b-a3b`, the dense matrices of Qwen3-30B-A3B):
//! microseconds per product, the weights' bytes
//! per second and the arithmetic rate (TFLOP/s, two operations per weight and token),
//! for each kernel that takes the count: `decode` (up to its limit of tokens), `batch`
//! (the tiled f16 products on the matrix units), `split` (the tiled products given room
//! to split the columns, which they use only where their tiles alone leave the device
//! idle), `skinny` (up to its limit of tokens, where the device runs it, given room
//! to split the columns too) and, past that limit, `fastest` (what `matmul::matmul`
//! runs, given room: the tokens past whole tiles take the skinny kernel), and for the
//! types the int8 matrix units take from `Q8_K` input (`matmul_q8k`), `int8` and
//! `int8-split` (without and with room to split the columns; the activations' quantizer,
//! made once for all the products of one input, not counted), so that the switch-over
//! between them can be read off. Each timed run cycles through copies
//! of the matrix that together exceed the GPU's L2 cache, so every product reads its
//! weights from device memory as in a forward pass.
//!
//! Each type decodes `--mvalues` Mi values (default 64 Mi: 256 MiB of f32 output) from
//! random blocks already in device memory. A figure is the median of `--iters` runs,
//! each timed with events on the stream. GB/s counts the bytes the kernel moves: the
//! blocks read plus the values written; the "in GB/s" column counts the blocks alone,
//! the rate at which quantized weights turn into numbers. The table goes to stdout and,
//! with `--json`, the same figures to FILE as one JSON object (the object is also
//! printed as the last line of stdout).
//!
//! With no GPU (built without one, or no device found) it prints
//! `SKIPPED gpu_decode: <why>` and exits 0.

use std::fmt::Write as _;
use std::io::Write as _;

use dequant::gpu::matmul;
use dequant::gpu::matmul_q8k;
use dequant::gpu::matvec::{self, GpuActivations, GpuMatrix};
use dequant::gpu::{decode_f16, decode_f32};
use gguf_format::GgmlType;
use half::f16;
use hip_backend::{Device, DeviceBuffer, Stream, OFFLOAD_ARCHS, PLATFORM};

struct Options {
    mvalues: usize,
    iters: usize,
    only: Option<String>,
    json: Option<String>,
    products: bool,
    tokens: Vec<usize>,
    shapes: &'static [(&'static str, usize, usize)],
}

fn options() -> Result<Options, String> {
    let mut options = Options {
        mvalues: 64,
        iters: 10,
        only: None,
        json: None,
        products: false,
        tokens: vec![1, 4, 512],
        shapes: &SHAPES,
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
            // Passed by `cargo bench` and by the GPU suite.
            "--bench" => {}
            "--mvalues" => options.mvalues = number(value()?)?,
            "--iters" => options.iters = number(value()?)?,
            "--only" => options.only = Some(value()?),
            "--json" => options.json = Some(value()?),
            "--products" => options.products = true,
            "--shapes" => {
                options.shapes = match value()?.as_str() {
                    "7b" => &SHAPES,
                    "135m" => &SMALL_SHAPES,
                    "30b-a3b" => &MOE_SHAPES,
                    other => return Err(format!("--shapes: {other:?} is not 7b, 135m or 30b-a3b")),
                }
            }
            "--tokens" => {
                options.tokens = value()?
                    .split(',')
                    .map(|t| number(t.trim().to_owned()))
                    .collect::<Result<_, _>>()?;
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(options)
}

/// One type's figures.
struct Row {
    ty: GgmlType,
    in_bytes: usize,
    f32_ms: f64,
    f16_ms: f64,
}

impl Row {
    fn gbps(bytes: usize, ms: f64) -> f64 {
        bytes as f64 / (ms * 1e-3) / 1e9
    }
}

/// Deterministic pseudo-random bytes (xorshift64), eight at a time.
fn random_bytes(len: usize) -> Vec<u8> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut bytes = Vec::with_capacity(len + 8);
    while bytes.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        bytes.extend_from_slice(&state.to_le_bytes());
    }
    bytes.truncate(len);
    bytes
}

/// Median milliseconds of `iters` runs of `run`, each between two events on `stream`.
fn time_ms(
    device: &Device,
    stream: &Stream,
    iters: usize,
    mut run: impl FnMut() -> Result<(), String>,
) -> Result<f64, String> {
    let start = device.new_event().map_err(|e| e.to_string())?;
    let end = device.new_event().map_err(|e| e.to_string())?;
    run()?; // warm-up: first launch, caches, clocks
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        start.record(stream).map_err(|e| e.to_string())?;
        run()?;
        end.record(stream).map_err(|e| e.to_string())?;
        end.synchronize().map_err(|e| e.to_string())?;
        times.push(end.elapsed_ms_since(&start).map_err(|e| e.to_string())? as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

fn bench(device: &Device, options: &Options) -> Result<Vec<Row>, String> {
    let stream = device.new_stream().map_err(|e| e.to_string())?;
    let n_values = options.mvalues << 20;
    let types: Vec<GgmlType> = GgmlType::ALL
        .into_iter()
        .filter(|ty| options.only.as_deref().is_none_or(|only| ty.name() == only))
        .collect();
    if types.is_empty() {
        return Err(format!("--only {:?} names no type", options.only));
    }
    // One buffer of random bytes, large enough for the widest type; every type decodes
    // from its start (random bytes are valid blocks of any type).
    let max_bytes = types
        .iter()
        .map(|ty| ty.row_bytes(n_values as u64).map(|b| b as usize))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| format!("{n_values} values are not whole blocks of every type"))?
        .into_iter()
        .max()
        .unwrap_or(0);
    let mut src: DeviceBuffer<u8> = device.alloc(max_bytes).map_err(|e| e.to_string())?;
    stream
        .write_from_host(&random_bytes(max_bytes), src.view_mut())
        .map_err(|e| e.to_string())?;
    let mut out32: DeviceBuffer<f32> = device.alloc(n_values).map_err(|e| e.to_string())?;
    let mut out16: DeviceBuffer<f16> = device.alloc(n_values).map_err(|e| e.to_string())?;

    let mut rows = Vec::new();
    for ty in types {
        let in_bytes = ty.row_bytes(n_values as u64).unwrap_or(0) as usize;
        let input = src.slice(0..in_bytes).map_err(|e| e.to_string())?;
        let f32_ms = time_ms(device, &stream, options.iters, || {
            decode_f32(ty, input, out32.view_mut(), &stream).map_err(|e| format!("{ty}: {e}"))
        })?;
        let f16_ms = time_ms(device, &stream, options.iters, || {
            decode_f16(ty, input, out16.view_mut(), &stream).map_err(|e| format!("{ty}: {e}"))
        })?;
        let row = Row {
            ty,
            in_bytes,
            f32_ms,
            f16_ms,
        };
        print_row(&row, n_values);
        rows.push(row);
    }
    stream.synchronize().map_err(|e| e.to_string())?;
    Ok(rows)
}

/// Which product kernel a row times.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kernel {
    /// The decode products (`matvec`, Q8 activations), up to `matvec::MAX_TOKENS`.
    Decode,
    /// The batch products (`matmul`, f16 activations on the matrix units).
    Batch,
    /// The batch products given room to split their columns.
    Split,
    /// The skinny batch products (weights decoded straight into the matrix
    /// instructions' registers), up to `matmul::SKINNY_MAX_TOKENS`, given room to
    /// split their columns.
    Skinny,
    /// What `matmul::matmul` runs, given room: past whole tiles of tokens, the tiled
    /// products and the skinny ones for the tokens left.
    Fastest,
    /// The int8 tiles (`matmul_q8k`) on `Q8_K` input.
    Int8,
    /// The int8 tiles given room to split their columns.
    Int8Split,
}

impl Kernel {
    fn name(self) -> &'static str {
        match self {
            Kernel::Decode => "decode",
            Kernel::Batch => "batch",
            Kernel::Split => "split",
            Kernel::Skinny => "skinny",
            Kernel::Fastest => "fastest",
            Kernel::Int8 => "int8",
            Kernel::Int8Split => "int8-split",
        }
    }
}

/// One product's figures.
struct ProductRow {
    ty: GgmlType,
    rows: usize,
    cols: usize,
    tokens: usize,
    kernel: Kernel,
    us: f64,
    weight_bytes: usize,
}

impl ProductRow {
    /// Multiply-adds counted as two operations each, per second, in units of 10^12.
    fn tflops(&self) -> f64 {
        2.0 * (self.rows * self.cols * self.tokens) as f64 / (self.us * 1e-6) / 1e12
    }
}

/// A 7B Llama's products: q/k/v and gate/up as one matrix each, the FFN's down
/// projection, the attention output and the vocabulary.
const SHAPES: [(&str, usize, usize); 5] = [
    ("qkv", 12_288, 4_096),
    ("gate_up", 22_016, 4_096),
    ("down", 4_096, 11_008),
    ("wo", 4_096, 4_096),
    ("output", 32_000, 4_096),
];

/// SmolLM2-135M's: 9 heads of 64 and 3 key heads, a feed-forward width of 1536 and a
/// vocabulary of 49152.
const SMALL_SHAPES: [(&str, usize, usize); 5] = [
    ("qkv", 960, 576),
    ("gate_up", 3_072, 576),
    ("down", 576, 1_536),
    ("wo", 576, 576),
    ("output", 49_152, 576),
];

/// Qwen3-30B-A3B's attention and output (32 heads of 128 and 4 key heads on a width of
/// 2048, a vocabulary of 151,936): the dense products of a mixture of experts, whose
/// few rows leave a batch's products short of workgroups.
const MOE_SHAPES: [(&str, usize, usize); 3] = [
    ("qkv", 5_120, 2_048),
    ("wo", 2_048, 4_096),
    ("output", 151_936, 2_048),
];

fn bench_products(device: &Device, options: &Options) -> Result<Vec<ProductRow>, String> {
    let e = |e: &dyn std::fmt::Display| e.to_string();
    let stream = device.new_stream().map_err(|x| e(&x))?;
    let types = product_types(options);
    // The split products' room, their counters left at zero by every product.
    let mut partials: DeviceBuffer<f32> =
        device.alloc(matmul::SPLIT_PARTIALS).map_err(|x| e(&x))?;
    let mut counters: DeviceBuffer<u32> =
        device.alloc(matmul::SPLIT_COUNTERS).map_err(|x| e(&x))?;
    stream
        .memset_async(counters.view_mut(), 0)
        .map_err(|x| e(&x))?;
    let skinny = matmul::skinny_available(device);
    let mut results = Vec::new();
    for ty in types {
        for &(name, rows, cols) in options.shapes {
            // A width that is not whole blocks of the type (576 for a k-quant): skipped.
            let Some(row_bytes) = ty.row_bytes(cols as u64) else {
                continue;
            };
            let bytes = row_bytes as usize * rows;
            // Copies enough to leave none of them in a 50 MB L2 between its uses.
            let copies = (256 << 20) / bytes + 2;
            let host = random_bytes(bytes);
            let mut bufs = Vec::with_capacity(copies);
            for _ in 0..copies {
                let mut buf: DeviceBuffer<u8> = device.alloc(bytes).map_err(|x| e(&x))?;
                stream
                    .write_from_host(&host, buf.view_mut())
                    .map_err(|x| e(&x))?;
                bufs.push(buf);
            }
            let mats: Vec<GpuMatrix<'_>> = bufs
                .iter()
                .map(|b| GpuMatrix::new(ty, rows, cols, b.view()))
                .collect::<Result<_, _>>()
                .map_err(|x| e(&x))?;
            for &tokens in &options.tokens {
                let x: Vec<f32> = (0..tokens * cols)
                    .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                    .collect();
                let mut x_dev: DeviceBuffer<f32> = device.alloc(x.len()).map_err(|x| e(&x))?;
                stream
                    .write_from_host(&x, x_dev.view_mut())
                    .map_err(|x| e(&x))?;
                let mut q8: DeviceBuffer<u8> = device
                    .alloc(matvec::q8_bytes(tokens, cols))
                    .map_err(|x| e(&x))?;
                matvec::quantize_q8(x_dev.view(), tokens, cols, q8.view_mut(), &stream)
                    .map_err(|x| e(&x))?;
                let mut out: DeviceBuffer<f32> = device.alloc(tokens * rows).map_err(|x| e(&x))?;
                let mut scales: DeviceBuffer<f32> = device.alloc(tokens).map_err(|x| e(&x))?;
                let mut x16: DeviceBuffer<f16> = device.alloc(x.len()).map_err(|x| e(&x))?;
                matmul::row_scales(
                    x_dev.view(),
                    tokens,
                    cols,
                    scales.view_mut(),
                    x16.view_mut(),
                    &stream,
                )
                .map_err(|x| e(&x))?;
                // Up to the decode products' limit, those first; then the batch products
                // twice: as they are, and given room to split their columns (which they
                // use only where their tiles leave the device idle).
                let int8 = matmul_q8k::q8k_takes(ty, cols, device);
                let mut xq: DeviceBuffer<u8> = device
                    .alloc(if int8 {
                        matmul_q8k::q8k_bytes(tokens, cols).unwrap_or(0)
                    } else {
                        1
                    })
                    .map_err(|x| e(&x))?;
                if int8 {
                    matmul_q8k::quantize_q8k(x_dev.view(), tokens, cols, xq.view_mut(), &stream)
                        .map_err(|x| e(&x))?;
                }
                let mut kernels = kernels_for(tokens, skinny);
                if int8 {
                    kernels.extend([Kernel::Int8, Kernel::Int8Split]);
                }
                for &kernel in &kernels {
                    let ms = time_ms(device, &stream, options.iters, || {
                        for m in &mats {
                            if matches!(kernel, Kernel::Int8 | Kernel::Int8Split) {
                                let room =
                                    (kernel == Kernel::Int8Split).then(|| matmul::SplitScratch {
                                        partials: partials.view_mut(),
                                        counters: counters.view_mut(),
                                    });
                                matmul_q8k::matmul_q8k(
                                    std::slice::from_ref(m),
                                    xq.view(),
                                    tokens,
                                    &mut [out.view_mut()],
                                    false,
                                    room,
                                    &stream,
                                )
                                .map_err(|x| format!("{ty} {name}: {x}"))?;
                                continue;
                            }
                            if kernel != Kernel::Decode {
                                let room =
                                    (kernel != Kernel::Batch).then(|| matmul::SplitScratch {
                                        partials: partials.view_mut(),
                                        counters: counters.view_mut(),
                                    });
                                let which = match kernel {
                                    Kernel::Skinny => matmul::BatchKernel::Skinny,
                                    Kernel::Fastest => matmul::BatchKernel::Fastest,
                                    _ => matmul::BatchKernel::Tiles,
                                };
                                matmul::matmul_with(
                                    which,
                                    std::slice::from_ref(m),
                                    x16.view(),
                                    scales.view(),
                                    tokens,
                                    &mut [out.view_mut()],
                                    false,
                                    room,
                                    &stream,
                                )
                                .map_err(|x| format!("{ty} {name}: {x}"))?;
                                continue;
                            }
                            matvec::matvec(
                                std::slice::from_ref(m),
                                GpuActivations::Q8(q8.view()),
                                tokens,
                                &mut [out.view_mut()],
                                false,
                                &stream,
                            )
                            .map_err(|x| format!("{ty} {name}: {x}"))?;
                        }
                        Ok(())
                    })?;
                    let row = ProductRow {
                        ty,
                        rows,
                        cols,
                        tokens,
                        kernel,
                        us: ms * 1e3 / copies as f64,
                        weight_bytes: bytes,
                    };
                    print_product_row(&row, name);
                    results.push(row);
                }
            }
        }
    }
    stream.synchronize().map_err(|x| e(&x))?;
    Ok(results)
}

/// The block types the products are timed for: every type the GPU multiplies on, or
/// the one `--only` names.
fn product_types(options: &Options) -> Vec<GgmlType> {
    [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::IQ4_NL,
        GgmlType::IQ4_XS,
        GgmlType::IQ3_XXS,
        GgmlType::IQ3_S,
        GgmlType::IQ2_XXS,
        GgmlType::IQ2_XS,
        GgmlType::IQ2_S,
        GgmlType::IQ1_S,
        GgmlType::IQ1_M,
        GgmlType::MXFP4,
    ]
    .into_iter()
    .filter(|ty| options.only.as_deref().is_none_or(|only| ty.name() == only))
    .collect()
}

/// The kernels timed for a number of tokens.
fn kernels_for(tokens: usize, skinny: bool) -> Vec<Kernel> {
    let mut kernels = Vec::new();
    if tokens <= matvec::MAX_TOKENS {
        kernels.push(Kernel::Decode);
    }
    kernels.extend([Kernel::Batch, Kernel::Split]);
    if tokens <= matmul::SKINNY_MAX_TOKENS && skinny {
        kernels.push(Kernel::Skinny);
    }
    if tokens > matmul::SKINNY_MAX_TOKENS {
        kernels.push(Kernel::Fastest);
    }
    kernels
}

/// One product's line on stdout.
fn print_product_row(row: &ProductRow, name: &str) {
    println!(
        "{:<7} {:<8} {:>6}x{:<6} {:>3} {:<6} {:>9.2} {:>8.0} {:>7.1}",
        row.ty.name(),
        name,
        row.rows,
        row.cols,
        row.tokens,
        row.kernel.name(),
        row.us,
        Row::gbps(row.weight_bytes, row.us * 1e-3),
        row.tflops(),
    );
}

fn products_json(device: &Device, rows: &[ProductRow]) -> String {
    let mut json = format!(
        "{{\"bench\":\"gpu_products\",\"platform\":{},\"device\":{},\"results\":[",
        json_string(PLATFORM.name()),
        json_string(device.name()),
    );
    for (i, r) in rows.iter().enumerate() {
        let _ = write!(
            json,
            "{}{{\"type\":{},\"rows\":{},\"cols\":{},\"tokens\":{},\"kernel\":{},\"us\":{:.3},\"gbps\":{:.1},\"tflops\":{:.2}}}",
            if i == 0 { "" } else { "," },
            json_string(r.ty.name()),
            r.rows,
            r.cols,
            r.tokens,
            json_string(r.kernel.name()),
            r.us,
            Row::gbps(r.weight_bytes, r.us * 1e-3),
            r.tflops(),
        );
    }
    json.push_str("]}");
    json
}

fn print_row(row: &Row, n_values: usize) {
    let f32_total = row.in_bytes + 4 * n_values;
    let f16_total = row.in_bytes + 2 * n_values;
    println!(
        "{:<8} {:>9.1} {:>9.3} {:>8.0} {:>8.0} {:>9.3} {:>8.0} {:>8.0} {:>9.1}",
        row.ty.name(),
        row.in_bytes as f64 / (1 << 20) as f64,
        row.f32_ms,
        Row::gbps(f32_total, row.f32_ms),
        Row::gbps(row.in_bytes, row.f32_ms),
        row.f16_ms,
        Row::gbps(f16_total, row.f16_ms),
        Row::gbps(row.in_bytes, row.f16_ms),
        n_values as f64 / (row.f32_ms * 1e-3) / 1e9,
    );
}

fn json_string(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn to_json(device: &Device, options: &Options, rows: &[Row]) -> String {
    let n_values = options.mvalues << 20;
    let mut json = format!(
        "{{\"bench\":\"gpu_decode\",\"platform\":{},\"device\":{},\"arch\":{},\"offload_archs\":{},\
         \"values\":{n_values},\"iters\":{},\"results\":[",
        json_string(PLATFORM.name()),
        json_string(device.name()),
        json_string(device.arch()),
        json_string(OFFLOAD_ARCHS),
        options.iters
    );
    for (i, row) in rows.iter().enumerate() {
        let f32_total = row.in_bytes + 4 * n_values;
        let f16_total = row.in_bytes + 2 * n_values;
        let _ = write!(
            json,
            "{}{{\"type\":{},\"in_bytes\":{},\"f32_ms\":{:.4},\"f32_gbps\":{:.1},\
             \"f32_in_gbps\":{:.1},\"f16_ms\":{:.4},\"f16_gbps\":{:.1},\"f16_in_gbps\":{:.1}}}",
            if i == 0 { "" } else { "," },
            json_string(row.ty.name()),
            row.in_bytes,
            row.f32_ms,
            Row::gbps(f32_total, row.f32_ms),
            Row::gbps(row.in_bytes, row.f32_ms),
            row.f16_ms,
            Row::gbps(f16_total, row.f16_ms),
            Row::gbps(row.in_bytes, row.f16_ms),
        );
    }
    json.push_str("]}");
    json
}

fn main() {
    let options = options().unwrap_or_else(|error| {
        eprintln!("gpu_decode: {error}");
        std::process::exit(2)
    });
    let device = match Device::open(0) {
        Ok(device) => device,
        Err(error) if error.is_unavailable() => {
            let line = format!("SKIPPED gpu_decode: {error}\n");
            let _ = std::io::stderr().write_all(line.as_bytes());
            return;
        }
        Err(error) => {
            eprintln!("gpu_decode: opening device 0 failed: {error}");
            std::process::exit(1)
        }
    };
    if options.products {
        println!(
            "gpu products on {} ({}, {}), median of {} runs",
            device.name(),
            device.arch(),
            PLATFORM,
            options.iters
        );
        println!(
            "{:<7} {:<8} {:>13} {:>3} {:<6} {:>9} {:>8} {:>7}",
            "type", "matrix", "rows x cols", "n", "kernel", "us", "GB/s", "TFLOP/s"
        );
        let rows = bench_products(&device, &options).unwrap_or_else(|error| {
            eprintln!("gpu_decode: {error}");
            std::process::exit(1)
        });
        let json = products_json(&device, &rows);
        println!("{json}");
        if let Some(path) = &options.json {
            if let Err(error) = std::fs::write(path, format!("{json}\n")) {
                eprintln!("gpu_decode: cannot write {path}: {error}");
                std::process::exit(1)
            }
        }
        return;
    }
    println!(
        "gpu_decode on {} ({}, {}), {} Mi values per type, median of {} runs",
        device.name(),
        device.arch(),
        PLATFORM,
        options.mvalues,
        options.iters
    );
    println!(
        "{:<8} {:>9} {:>9} {:>8} {:>8} {:>9} {:>8} {:>8} {:>9}",
        "type", "in MiB", "f32 ms", "GB/s", "in GB/s", "f16 ms", "GB/s", "in GB/s", "Gval/s"
    );
    let rows = bench(&device, &options).unwrap_or_else(|error| {
        eprintln!("gpu_decode: {error}");
        std::process::exit(1)
    });
    let json = to_json(&device, &options, &rows);
    println!("{json}");
    if let Some(path) = &options.json {
        if let Err(error) = std::fs::write(path, format!("{json}\n")) {
            eprintln!("gpu_decode: cannot write {path}: {error}");
            std::process::exit(1)
        }
    }
}
