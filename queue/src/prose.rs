//! Messages are for people: what a job's events and errors say in words is rendering
//! only, never what any code decides on. Every message the queue stores passes through
//! [`said`], which can reword it, so the test suites prove that claim: run with
//! [`REWORD_ENV`]`=1`, every stored message is rewritten beyond recognition (reversed,
//! and marked), and the dispatch and placement tests must pass unchanged.

use std::sync::OnceLock;

/// Set to `1` (tests only) to store every message reworded.
pub const REWORD_ENV: &str = "TUNEQ_TEST_REWORD_MESSAGES";

/// The marker a reworded message starts with.
pub const REWORDED: &str = "[reworded] ";

/// `message` as the queue stores it: unchanged, or reworded under [`REWORD_ENV`].
pub(crate) fn said(message: &str) -> String {
    static REWORD: OnceLock<bool> = OnceLock::new();
    let reword = *REWORD.get_or_init(|| std::env::var(REWORD_ENV).is_ok_and(|v| v == "1"));
    if reword && !message.is_empty() {
        reworded(message)
    } else {
        message.to_string()
    }
}

/// `message` reversed and marked: nothing that looked for its words finds them.
fn reworded(message: &str) -> String {
    let mut text = String::from(REWORDED);
    text.extend(message.chars().rev());
    text
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_reworded_message_keeps_none_of_its_phrases() {
        let text = super::reworded("loss became NaN at step 3");
        assert!(!text.contains("loss became"));
        assert!(text.starts_with(super::REWORDED));
    }
}
