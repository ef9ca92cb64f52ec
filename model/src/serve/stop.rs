//! Stop strings over streamed text: text is released only once it cannot be the start
//! of a stop string, so a stop string is never split across two pieces and never shown.

/// Watches generated text for any of a request's stop strings.
#[derive(Debug, Default)]
pub(crate) struct StopMatcher {
    stops: Vec<String>,
    /// Text received but not yet released.
    held: String,
}

/// What a piece of text led to.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum StopCheck {
    /// Text that is safe to release (may be empty).
    Go(String),
    /// A stop string was found: the text before it, and generation ends.
    Stop(String),
}

impl StopMatcher {
    pub(crate) fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    pub(crate) fn push(&mut self, piece: &str) -> StopCheck {
        self.held.push_str(piece);
        if self.stops.is_empty() {
            return StopCheck::Go(std::mem::take(&mut self.held));
        }
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first {
            let mut text = std::mem::take(&mut self.held);
            text.truncate(at);
            return StopCheck::Stop(text);
        }
        // Hold back the longest tail that could still grow into a stop string.
        let keep = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.held, s))
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let rest = self.held.split_off(cut);
        StopCheck::Go(std::mem::replace(&mut self.held, rest))
    }

    /// The text still held when generation ends for another reason.
    pub(crate) fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

/// The length of the longest proper prefix of `stop` that `text` ends with, at a
/// character boundary of `text`.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = stop.len().saturating_sub(1).min(text.len());
    (1..=max)
        .rev()
        .find(|&n| {
            let start = text.len() - n;
            text.is_char_boundary(start) && stop.as_bytes().starts_with(&text.as_bytes()[start..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_string_split_over_pieces_is_held_then_cut() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("hello E"), StopCheck::Go("hello ".into()));
        assert_eq!(m.push("N"), StopCheck::Go(String::new()));
        assert_eq!(m.push("D and more"), StopCheck::Stop(String::new()));
    }

    #[test]
    fn held_text_is_released_when_it_stops_matching() {
        let mut m = StopMatcher::new(vec!["END".into(), "\n\n".into()]);
        assert_eq!(m.push("a E"), StopCheck::Go("a ".into()));
        assert_eq!(m.push("x\n"), StopCheck::Go("Ex".into()));
        assert_eq!(m.push("y"), StopCheck::Go("\ny".into()));
        assert_eq!(m.push("z\n"), StopCheck::Go("z".into()));
        assert_eq!(m.finish(), "\n");
    }

    #[test]
    fn the_earliest_stop_wins_and_no_stops_pass_everything() {
        let mut m = StopMatcher::new(vec!["cd".into(), "b".into()]);
        assert_eq!(m.push("abcd"), StopCheck::Stop("a".into()));
        let mut m = StopMatcher::new(vec![String::new()]);
        assert_eq!(m.push("éa"), StopCheck::Go("éa".into()));
    }

    #[test]
    fn multibyte_text_is_cut_at_character_boundaries() {
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("aé"), StopCheck::Go("a".into()));
        assert_eq!(m.push("é"), StopCheck::Go("é".into()));
        assert_eq!(m.push("!"), StopCheck::Stop(String::new()));
    }
}
