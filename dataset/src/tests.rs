//! Tests of the data module: parsing, templates, label masks, the built tokenizer.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tuneq_openapi::{ChatTemplateChoice, DatasetFormat};

use super::*;

mod tools;

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/data")
}

/// The 4096-entry tokenizer, built once for all tests.
fn tiny_tokenizer() -> &'static tokenizers::Tokenizer {
    static TOKENIZER: OnceLock<tokenizers::Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| build_tokenizer(4096).expect("build 4096 tokenizer"))
}

fn encoder(choice: ChatTemplateChoice) -> Encoder {
    let template = ChatTemplate::builtin(choice, "<s>", "</s>").expect("builtin template");
    Encoder::new(tiny_tokenizer().clone(), template)
}

fn chat(pairs: &[(&str, &str)]) -> Record {
    let role = |r: &str| serde_json::from_value::<Role>(serde_json::json!(r)).expect("a role");
    Record::Chat {
        messages: pairs
            .iter()
            .map(|(r, c)| Message::new(role(r), *c))
            .collect(),
        tools: vec![],
    }
}

/// The text of the labelled tokens, special tokens kept, with `|` between separate runs.
fn labelled_text(enc: &Encoder, ex: &Example) -> String {
    let mut runs: Vec<Vec<u32>> = Vec::new();
    let mut prev_labelled = false;
    for (&id, &label) in ex.input_ids.iter().zip(&ex.labels) {
        let labelled = label != IGNORE_INDEX;
        if labelled {
            assert_eq!(
                label,
                i64::from(id),
                "labels are the ids themselves (unshifted)"
            );
            if !prev_labelled {
                runs.push(Vec::new());
            }
            runs.last_mut().expect("a run was pushed").push(id);
        }
        prev_labelled = labelled;
    }
    runs.iter()
        .map(|r| enc.tokenizer().decode(r, false).expect("decode"))
        .collect::<Vec<_>>()
        .join("|")
}

fn invalid_lines(err: DataError) -> (Vec<LineError>, usize, usize) {
    match err {
        DataError::InvalidLines {
            errors,
            bad_lines,
            total,
            ..
        } => (errors, bad_lines, total),
        other => panic!("expected InvalidLines, got {other:?}"),
    }
}

// ---------- JSONL parsing ----------

#[test]
fn detects_each_of_the_four_formats() {
    for (file, format, n) in [
        ("tiny-task-val.jsonl", DatasetFormat::Chat, 50),
        (
            "prompt-completion.jsonl",
            DatasetFormat::PromptCompletion,
            10,
        ),
        ("alpaca.jsonl", DatasetFormat::Alpaca, 8),
        ("text.jsonl", DatasetFormat::Text, 8),
    ] {
        let parsed = read_jsonl(&examples_dir().join(file), DatasetFormat::Auto).expect(file);
        assert_eq!(parsed.format, format, "{file}");
        assert_eq!(parsed.records.len(), n, "{file}");
        assert!(parsed.records.iter().all(|r| r.format() == format));
    }
}

#[test]
fn alpaca_input_is_optional() {
    let parsed = parse_jsonl(
        "a.jsonl",
        br#"{"instruction": "Say hi.", "output": "hi"}
{"instruction": "Add one.", "input": "41", "output": "42"}"#,
        DatasetFormat::Auto,
    )
    .expect("valid");
    assert_eq!(
        parsed.records[0],
        Record::Alpaca {
            instruction: "Say hi.".into(),
            input: String::new(),
            output: "hi".into()
        }
    );
}

#[test]
fn every_bad_line_is_reported_with_line_and_field() {
    let err = read_jsonl(&examples_dir().join("bad.jsonl"), DatasetFormat::Auto)
        .expect_err("bad.jsonl is invalid");
    assert!(err.to_string().contains("7 invalid line(s)"), "{err}");
    let (errors, bad_lines, total) = invalid_lines(err);
    let got: Vec<(usize, &str)> = errors.iter().map(|e| (e.line, e.field.as_str())).collect();
    assert_eq!(
        got,
        vec![
            (3, "messages[1].content"),
            (4, ""),
            (5, "messages[0].tool_call_id"),
            (6, "messages[0].content"),
            (7, "messages"),
            (8, ""),
            (9, "messages"),
        ],
        "{errors:#?}"
    );
    assert_eq!((bad_lines, total), (7, 7));
    assert_eq!(
        errors[0].message,
        "expected a string or an array of text parts, got number"
    );
    assert!(
        errors[1].message.starts_with("invalid JSON at column"),
        "{}",
        errors[1].message
    );
    assert_eq!(
        errors[2].message,
        "no earlier assistant message makes the call \"call_9\""
    );
    assert_eq!(errors[3].message, "missing");
    assert!(
        errors[4].message.contains("looks like prompt_completion"),
        "{}",
        errors[4].message
    );
    assert_eq!(errors[5].message, "expected a JSON object, got array");
    assert_eq!(errors[6].message, "needs at least one assistant message");
    assert!(errors.iter().all(|e| e.file.ends_with("bad.jsonl")));
}

