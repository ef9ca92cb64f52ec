//! How long opening a 7B-shaped model takes, and how much resident memory it costs.
//!
//! Writes a sparse 4 GiB GGUF with the shapes of a Q4_K_M llama 7B (header real, tensor
//! data a hole in the file, so writing it is instant), then opens it mapped and with
//! plain reads, and prints time and resident-set growth for each. Run with
//! `cargo bench -p tensor-store --bench open`.

use std::time::Instant;

use gguf_format::{GgmlType, GgufWriter};
use tensor_store::{LoadMode, TensorStore};

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

fn seven_b_header() -> (Vec<u8>, u64) {
    let (n_layers, dim, ffn, vocab) = (32u64, 4096u64, 11008u64, 32000u64);
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", "llama").unwrap();
    w.add_metadata("llama.block_count", n_layers as u32)
        .unwrap();
    let tokens: Vec<String> = (0..vocab).map(|i| format!("tok{i}")).collect();
    w.add_metadata("tokenizer.ggml.tokens", tokens).unwrap();
    w.add_tensor("token_embd.weight", GgmlType::Q4_K, &[dim, vocab])
        .unwrap();
    for l in 0..n_layers {
        let t = |n: &str| format!("blk.{l}.{n}.weight");
        w.add_tensor(&t("attn_norm"), GgmlType::F32, &[dim])
            .unwrap();
        for name in ["attn_q", "attn_k", "attn_v", "attn_output"] {
            w.add_tensor(&t(name), GgmlType::Q4_K, &[dim, dim]).unwrap();
        }
        w.add_tensor(&t("ffn_norm"), GgmlType::F32, &[dim]).unwrap();
        w.add_tensor(&t("ffn_gate"), GgmlType::Q4_K, &[dim, ffn])
            .unwrap();
        w.add_tensor(&t("ffn_up"), GgmlType::Q4_K, &[dim, ffn])
            .unwrap();
        w.add_tensor(&t("ffn_down"), GgmlType::Q6_K, &[ffn, dim])
            .unwrap();
    }
    w.add_tensor("output_norm.weight", GgmlType::F32, &[dim])
        .unwrap();
    w.add_tensor("output.weight", GgmlType::Q6_K, &[dim, vocab])
        .unwrap();
    let layout = w.layout().unwrap();
    (layout.header, layout.file_len)
}

fn main() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("sparse-7b.gguf");
    let (header, file_len) = seven_b_header();
    let file = std::fs::File::create(&path).expect("create");
    std::io::Write::write_all(&mut &file, &header).expect("write header");
    file.set_len(file_len).expect("extend");
    drop(file);

    println!(
        "model: {} ({:.2} GiB, sparse)",
        path.display(),
        file_len as f64 / (1u64 << 30) as f64
    );
    println!(
        "{:<8} {:>10} {:>10} {:>14} {:>16}",
        "mode", "best ms", "median ms", "RSS growth", "tensors"
    );
    for (name, mode) in [("mmap", LoadMode::Mmap), ("read", LoadMode::Read)] {
        let mut times = Vec::new();
        let mut growth = 0u64;
        let mut n = 0;
        for _ in 0..7 {
            let before = resident_bytes();
            let start = Instant::now();
            let store = TensorStore::open_with(&path, mode).expect("open");
            times.push(start.elapsed().as_secs_f64() * 1e3);
            growth = growth.max(resident_bytes().saturating_sub(before));
            n = store.len();
        }
        times.sort_by(f64::total_cmp);
        println!(
            "{:<8} {:>10.2} {:>10.2} {:>11.2} MiB {:>16}",
            name,
            times[0],
            times[times.len() / 2],
            growth as f64 / (1 << 20) as f64,
            n
        );
    }
}
