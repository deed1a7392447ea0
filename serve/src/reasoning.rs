//! An answer's reasoning block, kept apart from its content.
//!
//! Qwen3, QwQ and DeepSeek-R1 (and models fine-tuned from them on their own templates,
//! which train the last answer with its `<think>…</think>` block, empty or not) open an
//! answer with their reasoning. OpenAI's clients show `content` to people and send it
//! back in the next turn, so the block does not belong there: it is returned as
//! `reasoning_content` (the field DeepSeek's API and vLLM use), trimmed, and the content
//! starts after it with its leading whitespace dropped (as those templates write an
//! answer back). Only a model whose chat template writes the block
//! (`tuneq_dataset::ChatTemplate::writes_reasoning`) is read so; a block that never
//! closes (the answer was cut) is all reasoning.

use crate::generation::{Piece, TokenLogprob};

/// What opens a reasoning block.
const REASONING_OPEN: &str = tuneq_dataset::REASONING_BLOCK.0;
/// What closes it.
const REASONING_CLOSE: &str = tuneq_dataset::REASONING_BLOCK.1;

/// An answer's reasoning (None when it has no block, or an empty one) and its content.
pub fn split(text: &str) -> (Option<String>, &str) {
    let Some(inside) = text.trim_start().strip_prefix(REASONING_OPEN) else {
        return (None, text);
    };
    let (reasoning, content) = match inside.find(REASONING_CLOSE) {
        Some(at) => (&inside[..at], &inside[at + REASONING_CLOSE.len()..]),
        None => (inside, ""),
    };
    let reasoning = reasoning.trim();
    (
        (!reasoning.is_empty()).then(|| reasoning.to_string()),
        content.trim_start(),
    )
}

/// A piece of a streamed answer, told apart.
#[derive(Debug, Clone)]
pub enum Part {
    /// Reasoning text (with the log-probabilities of the tokens it took).
    Reasoning(Piece),
    /// Content.
    Content(Piece),
}

/// Where a streamed answer stands.
#[derive(Debug)]
enum Stage {
    /// Nothing visible yet; what came may still open a block.
    Opening(String),
    /// Inside the block: the text held back (whitespace, or what may begin the close).
    Thinking(String),
    /// After the block, before the content's first visible character.
    Closed,
    /// Content: pieces pass as they come.
    Content,
}

/// Tells a streamed answer's reasoning from its content, piece by piece, with the same
/// result as [`split`] of the whole: text is held only while it may still open or close
/// the block, or is whitespace at the reasoning's start or end.
#[derive(Debug)]
pub struct ReasoningStream {
    stage: Stage,
    /// Whether reasoning text went out yet (its leading whitespace is dropped).
    reasoned: bool,
    /// Log-probabilities of tokens whose text is held, for the next part that goes out.
    logprobs: Vec<TokenLogprob>,
}

impl ReasoningStream {
    /// A stream that looks for a block (`reads`), or passes every piece as content.
    pub fn new(reads: bool) -> Self {
        Self {
            stage: match reads {
                true => Stage::Opening(String::new()),
                false => Stage::Content,
            },
            reasoned: false,
            logprobs: Vec::new(),
        }
    }

    /// Takes the next piece; the parts to stream now, in order.
    pub fn push(&mut self, piece: Piece) -> Vec<Part> {
        if matches!(self.stage, Stage::Content) && self.logprobs.is_empty() {
            return vec![Part::Content(piece)];
        }
        self.logprobs.extend(piece.logprobs);
        let mut out = Vec::new();
        self.take(piece.text, &mut out);
        out
    }

    /// The answer ended: what is still held (text that only began to open the block as
    /// content, the end of a block that never closed as reasoning) and the
    /// log-probabilities of held tokens.
    pub fn finish(mut self) -> Vec<Part> {
        let mut out = Vec::new();
        match std::mem::replace(&mut self.stage, Stage::Content) {
            Stage::Opening(text) if !text.is_empty() => self.emit_content(text, &mut out),
            Stage::Thinking(held) => self.emit_reasoning(held.trim_end(), &mut out),
            _ => {}
        }
        if !self.logprobs.is_empty() {
            self.emit_content(String::new(), &mut out);
        }
        out
    }

    /// Moves `text` through the stages, writing what goes out to `out`.
    fn take(&mut self, text: String, out: &mut Vec<Part>) {
        match std::mem::replace(&mut self.stage, Stage::Content) {
            Stage::Opening(mut held) => {
                held.push_str(&text);
                let start = held.trim_start();
                if let Some(inside) = start.strip_prefix(REASONING_OPEN) {
                    let inside = inside.to_string();
                    self.stage = Stage::Thinking(String::new());
                    self.take(inside, out);
                } else if REASONING_OPEN.starts_with(start) {
                    self.stage = Stage::Opening(held);
                } else {
                    self.emit_content(held, out);
                }
            }
            Stage::Thinking(mut held) => {
                held.push_str(&text);
                if let Some(at) = held.find(REASONING_CLOSE) {
                    self.emit_reasoning(held[..at].trim_end(), out);
                    let after = held[at + REASONING_CLOSE.len()..].to_string();
                    self.stage = Stage::Closed;
                    self.take(after, out);
                } else {
                    let keep = held.len() - releasable(&held);
                    let released = held[..held.len() - keep].to_string();
                    self.emit_reasoning(&released, out);
                    self.stage = Stage::Thinking(held[held.len() - keep..].to_string());
                }
            }
            Stage::Closed => match text.trim_start() {
                "" => self.stage = Stage::Closed,
                visible => {
                    let visible = visible.to_string();
                    self.emit_content(visible, out);
                }
            },
            Stage::Content => self.emit_content(text, out),
        }
    }

