//! From generated ids to the text a client sees, piece by piece.
//!
//! [`Detokenizer`] turns ids into text as they come: a token may be half of a character
//! (byte-level vocabularies) or change how the one before it is spaced, so each new
//! piece is the difference between decoding a short window with and without the newest
//! ids, held back while it ends in an incomplete character.
//!
//! [`StopText`] watches that text for the request's `stop` strings and for markers that
//! end the plain-text part of an answer (`<tool_call>`): text that could be the start of
//! one is held back until it is known not to be, so a stream never shows a client what
//! the whole answer leaves out.

use tuneq_dataset::{Encoder, common_prefix};

/// Decodes ids incrementally.
#[derive(Debug, Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    /// Where the window decoded for comparison starts.
    prefix: usize,
    /// The ids already turned into text.
    read: usize,
}

impl Detokenizer {
    /// Adds `id`; returns the text it completes (empty while a character is unfinished).
    pub fn push(&mut self, encoder: &Encoder, id: u32) -> tuneq_dataset::Result<String> {
        self.ids.push(id);
        let before = encoder.decode(&self.ids[self.prefix..self.read])?;
        let after = encoder.decode(&self.ids[self.prefix..])?;
        if after.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let piece = match after.get(before.len()..) {
            Some(piece) if after.starts_with(&before) => piece.to_string(),
            // The window decoded differently with the new ids (a tokenizer's cleanup):
            // show the new text after the common part.
            _ => {
                let common = common_prefix(&before, &after);
                after[common..].to_string()
            }
        };
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(piece)
    }
}

/// Why the text ended, when it did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextEnd {
    /// A `stop` string appeared; the text stops before it.
    Stop,
    /// A marker appeared (its index in the markers): the plain text stops before it and
    /// the rest is kept whole for the caller to read (tool calls).
    Marker(usize),
}

/// Watches generated text for stop strings and markers.
#[derive(Debug)]
pub struct StopText {
    stops: Vec<String>,
    markers: Vec<String>,
    /// Everything generated.
    text: String,
    /// Bytes of `text` already released.
    released: usize,
    /// Where the plain text ended, and why.
    end: Option<(usize, TextEnd)>,
}

