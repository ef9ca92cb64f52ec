//! dequant's build script: compiles the GPU decoders and products (`kernels/`) with
//! hip-backend's GPU configuration, when that configuration has a platform.
//!
//! The IQ lookup tables are not typed twice: this script reads the CPU decoders' own
//! generated tables (`src/decode/grids.rs`, written by `tools/gen_grids.py`) and writes
//! them into generated translation units: as `__constant__` arrays before
//! `kernels/dequant.hip` (the decoders) and `kernels/matmul.hip` (the batch products,
//! which decode tiles with them), and the grids the decode products read as `static const
//! __device__` arrays in global memory before `kernels/matvec.hip` (the decode products,
//! which include `kernels/matvec_experts.hip`). A missing table or a table of the wrong
//! length fails the build.
//!
//! The product files are compiled once per weight type ([`PRODUCT_TYPES`]), each unit a
//! device module of its own: the runtimes load a module's code whole at the first use of
//! any of its kernels (CUDA's lazy loading), so a model waits only for its own types'
//! products. With every type in one module per file, an H200 spent about 50 ms of a 7B's
//! first prompt loading code: 2,048 tokens took 259 ms in the first pass against 207 ms
//! with a module per type.

#[path = "../hip-backend/build/hip_build.rs"]
mod hip_build;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use hip_build::{fail, GpuConfig, Platform};

/// The tables the kernels use: Rust name, C element type, length, and whether the
/// products (`kernels/matvec.hip`) read it too (the decoders read them all).
const TABLES: &[(&str, &str, usize, bool)] = &[
    ("IQ2XXS_GRID", "uint64_t", 256, true),
    ("IQ2XS_GRID", "uint64_t", 512, true),
    ("IQ2S_GRID", "uint64_t", 1024, true),
    ("IQ3XXS_GRID", "uint32_t", 256, true),
    ("IQ3S_GRID", "uint32_t", 512, true),
    ("IQ1S_GRID", "uint64_t", 2048, true),
    ("KSIGNS_IQ2XS", "uint8_t", 128, false),
    ("KVALUES_IQ4NL", "int8_t", 16, false),
    ("KVALUES_MXFP4", "int8_t", 16, false),
];
/// The f32 constants the kernels use, and whether the products use them too.
const CONSTANTS: &[(&str, bool)] = &[("IQ1S_DELTA", true)];

/// A generated translation unit: its file name in OUT_DIR, the kernel source it
/// includes, how it declares the tables, and the macros it defines first.
struct Unit {
    file: String,
    kernels: &'static str,
    tables: Tables,
    defines: Vec<(String, String)>,
}

/// Where a unit keeps its tables. Both are `static`, so that each unit's copies (the
/// units are separate device modules) and their host-side shadows stay private to it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tables {
    /// Every table, in constant memory (the decoders, and the batch products that decode
    /// tiles with them).
    Constant,
    /// The decode products' tables, in global memory read through the L1 cache: the
    /// lanes of a warp each read their own grid entries, which NVIDIA's constant cache
    /// serves one address at a time.
    Global,
}

/// The weight types with products (batch and decode), as ggml codes (`GgmlType`) and the
/// names their units' launchers carry (`rf_matmul_q4_k`, `rf_matvec_q4_k` …).
/// One unit of each product file per type, so that a model loads only its own types'
/// code (the runtimes load a module whole at the first use of any of its kernels). Keep
/// in step with `product_launchers!` in src/gpu/mod.rs: a type missing on either side
/// fails the link.
const PRODUCT_TYPES: &[(u32, &str)] = &[
    (0, "f32"),
    (1, "f16"),
    (2, "q4_0"),
    (3, "q4_1"),
    (6, "q5_0"),
    (7, "q5_1"),
    (8, "q8_0"),
    (10, "q2_k"),
    (11, "q3_k"),
    (12, "q4_k"),
    (13, "q5_k"),
    (14, "q6_k"),
    (16, "iq2_xxs"),
    (17, "iq2_xs"),
    (18, "iq3_xxs"),
    (19, "iq1_s"),
    (20, "iq4_nl"),
    (21, "iq3_s"),
    (22, "iq2_s"),
    (23, "iq4_xs"),
    (29, "iq1_m"),
    (30, "bf16"),
    (39, "mxfp4"),
];

