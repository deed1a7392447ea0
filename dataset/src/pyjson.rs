//! JSON written the way Python's `json.dumps` writes it, which is what transformers'
//! `tojson` filter calls when it renders a chat template: `", "` and `": "` between
//! items (`","` and a newline with `indent`), keys in the order given, non-ASCII kept,
//! and floats as Python's `repr` prints them (`1e-05`, `1e+16`, `2.0`). Chat templates
//! write tool schemas and tool-call arguments with it, so a model is trained on the
//! same text transformers would give it.

use serde_json::Value;
use std::fmt::Write;

/// `value` as `json.dumps(value, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`.
pub fn dumps(value: &Value, indent: Option<usize>, sort_keys: bool) -> String {
    let mut out = String::new();
    write_value(&mut out, value, indent, sort_keys, 0);
    out
}

fn write_value(out: &mut String, value: &Value, indent: Option<usize>, sort: bool, depth: usize) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => {
                let _ = write!(out, "{i}");
            }
            (None, Some(u), _) => {
                let _ = write!(out, "{u}");
            }
            (None, None, Some(f)) => out.push_str(&float_repr(f)),
            (None, None, None) => out.push_str(&n.to_string()),
        },
        // serde_json escapes exactly the characters Python does with ensure_ascii=False:
        // quote, backslash and the C0 controls (\b \f \n \r \t short, others \u00xx).
        Value::String(s) => out.push_str(&Value::String(s.clone()).to_string()),
        Value::Array(items) => {
            let items: Vec<&Value> = items.iter().collect();
            write_items(out, '[', ']', &items, indent, depth, |out, item, depth| {
                write_value(out, item, indent, sort, depth)
            });
        }
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            if sort {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            write_items(
                out,
                '{',
                '}',
                &entries,
                indent,
                depth,
                |out, (k, v), depth| {
                    out.push_str(&Value::String((*k).clone()).to_string());
                    out.push_str(": ");
                    write_value(out, v, indent, sort, depth);
                },
            );
        }
    }
}

/// A bracketed list of `items`, each written by `item`: on one line, or one per line
/// `indent` spaces deeper. Empty lists are `[]` / `{}` either way.
fn write_items<T>(
    out: &mut String,
    open: char,
    close: char,
    items: &[T],
    indent: Option<usize>,
    depth: usize,
    item: impl Fn(&mut String, &T, usize),
) {
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return;
    }
    for (i, it) in items.iter().enumerate() {
        match indent {
            Some(width) => {
                out.push_str(if i == 0 { "\n" } else { ",\n" });
                out.push_str(&" ".repeat(width * (depth + 1)));
            }
            None if i > 0 => out.push_str(", "),
            None => {}
        }
        item(out, it, depth + 1);
    }
    if let Some(width) = indent {
        out.push('\n');
        out.push_str(&" ".repeat(width * depth));
    }
    out.push(close);
}

/// Python's `repr` of a float: the shortest digits that read back the same, in fixed
/// notation for exponents from −4 to 15 (always with a fraction, `2.0`), otherwise as
/// `d.ddde±XX` with at least two exponent digits.
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    if f == 0.0 {
        return if f.is_sign_negative() { "-0.0" } else { "0.0" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits, like Python's repr.
    let sci = format!("{f:e}");
    let (mantissa, exponent) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let sign = if mantissa.starts_with('-') { "-" } else { "" };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if (-4..16).contains(&exponent) {
        let point = exponent + 1;
        let body = if point <= 0 {
            format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
        } else if point as usize >= digits.len() {
            format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            let (whole, fraction) = digits.split_at(point as usize);
            format!("{whole}.{fraction}")
        };
        format!("{sign}{body}")
    } else {
        let (first, rest) = digits.split_at(1);
        let mantissa = if rest.is_empty() {
            first.to_string()
        } else {
            format!("{first}.{rest}")
        };
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{exp_sign}{:02}", exponent.unsigned_abs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn floats_read_as_python_prints_them() {
        for (f, python) in [
            (1.0, "1.0"),
            (0.1, "0.1"),
            (-2.5, "-2.5"),
            (1e-5, "1e-05"),
            (0.0001, "0.0001"),
            (1.5e-7, "1.5e-07"),
            (1e16, "1e+16"),
            (1.5e300, "1.5e+300"),
            (2.5e-10, "2.5e-10"),
            (1e22, "1e+22"),
            (123456789012345.6, "123456789012345.6"),
            (1e15, "1000000000000000.0"),
            (0.0, "0.0"),
            (-0.0, "-0.0"),
        ] {
            assert_eq!(float_repr(f), python, "{f}");
        }
    }

    #[test]
    fn objects_keep_their_order_and_python_spacing() {
        let v: Value =
            serde_json::from_str(r#"{"z": 1, "a": [true, null, "é\n\"x\""], "m": {}, "f": 2.0}"#)
                .expect("JSON");
        assert_eq!(
            dumps(&v, None, false),
            r#"{"z": 1, "a": [true, null, "é\n\"x\""], "m": {}, "f": 2.0}"#
        );
        assert_eq!(
            dumps(&v, None, true),
            r#"{"a": [true, null, "é\n\"x\""], "f": 2.0, "m": {}, "z": 1}"#
        );
        assert_eq!(
            dumps(&json!({"a": [1, {"b": []}]}), Some(2), false),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": []\n    }\n  ]\n}"
        );
    }
}