#[test]
fn several_problems_on_one_line_are_all_listed() {
    let line = br#"{"messages": [{"role": "user", "content": 1, "colour": "x"}, {"role": "robot", "content": "y"}, {"role": "system", "content": "late"}]}"#;
    let (errors, bad_lines, total) =
        invalid_lines(parse_jsonl("m.jsonl", line, DatasetFormat::Chat).expect_err("invalid"));
    let fields: Vec<&str> = errors.iter().map(|e| e.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "messages[0].colour",
            "messages[0].content",
            "messages[1].role",
            "messages[2].role"
        ]
    );
    assert_eq!((bad_lines, total), (1, 4));
}

#[test]
fn chat_rules() {
    let cases: [(&str, &str, &str); 5] = [
        (r#"{"messages": []}"#, "messages", "must not be empty"),
        (
            r#"{"messages": {"role": "user"}}"#,
            "messages",
            "expected an array, got object",
        ),
        (
            r#"{"messages": ["hi"]}"#,
            "messages[0]",
            "expected an object, got string",
        ),
        (
            r#"{"messages": [{"role": "user", "content": "q", "weight": 0}, {"role": "assistant", "content": "a"}]}"#,
            "messages[0].weight",
            "only assistant messages have a weight",
        ),
        (
            r#"{"messages": [{"role": "user", "content": "q"}, {"role": 3, "content": "a"}]}"#,
            "messages[1].role",
            "expected a string, got number",
        ),
    ];
    for (line, field, message) in cases {
        let (errors, _, _) = invalid_lines(
            parse_jsonl("c.jsonl", line.as_bytes(), DatasetFormat::Chat).expect_err(line),
        );
        assert_eq!(
            (errors[0].field.as_str(), errors[0].message.as_str()),
            (field, message),
            "{line}"
        );
    }
}

#[test]
fn other_format_rules() {
    let cases = [
        (
            DatasetFormat::PromptCompletion,
            r#"{"prompt": "p", "completion": ""}"#,
            "completion",
            "must not be empty",
        ),
        (
            DatasetFormat::PromptCompletion,
            r#"{"prompt": 1, "completion": "c"}"#,
            "prompt",
            "expected a string, got number",
        ),
        (
            DatasetFormat::Alpaca,
            r#"{"instruction": "i", "input": 5, "output": "o"}"#,
            "input",
            "expected a string, got number",
        ),
        (
            DatasetFormat::Alpaca,
            r#"{"instruction": "i"}"#,
            "output",
            "missing",
        ),
        (
            DatasetFormat::Text,
            r#"{"text": ""}"#,
            "text",
            "must not be empty",
        ),
        (
            DatasetFormat::Text,
            r#"{"text": null}"#,
            "text",
            "expected a string, got null",
        ),
    ];
    for (format, line, field, message) in cases {
        let (errors, _, _) =
            invalid_lines(parse_jsonl("o.jsonl", line.as_bytes(), format).expect_err(line));
        assert_eq!(
            (errors[0].field.as_str(), errors[0].message.as_str()),
            (field, message),
            "{line}"
        );
    }
}

#[test]
fn blank_lines_crlf_and_bom_are_accepted() {
    let bytes = b"\xEF\xBB\xBF\n  \n{\"text\": \"a\"}\r\n\r\n\t\n{\"text\": \"b\"}\n\n";
    let parsed = parse_jsonl("t.jsonl", bytes, DatasetFormat::Auto).expect("valid");
    assert_eq!(
        parsed.records,
        vec![
            Record::Text { text: "a".into() },
            Record::Text { text: "b".into() }
        ]
    );
    // Line numbers still count the blank lines.
    let bytes = b"\n\n{\"text\": 1}\n";
    let (errors, _, _) =
        invalid_lines(parse_jsonl("t.jsonl", bytes, DatasetFormat::Auto).expect_err("bad"));
    assert_eq!(errors[0].line, 3);
}

#[test]
fn empty_and_unrecognised_files() {
    assert!(matches!(
        parse_jsonl("e.jsonl", b"\n \n", DatasetFormat::Auto),
        Err(DataError::Empty { .. })
    ));
    let (errors, _, _) = invalid_lines(
        parse_jsonl(
            "u.jsonl",
            br#"{"question": "q", "answer": "a"}"#,
            DatasetFormat::Auto,
        )
        .expect_err("unrecognised"),
    );
    assert!(
        errors[0].message.starts_with("unrecognised record"),
        "{}",
        errors[0].message
    );
}

#[test]
fn explicit_format_is_enforced() {
    let (errors, _, _) = invalid_lines(
        parse_jsonl("x.jsonl", br#"{"text": "hello"}"#, DatasetFormat::Chat).expect_err("mismatch"),
    );
    assert_eq!(errors[0].field, "messages");
    assert!(
        errors[0].message.contains("as requested"),
        "{}",
        errors[0].message
    );
}

#[test]
fn error_list_is_capped_but_counted() {
    let bytes = "{\"text\": 1}\n".repeat(MAX_REPORTED_ERRORS + 500);
    let (errors, bad_lines, total) = invalid_lines(
        parse_jsonl("big.jsonl", bytes.as_bytes(), DatasetFormat::Text).expect_err("bad"),
    );
    assert_eq!(errors.len(), MAX_REPORTED_ERRORS);
    assert_eq!(
        (bad_lines, total),
        (MAX_REPORTED_ERRORS + 500, MAX_REPORTED_ERRORS + 500)
    );
}

#[test]
fn missing_file_is_an_io_error() {
    let err = read_jsonl(Path::new("/nonexistent/x.jsonl"), DatasetFormat::Auto).expect_err("io");
    assert!(matches!(err, DataError::Io { .. }));
    assert!(!err.is_retryable());
}

// ---------- templates ----------

fn sample_conversation() -> Vec<Message> {
    vec![
        Message::new(Role::System, "Be brief."),
        Message::new(Role::User, "Capital of Zorbia?"),
        Message::new(Role::Assistant, "Velm"),
        Message::new(Role::User, "And Plovia?"),
        Message::new(Role::Assistant, "Hesk"),
    ]
}

#[test]
fn chatml_renders() {
    let t = ChatTemplate::builtin(ChatTemplateChoice::Chatml, "<s>", "</s>").expect("template");
    let msgs = sample_conversation();
    assert_eq!(
        t.render(&msgs[..3], false).expect("render"),
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCapital of Zorbia?<|im_end|>\n<|im_start|>assistant\nVelm<|im_end|>\n"
    );
    assert_eq!(
        t.render(&msgs[1..2], true).expect("render"),
        "<|im_start|>user\nCapital of Zorbia?<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn llama2_renders() {
    let t = ChatTemplate::builtin(ChatTemplateChoice::Llama2, "<s>", "</s>").expect("template");
    assert_eq!(
        t.render(&sample_conversation(), false).expect("render"),
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nCapital of Zorbia? [/INST] Velm </s><s>[INST] And Plovia? [/INST] Hesk </s>"
    );
    assert_eq!(
        t.render(&sample_conversation()[1..2], true)
            .expect("render"),
        "<s>[INST] Capital of Zorbia? [/INST]"
    );
}

#[test]
fn alpaca_renders() {
    let t = ChatTemplate::builtin(ChatTemplateChoice::Alpaca, "<s>", "</s>").expect("template");
    assert_eq!(
        t.render(&sample_conversation()[..3], true).expect("render"),
        "Be brief.\n\n### Instruction:\nCapital of Zorbia?\n\n### Response:\nVelm</s>\n\n### Response:\n"
    );
}

#[test]
fn hf_style_template_with_python_methods_and_raise_exception() {
    // Outputs checked against Python jinja2 with trim_blocks and lstrip_blocks, as
    // transformers compiles chat templates.
    let src = "{% for m in messages %}\n  {% if m['role'] not in ['user', 'assistant'] %}\n{{ raise_exception('bad role ' + m['role']) }}\n  {% endif %}\n{{ m['role'].upper() }}: {{ m['content'].strip() }}\n{% endfor %}";
    let t = ChatTemplate::from_jinja(src, "", "").expect("compile");
    assert_eq!(
        t.render(&[Message::new(Role::User, "  hi  ")], false)
            .expect("render"),
        "USER: hi\n",
        "trim_blocks and lstrip_blocks as in Hugging Face"
    );
    let err = t
        .render(&[Message::new(Role::System, "x")], false)
        .expect_err("raises");
    assert!(err.to_string().contains("bad role system"), "{err}");
}

#[test]
fn templates_write_todays_date_as_transformers_does() {
    // Llama 3.1 and 3.2 fall back to a fixed date where `strftime_now` is missing.
    let src = "{% if strftime_now is defined %}{{ strftime_now('%Y-%m-%d') }}{% else %}26 Jul 2024{% endif %}";
    let t = ChatTemplate::from_jinja(src, "", "").expect("compile");
    let before = crate::strftime::format_now("%Y-%m-%d").expect("date");
    let rendered = t
        .render(&[Message::new(Role::User, "hi")], false)
        .expect("render");
    let after = crate::strftime::format_now("%Y-%m-%d").expect("date");
    assert!(rendered == before || rendered == after, "{rendered}");
    let unknown = ChatTemplate::from_jinja("{{ strftime_now('%Q') }}", "", "").expect("compile");
    let err = unknown
        .render(&[Message::new(Role::User, "hi")], false)
        .expect_err("raises");
    assert!(err.to_string().contains("%Q"), "{err}");
}

#[test]
fn load_reads_tokenizer_config() {
    let dir = tempfile::tempdir().expect("tempdir");
    // No tokenizer_config.json: ChatML, empty special tokens.
    let t = ChatTemplate::load(dir.path(), ChatTemplateChoice::Model).expect("load");
    assert!(t.source().contains("<|im_start|>"));
    assert_eq!(t.eos_token(), "");

    // A list of named templates with AddedToken-style special tokens.
    let config = serde_json::json!({
        "bos_token": {"content": "<|begin|>", "special": true},
        "eos_token": "<|im_end|>",
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}"},
        ],
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).expect("write");
    let t = ChatTemplate::load(dir.path(), ChatTemplateChoice::Model).expect("load");
    assert_eq!((t.bos_token(), t.eos_token()), ("<|begin|>", "<|im_end|>"));
    assert_eq!(
        t.render(&[Message::new(Role::User, "x")], false)
            .expect("render"),
        "<|begin|>x<|im_end|>"
    );

    // A built-in choice ignores the model's template but keeps its tokens.
    let t = ChatTemplate::load(dir.path(), ChatTemplateChoice::Llama2).expect("load");
    assert_eq!(
        t.render(&[Message::new(Role::User, "x")], true)
            .expect("render"),
        "<|begin|>[INST] x [/INST]"
    );

    // A list without "default" is an error.
    let config = serde_json::json!({"chat_template": [{"name": "rag", "template": "x"}]});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).expect("write");
    assert!(matches!(
        ChatTemplate::load(dir.path(), ChatTemplateChoice::Model),
        Err(DataError::Template(_))
    ));
}

#[test]
fn bad_template_syntax_is_a_template_error() {
    assert!(matches!(
        ChatTemplate::from_jinja("{% for %}", "", ""),
        Err(DataError::Template(_))
    ));
}

// ---------- encoding and label masks ----------

#[test]
fn chat_labels_only_assistant_content_and_end_marker() {
    let enc = encoder(ChatTemplateChoice::Chatml);
    let record = chat(&[
        ("system", "Be brief."),
        ("user", "Capital of Zorbia?"),
        ("assistant", "Velm"),
    ]);
    let ex = enc.encode(&record, 512).expect("encode");
    assert_eq!(ex.input_ids.len(), ex.labels.len());
    assert_eq!(labelled_text(&enc, &ex), "Velm<|im_end|>");
    let text = enc
        .tokenizer()
        .decode(&ex.input_ids, false)
        .expect("decode");
    assert_eq!(
        text,
        enc.template()
            .render(&record_messages(&record), false)
            .expect("render")
    );
    // Special tokens are single ids.
    assert_eq!(ex.input_ids[0], 3, "<|im_start|> is id 3");
}

fn record_messages(record: &Record) -> Vec<Message> {
    match record {
        Record::Chat { messages, .. } => messages.clone(),
        _ => Vec::new(),
    }
}

#[test]
fn multi_turn_chat_labels_every_assistant_turn() {
    let record = Record::Chat {
        messages: sample_conversation(),
        tools: vec![],
    };
    let enc = encoder(ChatTemplateChoice::Chatml);
    assert_eq!(
        labelled_text(&enc, &enc.encode(&record, 512).expect("encode")),
        "Velm<|im_end|>|Hesk<|im_end|>"
    );
    let enc = encoder(ChatTemplateChoice::Llama2);
    assert_eq!(
        labelled_text(&enc, &enc.encode(&record, 512).expect("encode")),
        " Velm </s>| Hesk </s>"
    );
    let enc = encoder(ChatTemplateChoice::Alpaca);
    assert_eq!(
        labelled_text(&enc, &enc.encode(&record, 512).expect("encode")),
        "Velm</s>|Hesk</s>"
    );
}

/// Phi-3's template closes a conversation with `eos_token` once no generation prompt
/// follows: each earlier turn's rendering ends with it where the whole one goes on. The
/// answers are still located (the closing is the conversation's, trained with the last
/// one); a template that rewrites an earlier answer's own text is not.
#[test]
fn a_template_that_closes_the_conversation_labels_every_turn() {
    // Phi-3's, with the tiny tokenizer's own end-of-turn token for `<|end|>`.
    let phi3 = "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|im_end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|im_end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|im_end|>\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}";
    let record = Record::Chat {
        messages: sample_conversation(),
        tools: vec![],
    };
    let template = ChatTemplate::from_jinja(phi3, "<s>", "</s>").expect("compile");
    let enc = Encoder::new(tiny_tokenizer().clone(), template);
    let ex = enc.encode(&record, 512).expect("encode");
    let text = enc
        .tokenizer()
        .decode(&ex.input_ids, false)
        .expect("decode");
    assert!(text.ends_with("Hesk<|im_end|>\n</s>"), "{text}");
    assert_eq!(
        labelled_text(&enc, &ex),
        "Velm<|im_end|>|Hesk<|im_end|>\n</s>"
    );
    // An earlier turn rendered otherwise once later ones follow: refused.
    let rewrites = "{% for message in messages %}{% if message['role'] == 'assistant' and not loop.last %}{{ '[' + message['role'] + ']' }}{% else %}{{ message['role'] + ': ' + message['content'] + '\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}";
    let template = ChatTemplate::from_jinja(rewrites, "<s>", "</s>").expect("compile");
    let enc = Encoder::new(tiny_tokenizer().clone(), template);
    assert!(matches!(
        enc.encode(&record, 512),
        Err(DataError::Template(_))
    ));
}

#[test]
fn alpaca_records_become_a_chat() {
    let record = Record::Alpaca {
        instruction: "Add one.".into(),
        input: "41".into(),
        output: "42".into(),
    };
    let enc = encoder(ChatTemplateChoice::Alpaca);
    let ex = enc.encode(&record, 512).expect("encode");
    assert_eq!(
        enc.tokenizer()
            .decode(&ex.input_ids, false)
            .expect("decode"),
        "### Instruction:\nAdd one.\n\n### Input:\n41\n\n### Response:\n42</s>\n\n"
    );
    assert_eq!(labelled_text(&enc, &ex), "42</s>");
    let enc = encoder(ChatTemplateChoice::Chatml);
    let ex = enc.encode(&record, 512).expect("encode");
    assert!(
        enc.tokenizer()
            .decode(&ex.input_ids, false)
            .expect("decode")
            .contains("user\nAdd one.\n\n41<|im_end|>")
    );
    assert_eq!(labelled_text(&enc, &ex), "42<|im_end|>");
}

#[test]
fn prompt_completion_labels_completion_and_eos() {
    let enc = encoder(ChatTemplateChoice::Chatml);
    let record = Record::PromptCompletion {
        prompt: "Question: Next number after 41?\nAnswer:".into(),
        completion: " 42".into(),
    };
    let ex = enc.encode(&record, 512).expect("encode");
    assert_eq!(ex.input_ids[0], 1, "starts with <s>");
    assert_eq!(
        *ex.input_ids.last().expect("non-empty"),
        2,
        "ends with </s>"
    );
    assert_eq!(labelled_text(&enc, &ex), " 42</s>");
}

#[test]
fn text_labels_everything_but_the_first_token() {
    let enc = encoder(ChatTemplateChoice::Chatml);
    let ex = enc
        .encode(
            &Record::Text {
                text: "The quiet baker opens the shop.".into(),
            },
            512,
        )
        .expect("encode");
    assert_eq!(ex.labels[0], IGNORE_INDEX);
    assert_eq!(ex.input_ids[0], 1);
    assert!(
        ex.labels[1..]
            .iter()
            .zip(&ex.input_ids[1..])
            .all(|(&l, &id)| l == i64::from(id))
    );
    assert_eq!(ex.trained_tokens(), ex.input_ids.len() - 1);
}

#[test]
fn truncation_keeps_the_first_tokens() {
    let enc = encoder(ChatTemplateChoice::Chatml);
    let record = Record::Chat {
        messages: sample_conversation(),
        tools: vec![],
    };
    let full = enc.encode(&record, 10_000).expect("encode");
    let (cut, full_len) = enc.encode_with_length(&record, 7).expect("encode");
    assert_eq!(full_len, full.input_ids.len());
    assert_eq!(cut.input_ids, full.input_ids[..7]);
    assert_eq!(cut.labels, full.labels[..7]);
    assert_eq!(
        cut.trained_tokens(),
        0,
        "the answers were cut away; the example is still returned"
    );
    let (examples, truncated) = enc
        .encode_all(
            &[record.clone(), chat(&[("user", "q"), ("assistant", "a")])],
            20,
        )
        .expect("encode");
    assert_eq!(truncated, 1);
    let stats = token_stats(&examples, truncated);
    assert_eq!(stats.examples, 2);
    assert_eq!(stats.max_len, 20);
    assert_eq!(stats.truncated, 1);
    assert_eq!(
        stats.tokens,
        examples
            .iter()
            .map(|e| e.input_ids.len() as u64)
            .sum::<u64>()
    );
}

#[test]
fn token_stats_of_nothing() {
    let s = token_stats(&[], 0);
    assert_eq!(
        (s.examples, s.tokens, s.min_len, s.max_len, s.mean_len),
        (0, 0, 0, 0, 0.0)
    );
}

#[test]
fn sampling_prompts() {
    let enc = encoder(ChatTemplateChoice::Chatml);
    let (ids, prompt, reference) = enc
        .prompt_for_sampling(&Record::Chat {
            messages: sample_conversation(),
            tools: vec![],
        })
        .expect("prompt");
    assert!(
        prompt.ends_with("<|im_start|>user\nAnd Plovia?<|im_end|>\n<|im_start|>assistant\n"),
        "{prompt}"
    );
    assert_eq!(reference, "Hesk");
    assert_eq!(enc.tokenizer().decode(&ids, false).expect("decode"), prompt);

    let (_, prompt, reference) = enc
        .prompt_for_sampling(&Record::PromptCompletion {
            prompt: "P:".into(),
            completion: " c".into(),
        })
        .expect("prompt");
    assert_eq!((prompt.as_str(), reference.as_str()), ("<s>P:", " c"));

    let (_, prompt, reference) = enc
        .prompt_for_sampling(&Record::Text {
            text: "abcdé".into(),
        })
        .expect("prompt");
    assert_eq!((prompt.as_str(), reference.as_str()), ("<s>ab", "cdé"));

    let (_, prompt, reference) = enc
        .prompt_for_sampling(&Record::Alpaca {
            instruction: "I".into(),
            input: String::new(),
            output: "O".into(),
        })
        .expect("prompt");
    assert_eq!(
        (prompt.as_str(), reference.as_str()),
        (
            "<|im_start|>user\nI<|im_end|>\n<|im_start|>assistant\n",
            "O"
        )
    );
}

#[test]
fn special_token_ids() {
    let enc = encoder(ChatTemplateChoice::Chatml);
    assert_eq!(enc.bos_token_id(), Some(1));
    assert_eq!(enc.eos_token_id(), Some(2));
    assert_eq!(enc.stop_token_ids(), vec![2, 4]);
}

#[test]
fn encoder_from_model_dir() {
    let dir = tempfile::tempdir().expect("tempdir");
    tiny_tokenizer()
        .save(dir.path().join("tokenizer.json"), false)
        .expect("save");
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        tokenizer_config_json(64).to_string(),
    )
    .expect("write");
    let enc = Encoder::from_model_dir(dir.path(), ChatTemplateChoice::Model).expect("load");
    let ex = enc
        .encode(
            &chat(&[("user", "Next number after 41?"), ("assistant", "42")]),
            64,
        )
        .expect("encode");
    assert_eq!(labelled_text(&enc, &ex), "42<|im_end|>");
    assert!(matches!(
        Encoder::from_model_dir(Path::new("/nonexistent"), ChatTemplateChoice::Model),
        Err(DataError::Tokenizer(_))
    ));
}