/// The product files: the name in their units' file names, the kernel source, the prefix
/// of the macros that say which unit it is (`_COMMON`, or `_TYPE` and `_NAME`), and
/// where their tables live.
const PRODUCT_FILES: [(&str, &str, &str, Tables); 2] = [
    (
        "matmul",
        "kernels/matmul.hip",
        "RF_MATMUL",
        Tables::Constant,
    ),
    ("matvec", "kernels/matvec.hip", "RF_MATVEC", Tables::Global),
];

/// Every unit: the decoders; for each product file, the part every type shares and one
/// unit per type.
fn units() -> Vec<Unit> {
    let mut units = vec![Unit {
        file: "rocmforge_dequant_kernels.hip".into(),
        kernels: "kernels/dequant.hip",
        tables: Tables::Constant,
        defines: Vec::new(),
    }];
    for (stem, kernels, prefix, tables) in PRODUCT_FILES {
        units.push(Unit {
            file: format!("rocmforge_{stem}_common.hip"),
            kernels,
            tables,
            defines: vec![(format!("{prefix}_COMMON"), "1".into())],
        });
        units.extend(PRODUCT_TYPES.iter().map(|&(code, name)| Unit {
            file: format!("rocmforge_{stem}_{name}.hip"),
            kernels,
            tables,
            defines: vec![
                (format!("{prefix}_TYPE"), code.to_string()),
                (format!("{prefix}_NAME"), name.to_owned()),
            ],
        }));
    }
    units
}

const GRIDS_RS: &str = "src/decode/grids.rs";
const KERNEL_SOURCES: &[&str] = &[
    "kernels/dequant.hip",
    "kernels/common.h",
    "kernels/decode_legacy.h",
    "kernels/decode_kquants.h",
    "kernels/decode_iquants.h",
    "kernels/matvec.hip",
    "kernels/matvec_tasks.h",
    "kernels/matvec_rows.h",
    "kernels/matvec_experts.hip",
    "kernels/matmul.hip",
    "kernels/matmul_decode.h",
    "kernels/matmul_launch.h",
    "kernels/skinny.hip",
    "kernels/skinny_rows.h",
    "kernels/skinny_q8.h",
    "kernels/tiles_q8k.h",
    "kernels/activations.h",
];

fn main() {
    let config = GpuConfig::from_dependency().unwrap_or_else(|error| fail(&error));
    config.emit_cfg();
    if config.platform == Platform::None {
        return;
    }
    let manifest_dir = PathBuf::from(env_var("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env_var("OUT_DIR"));
    for source in KERNEL_SOURCES.iter().chain([&GRIDS_RS]) {
        println!("cargo::rerun-if-changed={source}");
    }
    let grids = std::fs::read_to_string(manifest_dir.join(GRIDS_RS))
        .unwrap_or_else(|error| fail(&format!("cannot read {GRIDS_RS}: {error}")));
    let mut sources = Vec::new();
    for unit in units() {
        let text = translation_unit(&grids, &manifest_dir.join(unit.kernels), &unit)
            .unwrap_or_else(|error| fail(&format!("{GRIDS_RS}: {error}")));
        let path = out_dir.join(&unit.file);
        write_if_changed(&path, &text);
        sources.push(
            path.to_str()
                .unwrap_or_else(|| fail("OUT_DIR is not UTF-8"))
                .to_owned(),
        );
    }
    let sources: Vec<&str> = sources.iter().map(String::as_str).collect();
    config
        .compile("rocmforge_dequant_kernels", &sources)
        .unwrap_or_else(|error| fail(&error));
}

fn env_var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| fail(&format!("{name} is not set")))
}

/// Writes `text` unless the file already holds it, so its timestamp moves only when its
/// content does.
fn write_if_changed(path: &Path, text: &str) {
    if std::fs::read_to_string(path).ok().as_deref() == Some(text) {
        return;
    }
    std::fs::write(path, text)
        .unwrap_or_else(|error| fail(&format!("cannot write {}: {error}", path.display())));
}

