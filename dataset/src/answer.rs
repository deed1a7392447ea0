//! Where an assistant turn's answer lies in a conversation's rendering.
//!
//! An answer is, by definition, what the conversation rendered through the turn
//! (`through`) adds to the conversation rendered up to it with the generation prompt
//! (`before`). Most templates are prefix-stable: both renderings are prefixes of the
//! whole conversation's text (`full`), and the answer lies where `through` says. Three
//! kinds of templates render an earlier turn otherwise once later messages follow, and
//! their answers are still located, each by a rule that can be checked on the renderings
//! alone (the reference tests apply the same rules to transformers' renderings):
//!
//! - a template that *closes* the conversation with text only its end keeps (Phi-3's
//!   write `eos_token` when no generation prompt follows): `through` ends with that
//!   closing where `full` goes on;
//! - a template that drops an earlier answer's *reasoning block* (Qwen3's and
//!   DeepSeek-R1's drop `<think>…</think>`, even an empty one, once a later user turn
//!   follows): the answer in `full` is `through`'s without it;
//! - a template that *moves* text to the last user turn (Mistral's write the system
//!   message and the tools into it only): `before` opens neither `through` nor `full`,
//!   but each holds, right where the two part, an end of `before`, and then the answer.
//!
//! Each answer is trained as the whole conversation renders it. Anything else (a template
//! that rewrites an earlier answer) is refused with the turn named.

use std::ops::Range;

use super::{DataError, Result};

/// What opens and closes a reasoning block (Qwen3's, QwQ's, DeepSeek-R1's), which such
/// templates drop from earlier answers and such models open an answer with.
pub const REASONING_BLOCK: (&str, &str) = ("<think>", "</think>");

/// Whitespace after a reasoning block whose every amount is tried as dropped (templates
/// write one or two newlines there); past it, only all of it.
const DROPPED_SPACES: usize = 16;

/// The renderings of one assistant turn, as [`answer_span`] takes them.
pub(crate) struct TurnRenderings<'a> {
    /// The whole conversation, without the generation prompt.
    pub full: &'a str,
    /// The conversation up to the turn, with the generation prompt.
    pub before: &'a str,
    /// The conversation through the turn, without the generation prompt.
    pub through: &'a str,
    /// What the template writes for a conversation of no messages ("" if nothing or an
    /// error).
    pub closing: &'a str,
}

/// The answer of assistant turn `i` within `full` (see the module's rules); None when
/// the turn is empty after trimming trailing whitespace.
pub(crate) fn answer_span(turn: &TurnRenderings, i: usize) -> Result<Option<Range<usize>>> {
    let TurnRenderings {
        full,
        before,
        through,
        closing,
    } = *turn;
    let Some((at, answer)) = answer_in_through(before, through) else {
        return Err(not_located(i));
    };
    let end_of = |start: usize, answer: &str| {
        let end = start + answer.trim_end().len();
        (end > start).then_some(start..end)
    };
    if full.starts_with(through) {
        return Ok(end_of(at, answer));
    }
    // Closed: the answer up to the closing, where `full` goes on without it.
    if let Some(open) = answer.strip_suffix(closing)
        && !closing.is_empty()
        && full.ends_with(closing)
        && full.starts_with(&through[..at])
        && full[at..].starts_with(open)
    {
        return Ok(end_of(at, open));
    }
    relocated(full, before, answer)
        .map(|(start, answer)| end_of(start, answer))
        .ok_or_else(|| not_located(i))
}

/// Where the answer starts in `through` and its text: what `through` adds to `before`,
/// or, where a template moves text out of the rendering up to the turn once the turn
/// follows (Mistral's system message, written only into a last user turn), what follows
/// the longest end of `before` that `through` holds right where the two part. None where
/// `through` holds none of it.
fn answer_in_through<'a>(before: &str, through: &'a str) -> Option<(usize, &'a str)> {
    if let Some(answer) = through.strip_prefix(before) {
        return Some((before.len(), answer));
    }
    let parted = common_prefix(before, through);
    let after = &through[parted..];
    let kept = overlaps(after, &before[parted..]).pop()?;
    Some((parted + kept, &after[kept..]))
}

/// The answer's start in `full` and the text it has there, for a template that drops a
/// reasoning block from earlier answers or moves text before them (module docs): the
/// first place after where `before` and `full` part at which `full` holds an end of
/// `before` and then the answer (or the answer without its reasoning block). None where
/// there is no such place. Linear in the texts' lengths for each form of the answer.
fn relocated<'a>(full: &str, before: &str, answer: &'a str) -> Option<(usize, &'a str)> {
    let parted = common_prefix(before, full);
    let rest_of_before = &before[parted..];
    let after = &full[parted..];
    // How much of `before`'s end `full` may hold where they part: none, or an overlap.
    let mut kept = vec![0];
    kept.extend(overlaps(after, rest_of_before));
    answer_forms(answer)
        .into_iter()
        .filter(|form| !form.trim().is_empty())
        .filter_map(|form| {
            let window = &after.as_bytes()[..after.len().min(rest_of_before.len() + form.len())];
            let starts = occurrences(window, form.as_bytes());
            first_in_both(&kept, &starts).map(|k| (parted + k, form))
        })
        .min_by_key(|&(start, _)| start)
}

