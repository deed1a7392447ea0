//! Property tests for the dataset parser: whatever bytes a user uploads, parsing returns
//! a result (never panics), and every reported problem points at a real line.

use proptest::prelude::*;
use tuneq_openapi::DatasetFormat;
use tuneq_trainer::data::{DataError, parse_jsonl};

/// Lines that are valid, nearly valid or plainly broken, in every format.
fn line() -> impl Strategy<Value = String> {
    let text = "[a-zA-Z0-9 \\n\"\\\\é😀{}]{0,12}";
    prop_oneof![
        (text, text).prop_map(|(u, a)| serde_json::json!({"messages": [
            {"role": "user", "content": u}, {"role": "assistant", "content": a}]})
        .to_string()),
        (text, text)
            .prop_map(|(p, c)| serde_json::json!({"prompt": p, "completion": c}).to_string()),
        (text, text)
            .prop_map(|(i, o)| serde_json::json!({"instruction": i, "output": o}).to_string()),
        text.prop_map(|t| serde_json::json!({"text": t}).to_string()),
        Just(r#"{"messages": [{"role": "wizard", "content": 5}]}"#.to_string()),
        Just(r#"{"messages": "nope"}"#.to_string()),
        Just("[1, 2, 3]".to_string()),
        Just(String::new()),
        any::<String>(),
        proptest::collection::vec(any::<u8>(), 0..40)
            .prop_map(|b| String::from_utf8_lossy(&b).into_owned()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn parsing_never_panics_and_errors_name_real_lines(lines in proptest::collection::vec(line(), 0..12), raw in any::<bool>()) {
        let body = lines.iter().map(|l| l.replace('\n', " ")).collect::<Vec<_>>().join("\n");
        let bytes = if raw { body.clone().into_bytes() } else { format!("{body}\n").into_bytes() };
        let line_count = body.split('\n').count();
        match parse_jsonl("upload.jsonl", &bytes, DatasetFormat::Auto) {
            Ok(parsed) => prop_assert!(parsed.records.len() <= line_count),
            Err(DataError::InvalidLines { errors, bad_lines, .. }) => {
                prop_assert!(!errors.is_empty());
                prop_assert!(bad_lines <= line_count);
                for e in errors {
                    prop_assert!(e.line >= 1 && e.line <= line_count, "line {} of {}", e.line, line_count);
                    prop_assert_eq!(e.file.as_str(), "upload.jsonl");
                }
            }
            Err(DataError::Empty { .. }) => {}
            Err(other) => prop_assert!(false, "unexpected error kind: {other}"),
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = parse_jsonl("bytes.jsonl", &bytes, DatasetFormat::Auto);
        let _ = parse_jsonl("bytes.jsonl", &bytes, DatasetFormat::Chat);
    }
}
