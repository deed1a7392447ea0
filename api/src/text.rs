//! Checks of the free text clients give us (display names, metadata): bounded, and
//! without the characters that hide or reorder what an operator reads in a listing or a
//! log — NUL and other controls, and Unicode's bidirectional overrides.

use crate::error::{ApiError, ApiResult, Code};
use crate::quote::is_bidi_control;

/// Refuses `text` (the field `param`) when it is empty, longer than `max_chars`, or
/// holds a control character (tab and newline too when `multiline` is false) or a bidi
/// control.
pub fn check(param: &str, text: &str, max_chars: usize, multiline: bool) -> ApiResult<()> {
    let count = text.chars().count();
    if count == 0 || count > max_chars {
        return Err(ApiError::invalid(
            param,
            Code::InvalidValue,
            format!("{param} must be 1 to {max_chars} characters."),
        ));
    }
    let allowed = |c: char| multiline && matches!(c, '\n' | '\t' | '\r');
    if let Some(bad) = text
        .chars()
        .find(|&c| (c.is_control() && !allowed(c)) || is_bidi_control(c))
    {
        return Err(ApiError::invalid(
            param,
            Code::InvalidValue,
            format!(
                "{param} must not contain control or bidirectional-override characters (found U+{:04X}).",
                u32::from(bad)
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_bidi_overrides_are_refused() {
        assert!(check("name", "Acme Research", 128, false).is_ok());
        assert!(check("name", "Ünïcödé 名前", 128, false).is_ok());
        for bad in ["", "a\0b", "evil\u{202E}txt.exe", "a\nb", "\u{2066}x"] {
            assert!(check("name", bad, 128, false).is_err(), "{bad:?}");
        }
        assert!(check("name", &"x".repeat(129), 128, false).is_err());
        assert!(check("value", "line one\nline two", 512, true).is_ok());
        assert!(check("value", "a\0b", 512, true).is_err());
    }
}
