//! Tests of the encoder's linear paths against their definitions: answer spans found a
//! message at a time against rendering every prefix, and the bounded measure of a
//! record against encoding it whole.

#![allow(clippy::unwrap_used)]

use std::sync::OnceLock;

use tuneq_openapi::ChatTemplateChoice;

use super::*;
use crate::template::{ALPACA_TEMPLATE, CHATML_TEMPLATE, LLAMA2_TEMPLATE};

fn tokenizer() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| crate::build_tokenizer(4096).unwrap())
}

/// A small deterministic generator (xorshift64*), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Content made of pieces that trip templates and trimming: whitespace, markers of the
/// templates themselves, non-ASCII text, and nothing at all.
fn content(rng: &mut Rng) -> String {
    const PIECES: [&str; 12] = [
        "",
        " ",
        "\n",
        "hello",
        "Velm is the capital",
        "<|im_end|>",
        "[/INST]",
        "### Response:\n",
        "</s>",
        "ünïcødé ✓",
        "\t \n",
        "42",
    ];
    let n = rng.below(4);
    (0..n).map(|_| PIECES[rng.below(PIECES.len())]).collect()
}

/// A conversation: mostly well-formed (optional system, then user/assistant turns), and
/// now and then any role anywhere, which some templates refuse.
fn conversation(rng: &mut Rng) -> (Vec<Message>, bool) {
    let well_formed = rng.below(5) != 0;
    let mut messages = Vec::new();
    if rng.below(3) == 0 {
        messages.push(Message::new(Role::System, content(rng)));
    }
    let turns = 1 + rng.below(12);
    for t in 0..turns {
        let role = if well_formed {
            if t % 2 == 0 {
                Role::User
            } else {
                Role::Assistant
            }
        } else {
            [Role::System, Role::User, Role::Assistant][rng.below(3)]
        };
        messages.push(Message::new(role, content(rng)));
    }
    (messages, well_formed)
}

fn templates() -> Vec<(&'static str, ChatTemplate)> {
    let mut all = Vec::new();
    for (bos, eos) in [("<s>", "</s>"), ("", "")] {
        for choice in [
            ChatTemplateChoice::Chatml,
            ChatTemplateChoice::Llama2,
            ChatTemplateChoice::Alpaca,
        ] {
            all.push(("builtin", ChatTemplate::builtin(choice, bos, eos).unwrap()));
        }
        // A model's own template that is a built-in word for word takes the same path.
        for source in [CHATML_TEMPLATE, LLAMA2_TEMPLATE, ALPACA_TEMPLATE] {
            all.push(("model", ChatTemplate::from_jinja(source, bos, eos).unwrap()));
        }
    }
    all
}

/// The oracle: the spans as encoding found them before, by rendering every prefix.
fn by_prefixes(enc: &Encoder, messages: &[Message]) -> Result<(String, Vec<Range<usize>>)> {
    let full = enc.template().render(messages, false)?;
    let spans = enc.spans_by_prefixes(&plain(messages), &full, usize::MAX)?;
    Ok((full, spans))
}

/// A conversation of `messages` and no tools.
fn plain(messages: &[Message]) -> Conversation {
    Conversation {
        messages: messages.to_vec(),
        tools: Vec::new(),
    }
}

#[test]
fn spans_found_a_message_at_a_time_equal_rendering_every_prefix() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let mut fast = 0;
    for (origin, template) in templates() {
        assert!(template.growth().is_some(), "{origin}: {template:?}");
        let enc = Encoder::new(tokenizer().clone(), template);
        for _ in 0..400 {
            let (messages, well_formed) = conversation(&mut rng);
            let expected = by_prefixes(&enc, &messages);
            let found = enc.chat_spans(&plain(&messages));
            match (&expected, &found) {
                (Ok(e), Ok(f)) => assert_eq!(e, f, "{origin} {:?}: {messages:?}", enc.template()),
                (Err(_), Err(_)) => {}
                _ => panic!(
                    "{origin} {:?}: {messages:?}: {expected:?} vs {found:?}",
                    enc.template()
                ),
            }
            // Well-formed conversations take the fast way, not the fallback.
            if well_formed {
                let growth = enc.template().growth().unwrap();
                assert!(
                    enc.spans_by_growth(&messages, growth).is_some(),
                    "{origin}: {messages:?}"
                );
                fast += 1;
            }
            // And the examples are the same, token for token.
            if let Ok((text, spans)) = expected {
                let record = Record::Chat {
                    messages: messages.clone(),
                    tools: vec![],
                };
                let encoding = enc.tokenizer().encode(text.as_str(), false).unwrap();
                let ids = encoding.get_ids();
                let oracle = label(
                    ids,
                    encoding.get_offsets(),
                    ids.len(),
                    &LossOn::Spans(spans),
                );
                assert_eq!(enc.encode(&record, usize::MAX).unwrap(), oracle);
            }
        }
    }
    assert!(fast > 1000, "{fast}");
}

/// A chat of `pairs` user/assistant turns after a system message.
fn long_chat(pairs: usize) -> Vec<Message> {
    let mut messages = vec![Message::new(Role::System, "Be brief.")];
    for i in 0..pairs {
        messages.push(Message::new(Role::User, format!("question {i}")));
        messages.push(Message::new(Role::Assistant, format!("answer {i}")));
    }
    messages
}

