//! Holding back a streamed answer that may be bare tool calls.
//!
//! Llama 3.1 (and models fine-tuned on its way) calls a tool by answering with the bare
//! JSON object — `{"name": …, "parameters": …}` — with no tag before it; Mistral's list
//! of calls reads the same once decoding drops its special `[TOOL_CALLS]`, and
//! Phi-4-mini's opens with the plain word `functools[`. A stream that showed that text as
//! it came could not take it back once the whole answer reads as calls. So, when the
//! model may call tools of its own accord, the first pieces are held until the answer's
//! start says what it is ([`may_open_bare_calls`]): `{`, `[`, `functools` or a declared
//! tool's name followed by its arguments (Mistral's newer calls read `name{…}`) holds
//! the whole answer (it is read as calls, or released as text, when it ends); anything
//! else releases what was held and streams the rest as it comes.

use tuneq_serve::Piece;
use tuneq_serve::tool_calls::may_open_bare_calls;

/// Where an answer's stream stands.
#[derive(Debug)]
enum State {
    /// Pieces go out as they come.
    Streaming,
    /// Nothing visible yet: the pieces so far are held.
    Deciding(Vec<Piece>),
    /// The answer began as bare calls may: everything is held until it ends.
    Holding(Vec<Piece>),
}

/// Holds back the pieces of an answer that may be a bare tool call.
#[derive(Debug)]
pub(super) struct BareCallHold {
    state: State,
    /// The tools the request declared.
    declared: Vec<String>,
}

impl BareCallHold {
    /// A hold for an answer that may be a bare call of one of `declared` (None: it may
    /// not, and pieces pass).
    pub(super) fn new(declared: Option<Vec<String>>) -> Self {
        Self {
            state: match declared {
                Some(_) => State::Deciding(Vec::new()),
                None => State::Streaming,
            },
            declared: declared.unwrap_or_default(),
        }
    }

    /// Takes the next piece; returns the pieces to stream now, in order.
    pub(super) fn push(&mut self, piece: Piece) -> Vec<Piece> {
        match &mut self.state {
            State::Streaming => vec![piece],
            State::Holding(held) => {
                held.push(piece);
                Vec::new()
            }
            State::Deciding(held) => {
                held.push(piece);
                let start: String = held.iter().map(|p| p.text.as_str()).collect();
                match may_open_bare_calls(&start, &self.declared) {
                    None => Vec::new(),
                    Some(true) => {
                        self.state = State::Holding(std::mem::take(held));
                        Vec::new()
                    }
                    Some(false) => std::mem::replace(&mut self.state, State::Streaming).into_held(),
                }
            }
        }
    }

    /// The answer ended: the pieces still held, to stream unless it read as a call.
    pub(super) fn release(self) -> Vec<Piece> {
        self.state.into_held()
    }
}

impl State {
    fn into_held(self) -> Vec<Piece> {
        match self {
            State::Streaming => Vec::new(),
            State::Deciding(held) | State::Holding(held) => held,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(text: &str) -> Piece {
        Piece {
            text: text.into(),
            logprobs: Vec::new(),
        }
    }

    fn texts(pieces: &[Piece]) -> Vec<&str> {
        pieces.iter().map(|p| p.text.as_str()).collect()
    }

    #[test]
    fn text_that_starts_with_a_word_streams_from_its_first_visible_piece() {
        let mut hold = BareCallHold::new(Some(vec!["search".into()]));
        assert!(hold.push(piece(" ")).is_empty());
        assert_eq!(texts(&hold.push(piece("\nIt"))), [" ", "\nIt"]);
        assert_eq!(texts(&hold.push(piece(" rains"))), [" rains"]);
        assert!(hold.release().is_empty());
    }

    #[test]
    fn an_answer_that_opens_a_brace_is_held_to_the_end() {
        let mut hold = BareCallHold::new(Some(vec!["search".into()]));
        for text in [" {", "\"name\"", ": \"search\"}"] {
            assert!(hold.push(piece(text)).is_empty());
        }
        assert_eq!(texts(&hold.release()), [" {", "\"name\"", ": \"search\"}"]);
    }

    #[test]
    fn lists_of_calls_are_held_and_a_word_like_their_opening_is_released() {
        let mut hold = BareCallHold::new(Some(vec!["search".into()]));
        for text in ["func", "tools", "[{\"name\""] {
            assert!(hold.push(piece(text)).is_empty());
        }
        assert_eq!(texts(&hold.release()), ["func", "tools", "[{\"name\""]);
        let mut hold = BareCallHold::new(Some(vec!["search".into()]));
        assert!(hold.push(piece(" [")).is_empty());
        assert_eq!(texts(&hold.release()), [" ["]);
        let mut hold = BareCallHold::new(Some(vec!["search".into()]));
        assert!(hold.push(piece("fun")).is_empty());
        assert_eq!(texts(&hold.push(piece(" fact"))), ["fun", " fact"]);
    }

    #[test]
    fn an_answer_that_cannot_call_passes_straight_through() {
        let mut hold = BareCallHold::new(None);
        assert_eq!(texts(&hold.push(piece("{"))), ["{"]);
        assert!(hold.release().is_empty());
    }

    #[test]
    fn an_empty_answer_releases_its_silent_pieces_at_the_end() {
        let mut hold = BareCallHold::new(Some(vec!["search".into()]));
        assert!(hold.push(piece("")).is_empty());
        assert_eq!(texts(&hold.release()), [""]);
    }
}