/// The smallest value both ascending lists hold.
fn first_in_both(a: &[usize], b: &[usize]) -> Option<usize> {
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => return Some(a[i]),
        }
    }
    None
}

/// The lengths `k > 0`, shortest first, at which `a`'s first `k` bytes are `b`'s last
/// `k` (ending at a character boundary of `a`): Knuth–Morris–Pratt's failure function
/// of `a` run over the end of `b`, linear in their lengths.
fn overlaps(a: &str, b: &str) -> Vec<usize> {
    let m = a.len().min(b.len());
    if m == 0 {
        return Vec::new();
    }
    let pattern = &a.as_bytes()[..m];
    let failure = failure_function(pattern);
    let mut k = 0;
    for &byte in &b.as_bytes()[b.len() - m..] {
        k = step(pattern, &failure, k, byte);
    }
    let mut lengths = Vec::new();
    while k > 0 {
        if a.is_char_boundary(k) {
            lengths.push(k);
        }
        k = failure[k - 1];
    }
    lengths.reverse();
    lengths
}

/// Where `pattern` starts in `text`, overlapping occurrences included, in order:
/// Knuth–Morris–Pratt, linear in their lengths.
fn occurrences(text: &[u8], pattern: &[u8]) -> Vec<usize> {
    if pattern.is_empty() {
        return Vec::new();
    }
    let failure = failure_function(pattern);
    let mut k = 0;
    let mut starts = Vec::new();
    for (i, &byte) in text.iter().enumerate() {
        k = step(pattern, &failure, k, byte);
        if k == pattern.len() {
            starts.push(i + 1 - k);
        }
    }
    starts
}

/// The matcher's next state: the longest prefix of `pattern` that ends the text read so
/// far (`k` of it before `byte`).
fn step(pattern: &[u8], failure: &[usize], mut k: usize, byte: u8) -> usize {
    if k == pattern.len() {
        k = failure[k - 1];
    }
    while k > 0 && pattern[k] != byte {
        k = failure[k - 1];
    }
    if pattern[k] == byte { k + 1 } else { k }
}

/// For each prefix of `pattern`, the length of its longest proper prefix that is also
/// its suffix.
fn failure_function(pattern: &[u8]) -> Vec<usize> {
    let mut failure = vec![0; pattern.len()];
    let mut k = 0;
    for i in 1..pattern.len() {
        while k > 0 && pattern[i] != pattern[k] {
            k = failure[k - 1];
        }
        if pattern[i] == pattern[k] {
            k += 1;
        }
        failure[i] = k;
    }
    failure
}

/// The answer as rendered last, and without a reasoning block it opens with (and the
/// whitespace after it: each amount of its first [`DROPPED_SPACES`] characters, then
/// all of it): the forms an earlier answer may take in the whole conversation.
fn answer_forms(answer: &str) -> Vec<&str> {
    let (open, close) = REASONING_BLOCK;
    let mut forms = vec![answer];
    let opened = answer.trim_start();
    if let Some(inside) = opened.strip_prefix(open)
        && let Some(at) = inside.find(close)
    {
        let after = &inside[at + close.len()..];
        let whitespace = after.len() - after.trim_start().len();
        forms.extend(
            after
                .char_indices()
                .take_while(|(_, c)| c.is_whitespace())
                .take(DROPPED_SPACES)
                .map(|(k, _)| &after[k..])
                .chain([&after[whitespace..]]),
        );
    }
    forms
}

/// The length of the longest common prefix of `a` and `b`, at a character boundary.
pub fn common_prefix(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map_or(a.len().min(b.len()), |((i, _), _)| i)
}