    fn emit_reasoning(&mut self, text: &str, out: &mut Vec<Part>) {
        let text = match self.reasoned {
            true => text,
            false => text.trim_start(),
        };
        if text.is_empty() {
            return;
        }
        self.reasoned = true;
        out.push(Part::Reasoning(Piece {
            text: text.to_string(),
            logprobs: std::mem::take(&mut self.logprobs),
        }));
    }

    fn emit_content(&mut self, text: String, out: &mut Vec<Part>) {
        self.stage = Stage::Content;
        out.push(Part::Content(Piece {
            text,
            logprobs: std::mem::take(&mut self.logprobs),
        }));
    }
}

/// How much of reasoning text `held` may go out: all but its trailing whitespace (which
/// may end the reasoning) and an end that may begin the close.
fn releasable(held: &str) -> usize {
    let may_close = (1..REASONING_CLOSE.len())
        .rev()
        .find(|&n| held.ends_with(&REASONING_CLOSE[..n]))
        .unwrap_or(0);
    held[..held.len() - may_close].trim_end().len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(text: &str) -> Piece {
        Piece {
            text: text.into(),
            logprobs: vec![TokenLogprob {
                token: text.into(),
                logprob: -1.0,
                top: Vec::new(),
            }],
        }
    }

    /// The reasoning and content a stream of `pieces` shows, and the tokens it carried.
    fn streamed(reads: bool, pieces: &[&str]) -> (String, String, usize) {
        let mut stream = ReasoningStream::new(reads);
        let mut parts: Vec<Part> = pieces.iter().flat_map(|p| stream.push(piece(p))).collect();
        parts.extend(stream.finish());
        let (mut reasoning, mut content, mut tokens) = (String::new(), String::new(), 0);
        for part in parts {
            let (to, piece) = match part {
                Part::Reasoning(p) => (&mut reasoning, p),
                Part::Content(p) => (&mut content, p),
            };
            to.push_str(&piece.text);
            tokens += piece.logprobs.len();
        }
        (reasoning, content, tokens)
    }

    /// Every way of cutting `text` into two or three pieces streams as `split` reads it.
    fn agrees_with_split(text: &str) {
        let (reasoning, content) = split(text);
        let want = (reasoning.unwrap_or_default(), content.to_string());
        let cuts: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        for &a in &cuts {
            for &b in cuts.iter().filter(|&&b| b >= a) {
                let pieces = [&text[..a], &text[a..b], &text[b..]];
                let (r, c, tokens) = streamed(true, &pieces);
                assert_eq!((r, c), want, "{pieces:?}");
                assert_eq!(
                    tokens, 3,
                    "{pieces:?}: every token's log-probabilities go out"
                );
            }
        }
    }

    #[test]
    fn a_reasoning_block_is_kept_apart_from_the_content() {
        assert_eq!(
            split("<think>\nIt is 2.\n</think>\n\nTwo."),
            (Some("It is 2.".into()), "Two.")
        );
        assert_eq!(split("<think>\n\n</think>\n\nTwo."), (None, "Two."));
        assert_eq!(
            split("Two. <think>x</think>"),
            (None, "Two. <think>x</think>")
        );
        assert_eq!(split("<think>cut short"), (Some("cut short".into()), ""));
        assert_eq!(split("<thin"), (None, "<thin"));
    }

    #[test]
    fn a_stream_reads_as_the_whole_answer_does_however_it_is_cut() {
        for text in [
            "<think>\nIt is 2.\n</think>\n\nTwo.",
            "<think>\n\n</think>\n\nTwo.",
            "\n<think>a < b </th </think>  x\n",
            "Two. <think>x</think>",
            "<think>cut short",
            "<thin",
            "<think>é</think>ü",
            "",
        ] {
            agrees_with_split(text);
        }
    }

    #[test]
    fn reasoning_streams_as_it_comes() {
        let mut stream = ReasoningStream::new(true);
        assert!(stream.push(piece("<thi")).is_empty());
        assert!(stream.push(piece("nk>\n")).is_empty());
        let parts = stream.push(piece("Let me see"));
        assert!(
            matches!(&parts[..], [Part::Reasoning(p)] if p.text == "Let me see" && p.logprobs.len() == 3)
        );
        assert!(
            stream
                .push(piece(".\n</"))
                .iter()
                .all(|p| matches!(p, Part::Reasoning(_)))
        );
        let parts = stream.push(piece("think>\n\nYes"));
        assert!(matches!(&parts[..], [Part::Content(p)] if p.text == "Yes"));
        let parts = stream.push(piece("!"));
        assert!(matches!(&parts[..], [Part::Content(p)] if p.text == "!"));
    }

    #[test]
    fn a_model_that_does_not_reason_streams_untouched() {
        assert_eq!(
            streamed(false, &["<think>", "x</think>", " y"]),
            (String::new(), "<think>x</think> y".into(), 3)
        );
    }
}
