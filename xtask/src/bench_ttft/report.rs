//! bench-ttft's results: the table for people, the targets met or not, and JSON.

use std::path::Path;

use serde_json::{json, Map, Value};

use super::Engine;

/// Warm target: our median time to the first token within this fraction of llama.cpp's.
const WARM_TARGET_VS_LLAMA: f64 = 0.5;
/// Cold target: our median time to the first token within this multiple of the file's
/// read time.
const COLD_TARGET_VS_READ: f64 = 1.05;
/// Overlap target: of the shorter of the upload and the prefill, at most this fraction
/// shows in the background mode's first token.
const OVERLAP_SHOWN: f64 = 0.25;

/// One process (or file read) measured.
#[derive(Clone, Debug, PartialEq)]
pub struct Run {
    /// Seconds from spawn to exit.
    pub wall_s: f64,
    /// Seconds from spawn to the first token on its output, where that can be told (the
    /// whole time for the file read).
    pub token_s: Option<f64>,
    /// What the engine reports about itself, in seconds, in the order it happens.
    pub parts: Vec<(&'static str, f64)>,
    /// Something the reader should know about this run.
    pub note: Option<String>,
}

impl Run {
    pub fn new(wall_s: f64, token_s: Option<f64>) -> Run {
        Run {
            wall_s,
            token_s,
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

    /// Whether every run saw its first token (else its times are the exits').
    fn sees_tokens(&self) -> bool {
        self.runs.iter().all(|r| r.token_s.is_some())
    }

    /// The times the targets compare: to the first token where every run saw it, to the
    /// exit otherwise.
    fn times(&self) -> Vec<f64> {
        let seen = self.sees_tokens();
        self.runs
            .iter()
            .map(|r| r.token_s.filter(|_| seen).unwrap_or(r.wall_s))
            .collect()
    }

    fn median_s(&self) -> f64 {
        median(self.times())
    }

    fn min_s(&self) -> f64 {
        self.times().into_iter().fold(f64::INFINITY, f64::min)
    }

    fn median_exit_s(&self) -> f64 {
        median(self.runs.iter().map(|r| r.wall_s).collect())
    }

    /// The median of one of the parts.
    fn part(&self, label: &str) -> Option<f64> {
        self.parts()
            .into_iter()
            .find(|p| p.0 == label)
            .map(|p| p.1)
            .filter(|s| s.is_finite())
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
/// (`read` false), or the file read's on the same prompt, cold (`read` true). Times to
/// the first token where both rows saw them, to the exit otherwise.
fn ratio(rows: &[Row], row: &Row, read: bool) -> Option<f64> {
    if !row.is_ours() || (read && row.cache != "cold") {
        return None;
    }
    let reference = if read {
        Engine::FileRead
    } else {
        Engine::Llama
    };
    let other = rows
        .iter()
        .find(|r| r.engine == reference && r.cache == row.cache && r.tokens == row.tokens)?;
    Some(if row.sees_tokens() && other.sees_tokens() {
        row.median_s() / other.median_s()
    } else {
        row.median_exit_s() / other.median_exit_s()
    })
}

/// How well the background mode hid the shorter of its two phases, on one prompt and
/// cache: from the runtime's start, its first token against the bound
/// max(upload, prefill) + [`OVERLAP_SHOWN`] · min(upload, prefill), the upload and the
/// prefill alone taken from the eager mode's row.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Overlap {
    upload_s: f64,
    prefill_s: f64,
    first_token_s: f64,
    bound_s: f64,
    /// The same bound within each background run, where the runs say when their first
    /// pass had the weights it waits for.
    within: Option<WithinRuns>,
}

/// The overlap bound taken within each background run, its upload being that run's own
/// (until its first pass had the weights it waits for, from the runtime's start) and
/// its prefill the eager row's: the upload's pace varies from run to run by more than
/// a short prompt's prefill, which the bound over the rows' medians cannot tell apart.
#[derive(Clone, Copy, Debug, PartialEq)]
struct WithinRuns {
    /// The runs' median upload of the weights their first pass waited for.
    upload_s: f64,
    /// The median over the runs of the first token less that run's bound: met at 0 or
    /// below.
    over_bound_s: f64,
}

fn overlap(rows: &[Row], background: &Row) -> Option<Overlap> {
    let mode = |row: &Row| match &row.engine {
        Engine::Ours { load_mode } => load_mode.clone(),
        _ => None,
    };
    if mode(background).as_deref() != Some("background") {
        return None;
    }
    let eager = rows.iter().find(|r| {
        mode(r).as_deref() == Some("eager")
            && r.cache == background.cache
            && r.tokens == background.tokens
    })?;
    let upload_s = eager.part("upload")? - eager.part("runtime")?;
    let prefill_s = eager.part("first token")? - eager.part("prefill")?;
    let first_token_s = background.part("first token")? - background.part("runtime")?;
    let bound = |upload_s: f64| upload_s.max(prefill_s) + OVERLAP_SHOWN * upload_s.min(prefill_s);
    // Per run: (its own upload, its first token less its bound).
    let per_run: Option<Vec<(f64, f64)>> = background
        .runs
        .iter()
        .map(|run| {
            let runtime = run_part(run, "runtime")?;
            let upload_s = run_part(run, "weights")? - runtime;
            let first_token_s = run_part(run, "first token")? - runtime;
            Some((upload_s, first_token_s - bound(upload_s)))
        })
        .collect();
    let within = per_run
        .filter(|runs| !runs.is_empty())
        .map(|runs| WithinRuns {
            upload_s: median(runs.iter().map(|r| r.0).collect()),
            over_bound_s: median(runs.iter().map(|r| r.1).collect()),
        });
    Some(Overlap {
        upload_s,
        prefill_s,
        first_token_s,
        bound_s: bound(upload_s),
        within,
    })
}

/// One run's part `label`, where it reported it.
fn run_part(run: &Run, label: &str) -> Option<f64> {
    run.parts
        .iter()
        .find(|p| p.0 == label)
        .map(|p| p.1)
        .filter(|s| s.is_finite())
}

pub fn print(header: &Header, rows: &[Row]) {
    println!(
        "bench-ttft: {} ({:.2} GB) on {}, {} runs each: seconds from spawn to the first token seen \
         on stdout (* where it cannot be told: to the exit), and to the exit",
        header.file.display(),
        header.file_bytes as f64 / 1e9,
        header.device,
        header.runs
    );
    for command in &header.commands {
        println!("  {command}");
    }
    println!(
        "{:<5} {:>6}  {:<22} {:>9} {:>9} {:>9} {:>8} {:>8}  parts (median s: ours from process start, llama.cpp's own)",
        "cache", "tokens", "engine", "token s", "min s", "exit s", "vs llama", "vs read"
    );
    let times = |ratio: Option<f64>| ratio.map_or_else(|| "-".into(), |r| format!("{r:.2}x"));
    for row in rows {
        let parts = row
            .parts()
            .iter()
            .map(|(label, s)| format!("{label} {s:.3}"))
            .collect::<Vec<_>>()
            .join("  ");
        let seen = if row.sees_tokens() { " " } else { "*" };
        let line = format!(
            "{:<5} {:>6}  {:<22} {:>8.3}{seen} {:>9.3} {:>9.3} {:>8} {:>8}  {parts}",
            row.cache,
            row.tokens,
            row.engine.label(),
            row.median_s(),
            row.min_s(),
            row.median_exit_s(),
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

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "not met"
    }
}

/// One line for each row and its ratio, met when the ratio is at most `target`.
fn print_ratios(ratios: Vec<(&Row, f64)>, target: f64) {
    for (row, ratio) in ratios {
        println!(
            "  {:>6} tokens  {:<22} {:>7}  {}",
            row.tokens,
            row.engine.label(),
            format!("{ratio:.2}x"),
            verdict(ratio <= target)
        );
    }
}

fn print_targets(header: &Header, rows: &[Row]) {
    println!("target warm: ours <= {WARM_TARGET_VS_LLAMA:.2}x llama.cpp's median");
    let warm: Vec<_> = rows
        .iter()
        .filter(|r| r.cache == "warm")
        .filter_map(|r| Some((r, ratio(rows, r, false)?)))
        .collect();
    if warm.is_empty() {
        println!("  not measured: no --llama-completion");
    }
    print_ratios(warm, WARM_TARGET_VS_LLAMA);
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
    print_ratios(cold, COLD_TARGET_VS_READ);
    println!(
        "target overlap: background first token <= max(upload, prefill) + {OVERLAP_SHOWN:.2} x \
         min(upload, prefill), from the runtime's start (phases: the eager mode's)"
    );
    let overlaps: Vec<_> = rows
        .iter()
        .filter_map(|r| Some((r, overlap(rows, r)?)))
        .collect();
    if overlaps.is_empty() {
        println!("  not measured: needs --load-modes background,eager");
    }
    for (row, o) in overlaps {
        println!(
            "  {:<5} {:>6} tokens  first token {:.3} s, bound {:.3} s (upload {:.3}, prefill {:.3})  {}",
            row.cache,
            row.tokens,
            o.first_token_s,
            o.bound_s,
            o.upload_s,
            o.prefill_s,
            verdict(o.first_token_s <= o.bound_s)
        );
        if let Some(w) = o.within {
            println!(
                "  {:<5} {:>6} tokens  within each run (its own upload): first token less its bound, \
                 median {:+.1} ms (upload {:.3})  {}",
                row.cache,
                row.tokens,
                w.over_bound_s * 1e3,
                w.upload_s,
                verdict(w.over_bound_s <= 0.0)
            );
        }
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
                "token_s": row.runs.iter().map(|r| r.token_s).collect::<Vec<_>>(),
                "sees_tokens": row.sees_tokens(),
                "median_s": row.median_s(),
                "min_s": row.min_s(),
                "median_exit_s": row.median_exit_s(),
                "ratio_vs_llama": ratio(rows, row, false),
                "ratio_vs_read": ratio(rows, row, true),
                "overlap": overlap(rows, row).map(|o| json!({
                    "upload_s": o.upload_s,
                    "prefill_s": o.prefill_s,
                    "first_token_s": o.first_token_s,
                    "bound_s": o.bound_s,
                    "within_runs": o.within.map(|w| json!({
                        "upload_s": w.upload_s,
                        "over_bound_s": w.over_bound_s,
                    })),
                })),
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
            "overlap_shown": OVERLAP_SHOWN,
        },
        "rows": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row of runs whose first tokens came `seen` seconds before their exits (none
    /// seen where `seen` is `None`).
    fn row(cache: &'static str, engine: Engine, walls: &[f64], seen: Option<f64>) -> Row {
        let mut row = Row::new(cache, 8, &engine);
        for &wall in walls {
            let mut run = Run::new(wall, seen.map(|s| wall - s));
            run.parts.push(("first token", wall / 2.0));
            row.runs.push(run);
        }
        row
    }

    fn ours(mode: &str) -> Engine {
        Engine::Ours {
            load_mode: Some(mode.into()),
        }
    }

    #[test]
    fn medians_take_the_middle_or_the_mean_of_the_middle_two() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(Vec::new()).is_nan());
    }

    #[test]
    fn ratios_compare_first_tokens_where_both_saw_them_and_exits_otherwise() {
        let rows = [
            row("warm", ours("background"), &[1.5, 3.5, 2.5], Some(0.5)),
            row("warm", Engine::Llama, &[4.5, 4.5, 5.5], Some(0.5)),
            row("cold", Engine::FileRead, &[2.0, 2.0, 2.0], Some(0.0)),
            row("cold", ours("background"), &[2.3, 2.1, 2.5], Some(0.1)),
            row("cold", Engine::Llama, &[8.0, 8.0, 8.0], None),
        ];
        // First tokens: 2.0 against 4.0.
        assert_eq!(ratio(&rows, &rows[0], false), Some(0.5));
        assert_eq!(ratio(&rows, &rows[0], true), None);
        assert_eq!(ratio(&rows, &rows[1], false), None);
        // First tokens: 2.2 against the read's 2.0.
        assert!((ratio(&rows, &rows[3], true).unwrap() - 1.1).abs() < 1e-12);
        // llama.cpp's first token unseen: exits, 2.3 against 8.0.
        assert!((ratio(&rows, &rows[3], false).unwrap() - 2.3 / 8.0).abs() < 1e-12);
        assert!(!rows[4].sees_tokens());
        assert_eq!((rows[4].median_s(), rows[4].min_s()), (8.0, 8.0));
        assert_eq!(rows[0].parts(), [("first token", 1.25)]);
        assert_eq!((rows[0].min_s(), rows[0].median_exit_s()), (1.0, 2.5));
        let header = Header {
            file: Path::new("m.gguf"),
            file_bytes: 1,
            device: "gpu",
            runs: 3,
            commands: Vec::new(),
            cold_skipped: None,
        };
        let doc = to_json(&header, &rows);
        assert!((doc["rows"][3]["ratio_vs_read"].as_f64().unwrap() - 1.1).abs() < 1e-12);
        assert_eq!(doc["rows"][0]["wall_s"], json!([1.5, 3.5, 2.5]));
        assert_eq!(doc["rows"][0]["token_s"], json!([1.0, 3.0, 2.0]));
        assert_eq!(doc["rows"][4]["token_s"], json!([null, null, null]));
    }

    #[test]
    fn the_overlap_bound_takes_the_eager_modes_phases() {
        let with_parts = |mode: &str, parts: &[(&'static str, f64)]| {
            let mut row = Row::new("cold", 2048, &ours(mode));
            let mut run = Run::new(3.0, Some(2.9));
            run.parts = parts.to_vec();
            row.runs.push(run);
            row
        };
        let eager = || {
            with_parts(
                "eager",
                &[
                    ("runtime", 0.2),
                    ("upload", 2.3),
                    ("prefill", 2.0),
                    ("first token", 2.5),
                ],
            )
        };
        let background = with_parts("background", &[("runtime", 0.2), ("first token", 2.4)]);
        let rows = [background, eager()];
        // Upload 2.1 s, prefill 0.5 s: bound 2.1 + 0.5 / 4.
        let o = overlap(&rows, &rows[0]).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(o.upload_s, 2.1) && close(o.prefill_s, 0.5), "{o:?}");
        assert!(
            close(o.first_token_s, 2.2) && close(o.bound_s, 2.225),
            "{o:?}"
        );
        // Runs that do not say when they had their weights: no bound within them.
        assert_eq!(o.within, None);
        assert_eq!(overlap(&rows, &rows[1]), None);
        // Without the eager row, or on another prompt, there is no bound.
        assert_eq!(overlap(&rows[..1], &rows[0]), None);
        let mut other = with_parts("eager", &[("runtime", 0.2), ("upload", 2.3)]);
        other.tokens = 8;
        let rows = [with_parts("background", &[("first token", 2.4)]), other];
        assert_eq!(overlap(&rows, &rows[0]), None);
        // Within runs: own uploads 1.8, 2.3 and 2.0 s against prefill 0.5 s give bounds
        // 1.925, 2.425 and 2.125 s; first tokens 2.2, 2.3 and 2.1 s are 0.275 over,
        // 0.125 under and 0.025 under: the median is 0.025 under.
        let mut background = with_parts("background", &[]);
        background.runs.clear();
        for (weights, token) in [(2.0, 2.4), (2.5, 2.5), (2.2, 2.3)] {
            let mut run = Run::new(3.0, Some(token));
            run.parts = vec![
                ("runtime", 0.2),
                ("weights", weights),
                ("first token", token),
            ];
            background.runs.push(run);
        }
        let rows = [background, eager()];
        let w = overlap(&rows, &rows[0]).unwrap().within.unwrap();
        assert!(
            close(w.upload_s, 2.0) && close(w.over_bound_s, -0.025),
            "{w:?}"
        );
    }
}