/// The generated source: the unit's macros, the tables it says (every one as a `static
/// __constant__` array, or the products' ones as `static const __device__` arrays), the
/// constants, then the kernels.
fn translation_unit(grids: &str, kernels: &Path, unit: &Unit) -> Result<String, String> {
    let kernels = kernels
        .to_str()
        .filter(|path| !path.contains(['"', '\\', '\n']))
        .ok_or_else(|| format!("kernel path {} cannot be #included", kernels.display()))?;
    let tables = unit.tables;
    let (space, qualifier) = match tables {
        Tables::Constant => ("constant", "static __constant__"),
        Tables::Global => ("global", "static const __device__"),
    };
    let mut unit_text = format!(
        "// Generated by dequant/build.rs from src/decode/grids.rs: do not edit.\n\
         // The IQ lookup tables in {space} memory, then the kernels that read them.\n",
    );
    for (name, value) in &unit.defines {
        let _ = writeln!(unit_text, "#define {name} {value}");
    }
    unit_text.push_str("#include \"rocmforge_hip.h\"\n#include <stdint.h>\n\n");
    let mut unit = unit_text;
    for &(name, c_type, len, products) in TABLES {
        if tables == Tables::Global && !products {
            continue;
        }
        let values = static_array(grids, name)?;
        if values.len() != len {
            return Err(format!(
                "table {name} has {} entries, expected {len}",
                values.len()
            ));
        }
        let suffix = if c_type == "uint64_t" { "ull" } else { "" };
        let _ = writeln!(
            unit,
            "{qualifier} {c_type} rf_{}[{len}] = {{",
            name.to_lowercase()
        );
        for chunk in values.chunks(4) {
            let line: Vec<String> = chunk.iter().map(|v| format!("{v}{suffix},")).collect();
            let _ = writeln!(unit, "    {}", line.join(" "));
        }
        unit.push_str("};\n");
    }
    for &(name, products) in CONSTANTS {
        if tables == Tables::Global && !products {
            continue;
        }
        let value = f32_const(grids, name)?;
        let _ = writeln!(unit, "static constexpr float RF_{name} = {value:?}f;");
    }
    let _ = writeln!(unit, "\n#include \"{kernels}\"");
    Ok(unit)
}

/// The entries of `pub static NAME: [T; N] = [ ... ];`, each checked to be an integer
/// literal (decimal, possibly negative, or hexadecimal).
fn static_array(text: &str, name: &str) -> Result<Vec<String>, String> {
    let head = format!("pub static {name}:");
    let start = text.find(&head).ok_or_else(|| format!("no table {name}"))?;
    let rest = &text[start..];
    let open = rest
        .find("= [")
        .ok_or_else(|| format!("table {name} has no initializer"))?;
    let body = &rest[open + 3..];
    let close = body
        .find("];")
        .ok_or_else(|| format!("table {name} is not closed"))?;
    body[..close]
        .split([',', ' ', '\n', '\r', '\t'])
        .filter(|token| !token.is_empty())
        .map(|token| {
            let digits = token.strip_prefix('-').unwrap_or(token);
            let valid = match digits.strip_prefix("0x") {
                Some(hex) => !hex.is_empty() && hex.chars().all(|c| c.is_ascii_hexdigit()),
                None => !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit()),
            };
            if valid {
                Ok(token.to_owned())
            } else {
                Err(format!(
                    "table {name} holds {token:?}, not an integer literal"
                ))
            }
        })
        .collect()
}

/// The value of `pub const NAME: f32 = VALUE;`.
fn f32_const(text: &str, name: &str) -> Result<f32, String> {
    let head = format!("pub const {name}: f32 = ");
    let start = text
        .find(&head)
        .ok_or_else(|| format!("no constant {name}"))?;
    let rest = &text[start + head.len()..];
    let end = rest
        .find(';')
        .ok_or_else(|| format!("constant {name} is not closed"))?;
    rest[..end]
        .trim()
        .parse::<f32>()
        .map_err(|error| format!("constant {name}: {error}"))
}
