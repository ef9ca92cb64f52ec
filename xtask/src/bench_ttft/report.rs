//! bench-ttft's results: the table for people, the targets met or not, and JSON.

use std::path::Path;

use serde_json::{json, Map, Value};

use super::Engine;

/// Warm target: our median within this fraction of llama.cpp's.
const WARM_TARGET_VS_LLAMA: f64 = 0.5;
/// Cold target: our median within this multiple of the file's read time.
const COLD_TARGET_VS_READ: f64 = 1.05;

/// One process (or file read) measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    /// Seconds from spawn to exit.
    pub wall_s: f64,
    /// What the engine reports about itself, in seconds, in the order it happens.
    pub parts: Vec<(&'static str, f64)>,
    /// Something the reader should know about this run.
    pub note: Option<String>,
}

impl Run {
    pub fn new(wall_s: f64) -> Run {
        Run {
            wall_s,
            parts: Vec::new(),
            note: None,
        }
    }
}

/// Every run of one engine on one prompt size and page-cache state.
pub struct Row {
    pub cache: &'static str,
    pub tokens: usize,
    pub engine: Engine,
    pub runs: Vec<Run>,
}

impl Row {
    pub fn new(cache: &'static str, tokens: usize, engine: &Engine) -> Row {
        Row {
            cache,
            tokens,
            engine: engine.clone(),
            runs: Vec::new(),
        }
    }

    fn median_s(&self) -> f64 {
        median(self.runs.iter().map(|r| r.wall_s).collect())
    }

    fn min_s(&self) -> f64 {
        self.runs
            .iter()
            .map(|r| r.wall_s)
            .fold(f64::INFINITY, f64::min)
    }

    /// Each part's median over the runs that report it, in the first run's order.
    fn parts(&self) -> Vec<(&'static str, f64)> {
        let Some(first) = self.runs.first() else {
            return Vec::new();
        };
        first
            .parts
            .iter()
            .map(|&(label, _)| {
                let values = self
                    .runs
                    .iter()
                    .flat_map(|r| r.parts.iter().filter(|p| p.0 == label).map(|p| p.1))
                    .collect();
                (label, median(values))
            })
            .collect()
    }

    fn is_ours(&self) -> bool {
        matches!(self.engine, Engine::Ours { .. })
    }
}

/// The middle value (the mean of the middle two for an even count); NaN for none.
fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len().is_multiple_of(2) {
        (values[mid - 1] + values[mid]) / 2.0
    } else {
        values[mid]
    }
}

/// What the run was.
pub struct Header<'a> {
    pub file: &'a Path,
    pub file_bytes: u64,
    pub device: &'static str,
    pub runs: usize,
    /// Each engine's command line on the first prompt.
    pub commands: Vec<String>,
    /// Why there are no cold rows though `--cold` asked for them.
    pub cold_skipped: Option<&'a str>,
}

/// Our median over the reference row's: llama.cpp's on the same prompt and cache
/// (`read` false), or the file read's on the same prompt, cold (`read` true).
fn ratio(rows: &[Row], row: &Row, read: bool) -> Option<f64> {
    if !row.is_ours() || (read && row.cache != "cold") {
        return None;
    }
    let reference = if read {
        Engine::FileRead
    } else {
        Engine::Llama
    };
    rows.iter()
        .find(|r| r.engine == reference && r.cache == row.cache && r.tokens == row.tokens)
        .map(|r| row.median_s() / r.median_s())
}

pub fn print(header: &Header, rows: &[Row]) {
    println!(
        "bench-ttft: {} ({:.2} GB) on {}, {} runs each: seconds from spawn to exit, one token generated",
        header.file.display(),
        header.file_bytes as f64 / 1e9,
        header.device,
        header.runs
    );
    for command in &header.commands {
        println!("  {command}");
    }
    println!(
        "{:<5} {:>6}  {:<22} {:>9} {:>9} {:>8} {:>8}  parts (median s: ours from process start, llama.cpp's own)",
        "cache", "tokens", "engine", "median s", "min s", "vs llama", "vs read"
    );
    let times = |ratio: Option<f64>| ratio.map_or_else(|| "-".into(), |r| format!("{r:.2}x"));
    for row in rows {
        let parts = row
            .parts()
            .iter()
            .map(|(label, s)| format!("{label} {s:.3}"))
            .collect::<Vec<_>>()
            .join("  ");
        let line = format!(
            "{:<5} {:>6}  {:<22} {:>9.3} {:>9.3} {:>8} {:>8}  {parts}",
            row.cache,
            row.tokens,
            row.engine.label(),
            row.median_s(),
            row.min_s(),
            times(ratio(rows, row, false)),
            times(ratio(rows, row, true)),
        );
        println!("{}", line.trim_end());
    }
    let mut notes: Vec<&str> = rows
        .iter()
        .flat_map(|r| r.runs.iter().filter_map(|run| run.note.as_deref()))
        .collect();
    notes.dedup();
    for note in notes {
        println!("note: {note}");
    }
    print_targets(header, rows);
}

