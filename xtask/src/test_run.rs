//! `cargo xtask test`: the whole test suite, every target run even when one fails, and a
//! summary at the end that counts what passed, failed, was ignored, and was skipped.
//!
//! libtest has no "skipped" outcome: a test that needs a GPU and finds none passes after
//! writing `SKIPPED <test>: <reason>` to stderr. Those lines are counted here and taken
//! out of the passed count, so a run without a device does not look like a GPU run.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context, Result};

/// What the output of `cargo test` says.
#[derive(Debug, Default, PartialEq)]
pub struct Summary {
    /// Test targets that reported a result (unit tests, integration tests, doctests).
    pub targets: usize,
    pub passed: usize,
    pub failed: usize,
    pub ignored: usize,
    /// `(test, reason)` of every `SKIPPED` line, in order, each test once.
    pub skipped: Vec<(String, String)>,
    /// Names of the failed tests.
    pub failures: Vec<String>,
    /// Targets that failed to build or crashed (cargo's own `error:` lines).
    pub errors: Vec<String>,
}

impl Summary {
    /// Reads one line of output (either stream).
    pub fn line(&mut self, line: &str) {
        let trimmed = line.trim();
        if let Some(rest) = trimmed.strip_prefix("test result: ") {
            self.targets += 1;
            self.passed += count(rest, " passed");
            self.failed += count(rest, " failed");
            self.ignored += count(rest, " ignored");
        } else if let Some(rest) = trimmed.strip_prefix("SKIPPED ") {
            let (test, reason) = rest.split_once(": ").unwrap_or((rest, ""));
            let test = test.trim_end_matches(':');
            if !self.skipped.iter().any(|(t, _)| t == test) {
                self.skipped.push((test.to_owned(), reason.to_owned()));
            }
        } else if let Some(name) = trimmed
            .strip_prefix("test ")
            .and_then(|rest| rest.strip_suffix(" ... FAILED"))
        {
            self.failures.push(name.to_owned());
        } else if trimmed.starts_with("error:") || line.starts_with("    `") {
            self.errors.push(trimmed.to_owned());
        }
    }

    /// The lines printed at the end of the run.
    pub fn report(&self) -> String {
        let mut text = format!(
            "test summary: {} targets; {} passed, {} failed, {} ignored, {} skipped\n",
            self.targets,
            self.passed.saturating_sub(self.skipped.len()),
            self.failed,
            self.ignored,
            self.skipped.len(),
        );
        if !self.skipped.is_empty() {
            text.push_str("skipped for want of a device (libtest counts them as passed):\n");
            for (test, reason) in &self.skipped {
                text.push_str(&format!("  {test}: {reason}\n"));
            }
        }
        if !self.failures.is_empty() {
            text.push_str("failed:\n");
            for name in &self.failures {
                text.push_str(&format!("  {name}\n"));
            }
        }
        for error in &self.errors {
            text.push_str(&format!("{error}\n"));
        }
        text
    }
}

/// `N` from "... N passed; ...", 0 when absent.
fn count(result: &str, what: &str) -> usize {
    result
        .split(';')
        .find_map(|part| part.trim().strip_suffix(what.trim_start()))
        .and_then(|n| n.trim().rsplit(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// `cargo test --workspace --release --no-fail-fast [extra]`, its output shown as it
/// comes, then the summary; an error when anything failed.
pub fn run(extra: &[String]) -> Result<()> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut child = Command::new(cargo)
        .args(["test", "--workspace", "--release", "--no-fail-fast"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running cargo test")?;
    let summary = Arc::new(Mutex::new(Summary::default()));
    let stdout = child.stdout.take().context("cargo's stdout")?;
    let stderr = child.stderr.take().context("cargo's stderr")?;
    let out_summary = Arc::clone(&summary);
    let out = std::thread::spawn(move || tee(stdout, std::io::stdout(), &out_summary));
    tee(stderr, std::io::stderr(), &summary);
    let _ = out.join();
    let status = child.wait().context("waiting for cargo test")?;
    let summary = summary
        .lock()
        .map_err(|_| anyhow::anyhow!("a reader panicked"))?;
    eprint!("\n{}", summary.report());
    if !status.success() || summary.failed > 0 {
        bail!("cargo test failed ({status})");
    }
    if summary.targets == 0 {
        bail!("cargo test ran no test target");
    }
    Ok(())
}

/// Copies `from` to `to` line by line, feeding each line to the summary.
fn tee(from: impl Read, mut to: impl Write, summary: &Mutex<Summary>) {
    let mut reader = BufReader::new(from);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                // Losing the echo (a closed terminal) must not stop the counting.
                let _ = to.write_all(&line).and_then(|()| to.flush());
                if let Ok(mut s) = summary.lock() {
                    s.line(&String::from_utf8_lossy(&line));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_skips_and_failures_are_counted() {
        let mut s = Summary::default();
        for line in [
            "     Running unittests src/lib.rs (target/release/deps/dequant-1)",
            "SKIPPED every_vectors_type_decodes: built without GPU support",
            "SKIPPED every_vectors_type_decodes: built without GPU support",
            "test result: ok. 40 passed; 0 failed; 2 ignored; 0 measured; 0 filtered out; finished in 1.00s",
            "test forward::logits_match ... FAILED",
            "SKIPPED load_on_gpu: hipGetDeviceCount: no GPU device (hipErrorNoDevice, 100)",
            "test result: FAILED. 3 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out",
            "error: 1 target failed:",
            "    `-p model --test real_models`",
        ] {
            s.line(line);
        }
        assert_eq!((s.targets, s.passed, s.failed, s.ignored), (2, 43, 1, 2));
        assert_eq!(s.skipped.len(), 2);
        assert_eq!(s.failures, ["forward::logits_match"]);
        let report = s.report();
        assert!(
            report
                .starts_with("test summary: 2 targets; 41 passed, 1 failed, 2 ignored, 2 skipped"),
            "{report}"
        );
        assert!(
            report.contains("  load_on_gpu: hipGetDeviceCount"),
            "{report}"
        );
        assert!(report.contains("`-p model --test real_models`"), "{report}");
    }

    #[test]
    fn a_result_line_without_a_count_counts_zero() {
        assert_eq!(count("ok. 0 passed; 0 failed", " failed"), 0);
        assert_eq!(count("ok. 12 passed; 3 failed", " passed"), 12);
        assert_eq!(count("ok. 12 passed", " ignored"), 0);
    }
}
