//! How an error message quotes back a value a client sent: short, with the characters
//! that hide or reorder text escaped, so that an answer (or a log line) never carries the
//! whole input back or shows something other than what was sent.

/// Whether `c` reorders or hides text when displayed (bidi embeddings, overrides and
/// isolates, and the zero-width marks that steer them).
pub(crate) fn is_bidi_control(c: char) -> bool {
    matches!(
        c,
        '\u{200E}' | '\u{200F}' | '\u{061C}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}'
    )
}

/// Characters of a client's value repeated in an error message at most: enough to
/// recognise it, never the whole input back (a 100 000-character id).
pub const SHOWN_CHARS: usize = 64;

/// `value` (something a client sent) as an error message may repeat it: at most
/// [`SHOWN_CHARS`] characters, control and bidi characters escaped, and a number too long
/// to read (`1e308` printed as 309 digits) in scientific notation.
pub fn shown(value: &str) -> String {
    if value.len() > 16
        && let Ok(number) = value.parse::<f64>()
        && number.is_finite()
    {
        return format!("{number:e}");
    }
    let mut out = String::new();
    for (i, c) in value.chars().enumerate() {
        if i == SHOWN_CHARS {
            out.push('…');
            break;
        }
        if c.is_control() || is_bidi_control(c) {
            out.push_str(&format!("\\u{{{:04x}}}", u32::from(c)));
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_shown_short_and_readable() {
        assert_eq!(shown("gpt-4o-mini"), "gpt-4o-mini");
        let long = shown(&"m".repeat(100_000));
        assert_eq!(long.chars().count(), SHOWN_CHARS + 1);
        assert!(long.ends_with('…'));
        assert_eq!(shown(&format!("{}", 1e308)), "1e308");
        assert_eq!(shown("0.0002"), "0.0002");
        assert_eq!(shown("a\u{202E}b\n"), "a\\u{202e}b\\u{000a}");
    }
}