impl StopText {
    /// A watcher for `stops` (the request's) and `markers` (where plain text ends).
    pub fn new(stops: Vec<String>, markers: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            markers: markers.into_iter().filter(|s| !s.is_empty()).collect(),
            text: String::new(),
            released: 0,
            end: None,
        }
    }

    /// Adds a piece of text; returns what may be shown now. After a stop string nothing
    /// more is shown; after a marker nothing more of the plain text is.
    pub fn push(&mut self, piece: &str) -> String {
        let searched_from = self.released;
        self.text.push_str(piece);
        if let Some((_, TextEnd::Stop)) = self.end {
            return String::new();
        }
        if self.end.is_none() {
            self.end = self.find_end(searched_from);
        }
        let upto = match &self.end {
            Some((at, _)) => *at,
            None => self.text.len() - self.held_back(),
        };
        let shown = self.text[self.released..upto.max(self.released)].to_string();
        self.released = upto.max(self.released);
        shown
    }

    /// What is left to show once generation ended without a stop or marker (the text
    /// held back as a possible beginning of one).
    pub fn finish(&mut self) -> String {
        if self.end.is_some() {
            return String::new();
        }
        let rest = self.text[self.released..].to_string();
        self.released = self.text.len();
        rest
    }

    /// Whether a stop string ended the text (before a marker or after one): generation
    /// ends there.
    pub fn stopped(&self) -> bool {
        match &self.end {
            Some((_, TextEnd::Stop)) => true,
            Some((at, TextEnd::Marker(_))) => {
                let rest = &self.text[*at..];
                self.stops.iter().any(|s| rest.contains(s.as_str()))
            }
            None => false,
        }
    }

    /// The plain text (up to a stop string or marker).
    pub fn plain(&self) -> &str {
        match &self.end {
            Some((at, _)) => &self.text[..*at],
            None => &self.text,
        }
    }

    /// The text from the marker on, when one appeared (a stop string after it cuts it).
    pub fn after_marker(&self) -> Option<&str> {
        match &self.end {
            Some((at, TextEnd::Marker(_))) => {
                let rest = &self.text[*at..];
                let cut = self
                    .stops
                    .iter()
                    .filter_map(|s| rest.find(s.as_str()))
                    .min()
                    .unwrap_or(rest.len());
                Some(&rest[..cut])
            }
            _ => None,
        }
    }

    /// The first stop string or marker at or after `from`. None can begin before it:
    /// text that could begin one is held back, never released.
    fn find_end(&self, from: usize) -> Option<(usize, TextEnd)> {
        let hay = &self.text[from..];
        let stop = self
            .stops
            .iter()
            .filter_map(|s| hay.find(s.as_str()))
            .min()
            .map(|at| (from + at, TextEnd::Stop));
        let marker = self
            .markers
            .iter()
            .enumerate()
            .filter_map(|(i, m)| {
                hay.find(m.as_str())
                    .map(|at| (from + at, TextEnd::Marker(i)))
            })
            .min_by_key(|(at, _)| *at);
        match (stop, marker) {
            (Some(s), Some(m)) => Some(if m.0 < s.0 { m } else { s }),
            (s, m) => s.or(m),
        }
    }

    /// Bytes at the end of the text that could begin a stop string or marker.
    fn held_back(&self) -> usize {
        let tail = &self.text[self.released..];
        let mut held = 0;
        for needle in self.stops.iter().chain(&self.markers) {
            for (start, _) in tail.char_indices() {
                let suffix = &tail[start..];
                if suffix.len() < needle.len() && needle.starts_with(suffix) {
                    held = held.max(suffix.len());
                    break;
                }
            }
        }
        held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(watch: &mut StopText, pieces: &[&str]) -> String {
        let mut shown: String = pieces.iter().map(|p| watch.push(p)).collect();
        shown.push_str(&watch.finish());
        shown
    }

    #[test]
    fn a_stop_string_split_over_pieces_is_never_shown() {
        let mut w = StopText::new(vec!["END".into()], vec![]);
        let mut shown = String::new();
        for piece in ["Hello E", "N", "D and more"] {
            shown.push_str(&w.push(piece));
            assert!(!shown.contains('E'), "{shown:?}");
        }
        assert_eq!(shown, "Hello ");
        assert!(w.stopped());
        assert_eq!(w.plain(), "Hello ");
    }

    #[test]
    fn a_false_start_is_released_once_it_is_known() {
        let mut w = StopText::new(vec!["END".into()], vec![]);
        assert_eq!(w.push("a E"), "a ");
        assert_eq!(w.push("x"), "Ex");
        assert_eq!(feed(&mut w, &["EN"]), "EN");
        assert!(!w.stopped());
    }

    #[test]
    fn a_marker_ends_the_plain_text_and_keeps_the_rest() {
        let mut w = StopText::new(vec![], vec!["<tool_call>".into()]);
        let shown = feed(
            &mut w,
            &["Sure. <tool", "_call>\n{\"name\": \"f\"}", "\n</tool_call>"],
        );
        assert_eq!(shown, "Sure. ");
        assert_eq!(w.plain(), "Sure. ");
        assert_eq!(
            w.after_marker(),
            Some("<tool_call>\n{\"name\": \"f\"}\n</tool_call>")
        );
        assert!(!w.stopped());
    }

    #[test]
    fn the_earliest_of_several_needles_wins() {
        let mut w = StopText::new(vec!["b".into(), "ab".into()], vec![]);
        assert_eq!(feed(&mut w, &["xxab"]), "xx");
        assert_eq!(w.plain(), "xx");
    }

    #[test]
    fn multibyte_text_is_held_back_at_character_boundaries() {
        let mut w = StopText::new(vec!["é!".into()], vec![]);
        assert_eq!(w.push("café"), "caf");
        assert_eq!(w.push("?"), "é?");
    }
}
