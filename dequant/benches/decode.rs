//! Decode throughput per type: the reference decoders and the fastest path, on one
//! thread and on rayon's pool.
//!
//! `cargo bench -p dequant --bench decode -- [--quick] [--values N] [--types Q4_K,Q6_K]
//! [--json FILE]`
//!
//! Each type decodes a tensor of `--values` values (default 8 Mi: well past the caches,
//! as whole-tensor decoding is) from random blocks with finite, normal f16 scales. The
//! best of several runs is reported as Melem/s (values out) and GB/s of input read.
//! `--json FILE` also writes the rows as JSON for machines.

use std::mem::offset_of;
use std::time::{Duration, Instant};

use dequant::blocks::*;
use dequant::{DecodePath, Decoder};
use gguf_format::GgmlType;
use half::f16;

/// Types in the table, with the byte offsets of their f16 fields within a block.
fn types() -> Vec<(GgmlType, Vec<usize>)> {
    use GgmlType as T;
    vec![
        (T::F16, vec![0]),
        (T::BF16, vec![]),
        (T::Q4_0, vec![offset_of!(BlockQ4_0, d)]),
        (
            T::Q4_1,
            vec![offset_of!(BlockQ4_1, d), offset_of!(BlockQ4_1, m)],
        ),
        (T::Q5_0, vec![offset_of!(BlockQ5_0, d)]),
        (
            T::Q5_1,
            vec![offset_of!(BlockQ5_1, d), offset_of!(BlockQ5_1, m)],
        ),
        (T::Q8_0, vec![offset_of!(BlockQ8_0, d)]),
        (
            T::Q2_K,
            vec![offset_of!(BlockQ2_K, d), offset_of!(BlockQ2_K, dmin)],
        ),
        (T::Q3_K, vec![offset_of!(BlockQ3_K, d)]),
        (
            T::Q4_K,
            vec![offset_of!(BlockQ4_K, d), offset_of!(BlockQ4_K, dmin)],
        ),
        (
            T::Q5_K,
            vec![offset_of!(BlockQ5_K, d), offset_of!(BlockQ5_K, dmin)],
        ),
        (T::Q6_K, vec![offset_of!(BlockQ6_K, d)]),
        (T::IQ2_XXS, vec![offset_of!(BlockIQ2_XXS, d)]),
        (T::IQ2_XS, vec![offset_of!(BlockIQ2_XS, d)]),
        (T::IQ2_S, vec![offset_of!(BlockIQ2_S, d)]),
        (T::IQ3_XXS, vec![offset_of!(BlockIQ3_XXS, d)]),
        (T::IQ3_S, vec![offset_of!(BlockIQ3_S, d)]),
        (T::IQ1_S, vec![offset_of!(BlockIQ1_S, d)]),
        (T::IQ1_M, vec![]),
        (T::IQ4_NL, vec![offset_of!(BlockIQ4_NL, d)]),
        (T::IQ4_XS, vec![offset_of!(BlockIQ4_XS, d)]),
        (T::TQ1_0, vec![offset_of!(BlockTQ1_0, d)]),
        (T::TQ2_0, vec![offset_of!(BlockTQ2_0, d)]),
        (T::MXFP4, vec![]),
    ]
}

struct Args {
    values: usize,
    min_time: Duration,
    types: Option<Vec<String>>,
    json: Option<String>,
}

fn parse_args() -> Args {
    let mut args = Args {
        values: 8 << 20,
        min_time: Duration::from_millis(400),
        types: None,
        json: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--quick" => {
                args.values = 1 << 20;
                args.min_time = Duration::from_millis(100);
            }
            "--values" => {
                args.values = it.next().and_then(|v| v.parse().ok()).expect("--values N");
            }
            "--types" => {
                let list = it.next().expect("--types A,B");
                args.types = Some(list.split(',').map(str::to_string).collect());
            }
            "--json" => args.json = Some(it.next().expect("--json FILE")),
            // cargo bench passes --bench; other flags are not ours.
            _ => {}
        }
    }
    args
}