fn not_located(i: usize) -> DataError {
    DataError::Template(format!(
        "the answer of message {i} cannot be located in the whole conversation's \
         rendering: the template renders it otherwise once later messages follow (not \
         by a closing, a dropped reasoning block or a moved system message); choose a \
         built-in template"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(full: &str, before: &str, through: &str, closing: &str) -> Option<String> {
        let turn = TurnRenderings {
            full,
            before,
            through,
            closing,
        };
        answer_span(&turn, 1)
            .expect("located")
            .map(|r| full[r].to_string())
    }

    #[test]
    fn a_prefix_stable_answer_is_what_through_adds() {
        assert_eq!(
            span(
                "U: hi\nA: yo\nU: x\nA: z\n",
                "U: hi\nA: ",
                "U: hi\nA: yo\n",
                ""
            )
            .as_deref(),
            Some("yo")
        );
        assert_eq!(span("U: hi\nA: \n", "U: hi\nA: ", "U: hi\nA: \n", ""), None);
    }

    #[test]
    fn a_closed_answer_ends_where_the_closing_starts() {
        let full = "<u>hi<e><a>yo<e><u>x<e><a>z<e></s>";
        assert_eq!(
            span(full, "<u>hi<e><a>", "<u>hi<e><a>yo<e></s>", "</s>").as_deref(),
            Some("yo<e>")
        );
    }

    #[test]
    fn an_earlier_answer_without_its_reasoning_block_is_found() {
        let full = "<u>hi<e><a>yo<e><u>x<e><a><think>\n\n</think>\n\nz<e>";
        let through = "<u>hi<e><a><think>\n\n</think>\n\nyo<e>";
        assert_eq!(
            span(full, "<u>hi<e><a>", through, "").as_deref(),
            Some("yo<e>")
        );
        // Some whitespace after the block kept: still found, as rendered.
        let full = "<u>hi<e><a>\nyo<e><u>x<e>";
        assert_eq!(
            span(full, "<u>hi<e><a>", through, "").as_deref(),
            Some("\nyo<e>")
        );
    }

    #[test]
    fn an_answer_after_a_moved_system_message_is_found() {
        // Mistral's: the system message goes into the last user turn.
        let full = "<s>[INST]hi[/INST]yo</s>[INST]sys\n\nx[/INST]z</s>";
        let before = "<s>[INST]sys\n\nhi[/INST]";
        let through = "<s>[INST]sys\n\nhi[/INST]yo</s>";
        assert_eq!(span(full, before, through, "").as_deref(), Some("yo</s>"));
        // The answer's text inside the moved user turn is not taken for it.
        let full = "<s>[INST]say yo</s>[/INST]yo</s>[INST]sys\n\nx[/INST]z</s>";
        let before = "<s>[INST]sys\n\nsay yo</s>[/INST]";
        let through = "<s>[INST]sys\n\nsay yo</s>[/INST]yo</s>";
        assert_eq!(span(full, before, through, "").as_deref(), Some("yo</s>"));
    }

    #[test]
    fn a_rewritten_answer_is_refused_naming_the_turn() {
        let refused = |full: &str, before: &str, through: &str| {
            let turn = TurnRenderings {
                full,
                before,
                through,
                closing: "",
            };
            answer_span(&turn, 3).expect_err("refused").to_string()
        };
        let e = refused("U: hi\nA: [hidden]\nU: x\n", "U: hi\nA: ", "U: hi\nA: yo\n");
        assert!(e.contains("message 3"), "{e}");
        // A reasoning block is dropped only from the answer's start.
        let e = refused(
            "U: hi\nA: yo\nU: x\n",
            "U: hi\nA: ",
            "U: hi\nA: yo<think>a</think>\n",
        );
        assert!(e.contains("message 3"), "{e}");
        // `through` must hold an end of `before`.
        let e = refused("U: hi\nA: yo\n", "U: hi\nA: ", "U: hi\nB> yo\n");
        assert!(e.contains("message 3"), "{e}");
    }

    /// The linear matchers agree with the definitions, on every pair of short strings
    /// over a small alphabet (where borders and overlapping matches abound).
    #[test]
    fn the_matchers_agree_with_their_definitions() {
        let words: Vec<String> = (0..4u32)
            .flat_map(|n| {
                (0..3u32.pow(n)).map(move |mut i| {
                    (0..n)
                        .map(|_| {
                            let c = ['a', 'b', 'é'][(i % 3) as usize];
                            i /= 3;
                            c
                        })
                        .collect()
                })
            })
            .collect();
        for a in &words {
            for b in &words {
                let naive: Vec<usize> = (1..=a.len().min(b.len()))
                    .filter(|&k| a.is_char_boundary(k) && b.ends_with(&a[..k]))
                    .collect();
                assert_eq!(overlaps(a, b), naive, "{a:?} {b:?}");
                let starts: Vec<usize> = (0..b.len())
                    .filter(|&i| !a.is_empty() && b.as_bytes()[i..].starts_with(a.as_bytes()))
                    .collect();
                assert_eq!(
                    occurrences(b.as_bytes(), a.as_bytes()),
                    starts,
                    "{a:?} {b:?}"
                );
            }
        }
    }

    /// A long system message moved to the last user turn: the answer after it is found
    /// (by linear matching: the window searched is as long as the moved text).
    #[test]
    fn an_answer_after_a_long_moved_text_is_found() {
        let system = "a".repeat(400_000);
        let full = "<s>[INST]hi[/INST]a</s>[INST]x[/INST]z</s>";
        let before = format!("<s>[INST]{system}hi[/INST]");
        let through = format!("<s>[INST]{system}hi[/INST]a</s>");
        assert_eq!(span(full, &before, &through, "").as_deref(), Some("a</s>"));
        let through = "<s>[INST]hi[/INST]a</s>";
        assert_eq!(span(full, &before, through, "").as_deref(), Some("a</s>"));
    }

    #[test]
    fn common_prefix_stops_at_a_character_boundary() {
        assert_eq!(common_prefix("abé", "abè"), 2);
        assert_eq!(common_prefix("ab", "abc"), 2);
    }
}