#[test]
fn tiny_task_fits_in_64_tokens() {
    let enc = encoder(ChatTemplateChoice::Chatml);
    for file in ["tiny-task-train.jsonl", "tiny-task-val.jsonl"] {
        let parsed = read_jsonl(&examples_dir().join(file), DatasetFormat::Auto).expect(file);
        let (examples, truncated) = enc.encode_all(&parsed.records, 64).expect("encode");
        let stats = token_stats(&examples, truncated);
        assert_eq!(
            (stats.truncated, stats.unlabelled),
            (0, 0),
            "{file}: {stats:?}"
        );
    }
}

// ---------- the built tokenizer ----------

#[test]
fn built_tokenizer_has_exact_size_and_fixed_special_ids() {
    let tok = tiny_tokenizer();
    assert_eq!(tok.get_vocab_size(true), 4096);
    for (id, token) in SPECIAL_TOKENS.iter().enumerate() {
        assert_eq!(tok.token_to_id(token), Some(id as u32), "{token}");
    }
    let ids = tok
        .encode("<|im_start|>user\nhi<|im_end|></s>", false)
        .expect("encode");
    assert_eq!(ids.get_ids()[0], 3);
    assert!(ids.get_ids().ends_with(&[4, 2]));
}

#[test]
fn built_tokenizer_is_deterministic() {
    let a = build_tokenizer(4096)
        .expect("build")
        .to_string(false)
        .expect("json");
    let b = tiny_tokenizer().to_string(false).expect("json");
    assert_eq!(a, b);
}