fn print_targets(header: &Header, rows: &[Row]) {
    let verdict = |ratio: f64, target: f64| if ratio <= target { "met" } else { "not met" };
    println!("target warm: ours <= {WARM_TARGET_VS_LLAMA:.2}x llama.cpp's median");
    let warm: Vec<_> = rows
        .iter()
        .filter(|r| r.cache == "warm")
        .filter_map(|r| Some((r, ratio(rows, r, false)?)))
        .collect();
    if warm.is_empty() {
        println!("  not measured: no --llama-completion");
    }
    for (row, ratio) in warm {
        println!(
            "  {:>6} tokens  {:<22} {:>7}  {}",
            row.tokens,
            row.engine.label(),
            format!("{ratio:.2}x"),
            verdict(ratio, WARM_TARGET_VS_LLAMA)
        );
    }
    println!(
        "target cold: ours <= {COLD_TARGET_VS_READ:.2}x the file's read time (cold, 16 MiB reads)"
    );
    let cold: Vec<_> = rows
        .iter()
        .filter_map(|r| Some((r, ratio(rows, r, true)?)))
        .collect();
    if cold.is_empty() {
        match header.cold_skipped {
            Some(reason) => println!("  not measured: {reason}"),
            None => println!("  not measured: pass --cold"),
        }
    }
    for (row, ratio) in cold {
        println!(
            "  {:>6} tokens  {:<22} {:>7}  {}",
            row.tokens,
            row.engine.label(),
            format!("{ratio:.2}x"),
            verdict(ratio, COLD_TARGET_VS_READ)
        );
    }
}

pub fn to_json(header: &Header, rows: &[Row]) -> Value {
    let rows: Vec<Value> = rows
        .iter()
        .map(|row| {
            let parts: Map<String, Value> = row
                .parts()
                .into_iter()
                .map(|(label, s)| (label.to_owned(), json!(s)))
                .collect();
            json!({
                "cache": row.cache,
                "prompt_tokens": row.tokens,
                "engine": row.engine.label(),
                "wall_s": row.runs.iter().map(|r| r.wall_s).collect::<Vec<_>>(),
                "median_s": row.median_s(),
                "min_s": row.min_s(),
                "ratio_vs_llama": ratio(rows, row, false),
                "ratio_vs_read": ratio(rows, row, true),
                "parts_median_s": parts,
                "notes": row.runs.iter().filter_map(|r| r.note.clone()).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "file": header.file.display().to_string(),
        "file_bytes": header.file_bytes,
        "device": header.device,
        "runs": header.runs,
        "commands": header.commands,
        "cold_skipped": header.cold_skipped,
        "targets": {
            "warm_ratio_vs_llama": WARM_TARGET_VS_LLAMA,
            "cold_ratio_vs_read": COLD_TARGET_VS_READ,
        },
        "rows": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(cache: &'static str, engine: Engine, walls: &[f64]) -> Row {
        let mut row = Row::new(cache, 8, &engine);
        for &wall in walls {
            let mut run = Run::new(wall);
            run.parts.push(("first token", wall / 2.0));
            row.runs.push(run);
        }
        row
    }

    #[test]
    fn medians_take_the_middle_or_the_mean_of_the_middle_two() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }

    #[test]
    fn ratios_compare_ours_with_llama_warm_and_with_the_read_cold() {
        let ours = || Engine::Ours {
            load_mode: Some("background".into()),
        };
        let rows = [
            row("warm", ours(), &[1.0, 3.0, 2.0]),
            row("warm", Engine::Llama, &[4.0, 4.0, 5.0]),
            row("cold", Engine::FileRead, &[2.0, 2.0, 2.0]),
            row("cold", ours(), &[2.2, 2.0, 2.4]),
            row("cold", Engine::Llama, &[8.0, 8.0, 8.0]),
        ];
        assert_eq!(ratio(&rows, &rows[0], false), Some(0.5));
        assert_eq!(ratio(&rows, &rows[0], true), None);
        assert_eq!(ratio(&rows, &rows[1], false), None);
        assert_eq!(ratio(&rows, &rows[3], true), Some(1.1));
        assert_eq!(ratio(&rows, &rows[3], false), Some(0.275));
        assert_eq!(rows[0].parts(), [("first token", 1.0)]);
        assert_eq!(rows[0].min_s(), 1.0);
        let header = Header {
            file: Path::new("m.gguf"),
            file_bytes: 1,
            device: "gpu",
            runs: 3,
            commands: Vec::new(),
            cold_skipped: None,
        };
        let doc = to_json(&header, &rows);
        assert_eq!(doc["rows"][3]["ratio_vs_read"], json!(1.1));
        assert_eq!(doc["rows"][0]["wall_s"], json!([1.0, 3.0, 2.0]));
    }
}