#[test]
fn a_chat_costs_template_work_linear_in_its_messages() {
    for choice in [
        ChatTemplateChoice::Chatml,
        ChatTemplateChoice::Llama2,
        ChatTemplateChoice::Alpaca,
    ] {
        let template = ChatTemplate::builtin(choice, "<s>", "</s>").unwrap();
        let enc = Encoder::new(tokenizer().clone(), template);
        for pairs in [1, 10, 100, 1000] {
            let record = Record::Chat {
                messages: long_chat(pairs),
                tools: vec![],
            };
            let messages = 2 * pairs as u64 + 1;
            let before = enc.template().rendered_messages();
            enc.encode(&record, 512).unwrap();
            let work = enc.template().rendered_messages() - before;
            // Each message once behind the context, once more in the whole conversation
            // (the check), plus the head: rendering every prefix costs about messages².
            assert!(work <= 4 * messages + 16, "{choice:?} {pairs}: {work}");
            let before = enc.template().rendered_messages();
            enc.measure(&record, 512).unwrap();
            let work = enc.template().rendered_messages() - before;
            assert!(work <= 4 * messages + 16, "{choice:?} {pairs}: {work}");
        }
    }
}

/// ChatML with a default system prompt when the conversation has none, as many models'
/// own templates have: not a built-in, so spans are found by rendering prefixes.
const MODEL_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

fn words(rng: &mut Rng, n: usize) -> String {
    const WORDS: [&str; 8] = [
        "the",
        "capital",
        "of",
        "Zorbia",
        "is",
        "Velm,",
        "ünïcødé",
        "\n",
    ];
    let mut text = String::new();
    for i in 0..n {
        if i > 0 {
            text.push(' ');
        }
        text.push_str(WORDS[rng.below(WORDS.len())]);
    }
    text
}

#[test]
fn measuring_keeps_what_encoding_keeps() {
    let mut rng = Rng(7);
    let mut encoders: Vec<Encoder> = templates()
        .into_iter()
        .take(3)
        .map(|(_, t)| Encoder::new(tokenizer().clone(), t))
        .collect();
    encoders.push(Encoder::new(
        tokenizer().clone(),
        ChatTemplate::from_jinja(MODEL_TEMPLATE, "<s>", "</s>").unwrap(),
    ));
    let mut truncated = 0;
    for enc in &encoders {
        for round in 0..10 {
            // From a few words to far past the window's first size.
            let size = [3, 50, 400, 3000, 20_000][round % 5];
            let records = [
                Record::Text {
                    text: words(&mut rng, size),
                },
                Record::PromptCompletion {
                    prompt: words(&mut rng, size),
                    completion: words(&mut rng, 5),
                },
                Record::Alpaca {
                    instruction: words(&mut rng, 3),
                    input: words(&mut rng, size),
                    output: words(&mut rng, 7),
                },
                Record::Chat {
                    messages: (0..1 + size / 20)
                        .map(|i| {
                            let role = if i % 2 == 0 {
                                Role::User
                            } else {
                                Role::Assistant
                            };
                            Message::new(role, words(&mut rng, 1 + i % 40))
                        })
                        .collect(),
                    tools: vec![],
                },
            ];
            for record in &records {
                for max_seq_len in [16, 512] {
                    let (example, full_len) = enc.encode_with_length(record, max_seq_len).unwrap();
                    let measured = enc.measure(record, max_seq_len).unwrap();
                    assert_eq!(measured.example, example, "{record:?}");
                    assert_eq!(measured.length.exceeds(max_seq_len), full_len > max_seq_len);
                    match measured.length {
                        Length::Exact(n) => assert_eq!(n, full_len),
                        Length::AtLeast(n) => {
                            assert!(n <= full_len && n > max_seq_len);
                            truncated += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(truncated > 20, "{truncated}");
}

#[test]
fn a_record_with_too_many_messages_is_refused_naming_the_field() {
    let messages: Vec<serde_json::Value> = long_chat(crate::MAX_MESSAGES / 2)
        .iter()
        .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
        .collect();
    let line = serde_json::json!({ "messages": messages }).to_string();
    let err = crate::parse_jsonl(
        "d.jsonl",
        line.as_bytes(),
        tuneq_openapi::DatasetFormat::Chat,
    )
    .unwrap_err();
    let DataError::InvalidLines { errors, .. } = err else {
        panic!("{err:?}")
    };
    assert_eq!(errors[0].line, 1);
    assert_eq!(errors[0].field, "messages");
    assert!(errors[0].message.contains("at most 2048"), "{errors:?}");
    // One fewer is fine.
    let messages: Vec<serde_json::Value> = long_chat(crate::MAX_MESSAGES / 2 - 1)
        .iter()
        .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
        .collect();
    let line = serde_json::json!({ "messages": messages }).to_string();
    crate::parse_jsonl(
        "d.jsonl",
        line.as_bytes(),
        tuneq_openapi::DatasetFormat::Chat,
    )
    .unwrap();
}
