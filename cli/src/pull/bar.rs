//! A download's progress on stderr: the share done, the bytes, the rate and the time
//! left, redrawn in place on a terminal, one line every few seconds elsewhere.

use std::io::Write;
use std::time::{Duration, Instant};

/// How a download's progress is shown.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressMode {
    /// Not at all.
    Off,
    /// A bar redrawn in place (stderr is a terminal).
    Terminal,
    /// A line every few seconds (asked for where stderr is not a terminal).
    Lines,
}

/// Redraws on a terminal at most this often.
const TERMINAL_EVERY: Duration = Duration::from_millis(100);
/// Prints a line elsewhere at most this often.
const LINES_EVERY: Duration = Duration::from_secs(2);
const WIDTH: usize = 24;

pub(super) struct Bar {
    mode: ProgressMode,
    label: String,
    /// Where this connection's bytes started (the rate counts only those).
    offset: u64,
    total: Option<u64>,
    started: Instant,
    last: Option<Instant>,
    done: u64,
    /// A line is on the terminal without its newline.
    open: bool,
}

impl Bar {
    pub(super) fn new(mode: ProgressMode, label: String) -> Bar {
        Bar {
            mode,
            label,
            offset: 0,
            total: None,
            started: Instant::now(),
            last: None,
            done: 0,
            open: false,
        }
    }

    /// A connection starts delivering at `offset` of `total` bytes.
    pub(super) fn start(&mut self, offset: u64, total: Option<u64>) {
        self.offset = offset;
        self.done = offset;
        self.total = total;
        self.started = Instant::now();
        self.last = None;
    }

    pub(super) fn update(&mut self, done: u64) {
        self.done = done;
        let every = match self.mode {
            ProgressMode::Off => return,
            ProgressMode::Terminal => TERMINAL_EVERY,
            ProgressMode::Lines => LINES_EVERY,
        };
        let now = Instant::now();
        if self.last.is_some_and(|t| now - t < every) {
            return;
        }
        self.last = Some(now);
        self.draw(now);
    }

    /// The last state drawn, and the line ended.
    pub(super) fn finish(&mut self) {
        if self.mode == ProgressMode::Off || self.last.is_none() {
            return;
        }
        self.draw(Instant::now());
        if self.open {
            // A failed write to stderr only loses the bar.
            let _ = writeln!(std::io::stderr());
            self.open = false;
        }
        self.last = None;
    }

    fn draw(&mut self, now: Instant) {
        let line = line(
            &self.label,
            self.done,
            self.total,
            self.done - self.offset,
            now - self.started,
        );
        let mut err = std::io::stderr().lock();
        if self.mode == ProgressMode::Terminal {
            let _ = write!(err, "\r{line}\x1b[K");
            self.open = true;
        } else {
            let _ = writeln!(err, "{line}");
        }
        let _ = err.flush();
    }
}

/// `NAME  45% [##########..........]  44.1/98.4 MB  12.3 MB/s  4 s left`.
fn line(label: &str, done: u64, total: Option<u64>, new: u64, elapsed: Duration) -> String {
    let mb = |b: u64| b as f64 / 1e6;
    let secs = elapsed.as_secs_f64();
    let rate = (secs > 0.0).then(|| new as f64 / secs);
    let rate_text = rate.map_or_else(String::new, |r| format!("  {:.1} MB/s", r / 1e6));
    match total {
        Some(total) if total > 0 => {
            let fraction = (done as f64 / total as f64).min(1.0);
            let filled = (fraction * WIDTH as f64).round() as usize;
            let left = match rate {
                Some(r) if r > 0.0 && done < total => {
                    format!("  {} left", duration((total - done) as f64 / r))
                }
                _ => String::new(),
            };
            format!(
                "{label} {:3.0}% [{}{}] {:.1}/{:.1} MB{rate_text}{left}",
                fraction * 100.0,
                "#".repeat(filled),
                ".".repeat(WIDTH - filled),
                mb(done),
                mb(total),
            )
        }
        _ => format!("{label} {:.1} MB{rate_text}", mb(done)),
    }
}

/// `4 s`, `3 min 05 s`, `1 h 02 min`.
fn duration(secs: f64) -> String {
    let s = secs.round() as u64;
    match s {
        0..=59 => format!("{s} s"),
        60..=3599 => format!("{} min {:02} s", s / 60, s % 60),
        _ => format!("{} h {:02} min", s / 3600, s % 3600 / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_says_share_bytes_rate_and_time_left() {
        let text = line(
            "m.gguf",
            50_000_000,
            Some(100_000_000),
            10_000_000,
            Duration::from_secs(1),
        );
        assert_eq!(
            text,
            "m.gguf  50% [############............] 50.0/100.0 MB  10.0 MB/s  5 s left"
        );
        let unknown = line("m.gguf", 2_500_000, None, 2_500_000, Duration::from_secs(1));
        assert_eq!(unknown, "m.gguf 2.5 MB  2.5 MB/s");
        assert_eq!(duration(185.0), "3 min 05 s");
        assert_eq!(duration(3720.0), "1 h 02 min");
    }
}
