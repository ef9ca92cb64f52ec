//! Prompt-processing progress on stderr, drawn from the events the forward pass emits
//! after each layer of a batch (`model::PROGRESS_TARGET`): a long prompt spends seconds in
//! every layer, and a silent minute looks like a hang.
//!
//! On a terminal the line appears once the prompt has taken [`QUIET`] and is erased when
//! the prompt is done, before the generated text; elsewhere nothing is drawn unless asked
//! (`--progress`), and then one line per update at most every second, never on stdout.

use std::io::{IsTerminal, Write};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Event, Subscriber};
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::{Context, Layer};

/// Prompts done sooner than this draw nothing on a terminal.
const QUIET: Duration = Duration::from_secs(1);

/// When to draw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Never.
    Off,
    /// On a terminal, for prompts that take longer than [`QUIET`].
    Terminal,
    /// Always (asked for): every layer on a terminal, a line a second elsewhere.
    Always,
}

impl Mode {
    /// `Always` when asked for, else `Terminal` when stderr is one, else `Off`.
    pub fn choose(asked: bool) -> Mode {
        if asked {
            Mode::Always
        } else if std::io::stderr().is_terminal() {
            Mode::Terminal
        } else {
            Mode::Off
        }
    }
}

/// The tracing layer that draws the progress.
pub struct PromptProgress {
    mode: Mode,
    terminal: bool,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// When the current prompt (or batch) started.
    start: Option<Instant>,
    last_drawn: Option<Instant>,
    /// A line is on the terminal and must be erased.
    drawn: bool,
}

/// The layer, filtered to the prompt span and the per-layer events.
pub fn layer<S>(mode: Mode) -> impl Layer<S>
where
    S: Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let filter = filter_fn(move |meta| {
        mode != Mode::Off
            && (meta.target() == model::PROGRESS_TARGET
                || (meta.is_span() && meta.name() == "prompt"))
    });
    PromptProgress {
        mode,
        terminal: std::io::stderr().is_terminal(),
        state: Mutex::new(State::default()),
    }
    .with_filter(filter)
}

/// The fields of a progress event.
#[derive(Default)]
struct Fields {
    layer: u64,
    layers: u64,
    tokens: u64,
}

impl Visit for Fields {
    fn record_u64(&mut self, field: &Field, value: u64) {
        match field.name() {
            "layer" => self.layer = value,
            "layers" => self.layers = value,
            "tokens" => self.tokens = value,
            _ => {}
        }
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.record_u64(field, u64::try_from(value).unwrap_or(0));
    }

    fn record_debug(&mut self, _field: &Field, _value: &dyn std::fmt::Debug) {}
}

impl<S: Subscriber> Layer<S> for PromptProgress {
    fn on_new_span(&self, _attrs: &Attributes<'_>, _id: &Id, _ctx: Context<'_, S>) {
        if let Ok(mut state) = self.state.lock() {
            *state = State {
                start: Some(Instant::now()),
                ..State::default()
            };
        }
    }

    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        event.record(&mut fields);
        if fields.layers == 0 {
            return;
        }
        let Ok(mut state) = self.state.lock() else {
            return;
        };
        let now = Instant::now();
        let start = *state.start.get_or_insert(now);
        let elapsed = now - start;
        let last = fields.layer >= fields.layers;
        let text = format!(
            "prompt: {} tokens, layer {}/{} ({:.0}%), {:.1} s",
            fields.tokens,
            fields.layer,
            fields.layers,
            100.0 * fields.layer as f64 / fields.layers as f64,
            elapsed.as_secs_f64(),
        );
        let mut err = std::io::stderr().lock();
        // A failed write to stderr only loses the progress line.
        if self.terminal && self.mode != Mode::Off {
            if last {
                if state.drawn {
                    let _ = write!(err, "\r\x1b[K");
                }
                *state = State::default();
            } else if self.mode == Mode::Always || elapsed >= QUIET {
                let due = state
                    .last_drawn
                    .is_none_or(|t| now - t >= Duration::from_millis(100));
                if due {
                    let _ = write!(err, "\r{text}\x1b[K");
                    state.last_drawn = Some(now);
                    state.drawn = true;
                }
            }
        } else if self.mode == Mode::Always {
            let due = state
                .last_drawn
                .is_none_or(|t| now - t >= Duration::from_secs(1));
            if due || last {
                let _ = writeln!(err, "{text}");
                state.last_drawn = Some(now);
            }
            if last {
                *state = State::default();
            }
        }
        let _ = err.flush();
    }
}