/// Seeded random blocks of `ty` holding at least `values` values, f16 fields set to
/// normal values in ±[2^-10, 2^-6) so no product is subnormal.
fn tensor(ty: GgmlType, f16_offsets: &[usize], values: usize) -> Vec<u8> {
    let block_values = ty.block_size() as usize;
    let block_bytes = ty.type_size() as usize;
    let blocks = values.div_ceil(block_values);
    let mut bytes = vec![0u8; blocks * block_bytes];
    let mut state = 0x243F_6A88_85A3_08D3u64;
    for chunk in bytes.chunks_mut(8) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        chunk.copy_from_slice(&state.to_le_bytes()[..chunk.len()]);
    }
    for block in bytes.chunks_mut(block_bytes) {
        for &at in f16_offsets {
            let bits = u16::from_le_bytes([block[at], block[at + 1]]);
            let magnitude = 2f32.powi(-10) * (1.0 + (bits & 0x3FF) as f32 / 1024.0);
            let sign = if bits & 0x8000 != 0 { -1.0 } else { 1.0 };
            let value = f16::from_f32(sign * magnitude);
            block[at..at + 2].copy_from_slice(&value.to_le_bytes());
        }
    }
    if ty == GgmlType::IQ1_M {
        // The f16 scale lies in the top nibbles of the four u16 of `scales`: make it
        // 2^-8 plus random mantissa bits.
        let at = offset_of!(BlockIQ1_M, scales);
        for block in bytes.chunks_mut(block_bytes) {
            let mantissa = u16::from_le_bytes([block[at], block[at + 2]]) & 0x00FF;
            let d = 0x1C00 | mantissa;
            for i in 0..4 {
                let nibble = ((d >> (4 * i)) & 0x0F) as u8;
                block[at + 2 * i + 1] = (block[at + 2 * i + 1] & 0x0F) | (nibble << 4);
            }
        }
    }
    if ty == GgmlType::MXFP4 {
        // Shared exponents near 2^0.
        for block in bytes.chunks_mut(block_bytes) {
            block[0] = 120 + block[0] % 16;
        }
    }
    bytes
}

/// Best time of one decode of `bytes` with `decoder`.
fn best_time(decoder: Decoder, ty: GgmlType, bytes: &[u8], out: &mut [f32], min: Duration) -> f64 {
    decoder.decode_f32(ty, bytes, out).expect("decodes");
    let (mut best, start, mut runs) = (f64::INFINITY, Instant::now(), 0);
    while runs < 3 || start.elapsed() < min {
        let t = Instant::now();
        decoder.decode_f32(ty, bytes, out).expect("decodes");
        best = best.min(t.elapsed().as_secs_f64());
        runs += 1;
    }
    std::hint::black_box(&out);
    best
}

fn main() {
    let args = parse_args();
    let fast = Decoder::new();
    let configs = [
        ("scalar 1T", Decoder::scalar().parallel(false)),
        ("best 1T", fast.parallel(false)),
        ("scalar all", Decoder::scalar()),
        ("best all", fast),
    ];
    println!(
        "decode to f32: {} values per type, best path {}, {} threads",
        args.values,
        fast.path().name(),
        rayon::current_num_threads()
    );
    if fast.path() != DecodePath::Avx2 {
        println!("(no avx2+f16c on this cpu: best = scalar)");
    }
    print!("{:<8} {:>8}", "type", "in MB");
    for (name, _) in &configs {
        print!(" | {name:^18}");
    }
    println!();
    print!("{:<8} {:>8}", "", "");
    for _ in &configs {
        print!(" | {:>8} {:>9}", "Melem/s", "GB/s in");
    }
    println!();

    let mut json_rows = Vec::new();
    for (ty, offsets) in types() {
        if let Some(list) = &args.types {
            if !list.iter().any(|t| t == ty.name()) {
                continue;
            }
        }
        let bytes = tensor(ty, &offsets, args.values);
        let n = dequant::decoded_len(ty, bytes.len()).expect("whole blocks");
        let mut out = vec![0f32; n];
        print!("{:<8} {:>8.2}", ty.name(), bytes.len() as f64 / 1e6);
        for (name, decoder) in &configs {
            let secs = best_time(*decoder, ty, &bytes, &mut out, args.min_time);
            let melem = n as f64 / secs / 1e6;
            let gbs = bytes.len() as f64 / secs / 1e9;
            print!(" | {melem:>8.0} {gbs:>9.2}");
            json_rows.push(format!(
                "{{\"type\":\"{}\",\"config\":\"{name}\",\"values\":{n},\"bytes\":{},\
                 \"seconds\":{secs:e},\"melem_per_s\":{melem:.1},\"gb_per_s_in\":{gbs:.3}}}",
                ty.name(),
                bytes.len()
            ));
        }
        println!();
    }
    if let Some(path) = args.json {
        let body = format!("[\n{}\n]\n", json_rows.join(",\n"));
        std::fs::write(&path, body).expect("writing the json file");
        println!("wrote {path}");
    }
}