#[test]
fn built_tokenizer_round_trips_text() {
    let tok = tiny_tokenizer();
    for text in [
        "The quiet baker opens the shop at 6:30, doesn't she?",
        "def add(a, b):\n    return a + b\n",
        "  leading and trailing spaces  ",
        "Ünïcödé and emoji 🙂 survive byte-level BPE.",
    ] {
        let enc = tok.encode(text, false).expect("encode");
        assert_eq!(tok.decode(enc.get_ids(), false).expect("decode"), text);
    }
    // English compresses: well under one token per character.
    let text = "Please check the weather before you visit the market in the morning.";
    let n = tok.encode(text, false).expect("encode").get_ids().len();
    assert!(n * 3 < text.len(), "{n} tokens for {} chars", text.len());
}

#[test]
fn too_small_vocab_is_refused() {
    assert!(matches!(build_tokenizer(100), Err(DataError::Tokenizer(_))));
    let t = build_tokenizer(262).expect("bytes only");
    assert_eq!(t.get_vocab_size(true), 262);
}

#[test]
fn tokenizer_files_are_written() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_tokenizer_files(dir.path(), 300, 128).expect("write");
    let tok = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).expect("load");
    assert_eq!(tok.get_vocab_size(true), 300);
    let config: serde_json::Value = serde_json::from_slice(
        &std::fs::read(dir.path().join("tokenizer_config.json")).expect("read"),
    )
    .expect("json");
    assert_eq!(config["chat_template"], CHATML_TEMPLATE);
    assert_eq!(config["model_max_length"], 128);
}

#[test]
fn built_tokenizer_32000_is_exact_and_deterministic() {
    let a = build_tokenizer(32000).expect("build");
    assert_eq!(a.get_vocab_size(true), 32000);
    let b = build_tokenizer(32000).expect("build");
    assert_eq!(
        a.to_string(false).expect("json"),
        b.to_string(false).expect("json")
    );
}

#[test]
fn encoder_can_be_shared_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Encoder>();
    assert_send_sync::<ChatTemplate>();
}
