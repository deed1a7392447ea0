//! OpenAI's chat shapes: tools, tool calls and results, weights, names, text parts and
//! the legacy functions, read from `examples/data/openai-tools.jsonl`, refused with the
//! field named when malformed, and rendered with and without a template that knows tools;
//! and preference pairs.

use super::*;
use serde_json::json;

fn openai_tools() -> Vec<Record> {
    read_jsonl(
        &examples_dir().join("openai-tools.jsonl"),
        DatasetFormat::Auto,
    )
    .expect("openai-tools.jsonl is valid")
    .records
}

fn messages_and_tools(record: &Record) -> (&[Message], &[serde_json::Value]) {
    match record {
        Record::Chat { messages, tools } => (messages, tools),
        other => panic!("not a chat: {other:?}"),
    }
}

/// The tools-aware ChatML template of `examples/templates`.
fn tools_template() -> ChatTemplate {
    let source = include_str!("../../../examples/templates/chatml-tools.jinja");
    ChatTemplate::from_jinja(source, "", "").expect("the template compiles")
}

#[test]
fn every_openai_shape_reads_into_one_chat_record() {
    let records = openai_tools();
    assert_eq!(records.len(), 10);
    // Tool calls with content absent and null; arguments parsed, in their order.
    let (messages, tools) = messages_and_tools(&records[0]);
    assert_eq!(tools.len(), 1);
    assert_eq!(messages[2].content, None);
    let call = &messages[2].tool_calls[0];
    assert_eq!(
        (call.id.as_str(), call.function.name.as_str()),
        ("call_1", "get_weather")
    );
    assert_eq!(
        serde_json::to_string(&call.function.arguments).expect("JSON"),
        r#"{"city":"Paris","unit":"celsius"}"#
    );
    assert_eq!(messages[3].role, Role::Tool);
    assert_eq!(messages[3].tool_call_id.as_deref(), Some("call_1"));
    let (messages, _) = messages_and_tools(&records[1]);
    assert_eq!(messages[1].tool_calls.len(), 2);
    // No user turn; weights.
    let (messages, _) = messages_and_tools(&records[3]);
    assert_eq!(
        messages.iter().map(|m| m.role).collect::<Vec<_>>(),
        [Role::System, Role::Assistant]
    );
    let (messages, _) = messages_and_tools(&records[4]);
    assert_eq!(
        messages.iter().map(Message::is_trained).collect::<Vec<_>>(),
        [false, false, false, true]
    );
    // The legacy function calling becomes tools: the call gets an id its result names.
    let (messages, tools) = messages_and_tools(&records[5]);
    assert_eq!(tools[0]["type"], "function");
    assert_eq!(tools[0]["function"]["name"], "get_weather");
    assert_eq!(messages[0].name.as_deref(), Some("ada"));
    assert_eq!(messages[1].text(), "Checking.");
    assert_eq!(messages[1].tool_calls[0].id, "call_1");
    assert_eq!(
        messages[1].tool_calls[0].function.arguments,
        json!({"city": "Rome"})
    );
    assert_eq!(
        (messages[2].role, messages[2].tool_call_id.as_deref()),
        (Role::Tool, Some("call_1"))
    );
    // Text parts are joined.
    let (messages, _) = messages_and_tools(&records[6]);
    assert_eq!(messages[0].text(), "How warm is Lisbon?");
}

#[test]
fn malformed_shapes_are_refused_naming_the_field() {
    let user = r#"{"role": "user", "content": "q"}"#;
    let call = r#"{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}"#;
    let assistant = r#"{"role": "assistant", "content": "a"}"#;
    let cases = [
        (
            format!(
                r#"{{"messages": [{user}, {{"role": "assistant", "content": "a", "weight": 2}}]}}"#
            ),
            "messages[1].weight",
            "must be 0 or 1, not 2",
        ),
        (
            format!(
                r#"{{"messages": [{{"role": "user", "content": "q", "tool_calls": [{call}]}}, {{"role": "assistant", "content": "a"}}]}}"#
            ),
            "messages[0].tool_calls",
            "only assistant messages call tools",
        ),
        (
            format!(
                r#"{{"messages": [{user}, {{"role": "assistant", "tool_calls": [{{"id": "c1", "type": "function", "function": {{"name": "f", "arguments": "{{not json"}}}}]}}]}}"#
            ),
            "messages[1].tool_calls[0].function.arguments",
            "is not valid JSON",
        ),
        (
            format!(
                r#"{{"messages": [{user}, {{"role": "assistant", "tool_calls": [{call}]}}, {{"role": "tool", "tool_call_id": "c2", "content": "r"}}, {{"role": "assistant", "content": "a"}}]}}"#
            ),
            "messages[2].tool_call_id",
            "no earlier assistant message makes the call \"c2\"",
        ),
        (
            format!(r#"{{"messages": [{user}, {{"role": "assistant", "content": null}}]}}"#),
            "messages[1].content",
            "null only when the message calls tools",
        ),
        (
            format!(
                r#"{{"messages": [{{"role": "user", "content": [{{"type": "image_url", "image_url": {{"url": "x"}}}}]}}, {assistant}]}}"#
            ),
            "messages[0].content[0].type",
            "\"image_url\" parts are not supported",
        ),
        (
            format!(
                r#"{{"messages": [{user}, {{"role": "assistant", "content": "a"}}], "tools": [{{"type": "function", "function": {{"description": "no name"}}}}]}}"#
            ),
            "tools[0].function.name",
            "missing",
        ),
        (
            format!(
                r#"{{"messages": [{user}, {{"role": "assistant", "content": "a"}}], "tools": [], "functions": []}}"#
            ),
            "functions",
            "not both",
        ),
        (
            format!(
                r#"{{"messages": [{user}, {{"role": "function", "name": "g", "content": "r"}}, {{"role": "assistant", "content": "a"}}]}}"#
            ),
            "messages[1].name",
            "no earlier assistant message calls \"g\"",
        ),
        (
            format!(
                r#"{{"messages": [{user}, {{"role": "assistant", "content": "a"}}], "parallel_tool_calls": "yes"}}"#
            ),
            "parallel_tool_calls",
            "expected true or false, got string",
        ),
    ];
    for (line, field, message) in cases {
        let (errors, _, _) = invalid_lines(
            parse_jsonl("t.jsonl", line.as_bytes(), DatasetFormat::Chat).expect_err(&line),
        );
        assert!(
            errors
                .iter()
                .any(|e| e.field == field && e.message.contains(message)),
            "{line}: {errors:#?}"
        );
    }
}

/// The labelled text of `example`: the tokens that take loss, decoded one by one.
fn trained_text(enc: &Encoder, example: &Example) -> String {
    let ids: Vec<u32> = example
        .labels
        .iter()
        .filter(|&&l| l != IGNORE_INDEX)
        .map(|&l| l as u32)
        .collect();
    enc.tokenizer().decode(&ids, false).expect("decode")
}

#[test]
fn a_template_that_knows_tools_gets_them_and_loss_covers_calls_not_results() {
    let records = openai_tools();
    let enc = Encoder::new(tiny_tokenizer().clone(), tools_template());
    let text = enc.render(&records[0]).expect("render");
    assert!(
        text.contains(r#"{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.", "parameters": {"type": "object", "properties": {"city": {"type": "string""#),
        "tools in the given order, as Python's json.dumps writes them: {text}"
    );
    assert!(text.contains(
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call><|im_end|>"
    ));
    let example = enc.encode(&records[0], 4096).expect("valid");
    let trained = trained_text(&enc, &example);
    assert!(
        trained.contains("get_weather") && trained.contains("18 °C and clear"),
        "{trained}"
    );
    assert!(
        !trained.contains("temperature") && !trained.contains("weather assistant"),
        "{trained}"
    );
    // A turn weighted 0 takes no loss.
    let example = enc.encode(&records[4], 4096).expect("valid");
    let trained = trained_text(&enc, &example);
    assert!(
        trained.contains("Sorry: Paris.") && !trained.contains("Lyon"),
        "{trained}"
    );
}

#[test]
fn a_template_without_tools_gets_them_written_into_plain_messages() {
    let records = openai_tools();
    let enc = encoder(ChatTemplateChoice::Chatml);
    assert!(!enc.template().handles_tools(&[]));
    let conversation = enc.conversation(&records[1]);
    assert!(conversation.tools.is_empty());
    assert!(conversation.messages.iter().all(Message::is_plain));
    let text = enc.render(&records[1]).expect("render");
    assert!(
        text.starts_with(&format!("<|im_start|>system\n{TOOLS_PREAMBLE}\n<tools>\n")),
        "{text}"
    );
    assert!(
        text.contains("<|im_start|>user\n<tool_response>\n-3 C, snow\n</tool_response><|im_end|>")
    );
    let example = enc.encode(&records[1], 4096).expect("valid");
    let trained = trained_text(&enc, &example);
    assert!(
        trained.contains("\"name\": \"get_time\"") && !trained.contains("snow\n"),
        "{trained}"
    );
    // A record without tools renders as it always did.
    let plain = enc.conversation(&records[9]);
    assert_eq!(plain.messages, messages_and_tools(&records[9]).0);
}

#[test]
fn preference_pairs_read_with_their_prompt_tools_and_two_answers() {
    let parsed = read_jsonl(
        &examples_dir().join("openai-preference.jsonl"),
        DatasetFormat::Auto,
    )
    .expect("openai-preference.jsonl is valid");
    assert_eq!(parsed.format, DatasetFormat::Preference);
    assert_eq!(parsed.records.len(), 10);
    let Record::Preference {
        messages,
        tools,
        preferred,
        rejected,
    } = &parsed.records[8]
    else {
        panic!("not a preference pair: {:?}", parsed.records[8]);
    };
    assert_eq!((messages.len(), tools.len()), (1, 1));
    assert_eq!(preferred.tool_calls[0].function.name, "get_weather");
    assert_eq!(rejected.text(), "I cannot know the weather.");
    // Rendered for statistics as the prompt and the preferred answer.
    let enc = Encoder::new(tiny_tokenizer().clone(), tools_template());
    let conversation = enc.conversation(&parsed.records[9]);
    assert_eq!(conversation.messages.len(), 4);
    assert_eq!(
        conversation.messages[3].text(),
        "It is -3 °C and snowing in Oslo."
    );
    let trained = trained_text(&enc, &enc.encode(&parsed.records[9], 4096).expect("valid"));
    assert!(
        trained.contains("snowing") && !trained.contains("warm"),
        "{trained}"
    );
}

#[test]
fn malformed_preference_pairs_are_refused_naming_the_field() {
    let input = r#""input": {"messages": [{"role": "user", "content": "q"}]}"#;
    let one = r#"[{"role": "assistant", "content": "a"}]"#;
    let cases = [
        (
            format!(r#"{{{input}, "preferred_output": [], "non_preferred_output": {one}}}"#),
            "preferred_output",
            "has 0 messages",
        ),
        (
            format!(
                r#"{{{input}, "preferred_output": {one}, "non_preferred_output": [{{"role": "user", "content": "b"}}]}}"#
            ),
            "non_preferred_output[0].role",
            "the answer is an assistant message",
        ),
        (
            format!(
                r#"{{"input": {{"messages": [{{"role": "user", "content": "q"}}, {{"role": "assistant", "content": "a"}}]}}, "preferred_output": {one}, "non_preferred_output": {one}}}"#
            ),
            "input.messages[1]",
            "its last message is not the assistant's",
        ),
        (
            format!(
                r#"{{"input": {{"messages": [{{"role": "user", "content": 7}}]}}, "preferred_output": {one}, "non_preferred_output": {one}}}"#
            ),
            "input.messages[0].content",
            "expected a string",
        ),
        (
            format!(r#"{{{input}, "preferred_output": {one}}}"#),
            "non_preferred_output",
            "expected an array of one assistant message, got nothing",
        ),
    ];
    for (line, field, message) in cases {
        let (errors, _, _) = invalid_lines(
            parse_jsonl("p.jsonl", line.as_bytes(), DatasetFormat::Auto).expect_err(&line),
        );
        assert!(
            errors
                .iter()
                .any(|e| e.field == field && e.message.contains(message)),
            "{line}: {errors:#?}"
        );
    }
}

/// A template that takes only 9-character call ids (as Mistral's) gets OpenAI's ids
/// shortened, a call and its result alike; one that takes any id gets them as given.
#[test]
fn call_ids_are_shortened_only_for_a_template_that_wants_them_so() {
    let nine = "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}{% if c.id|length != 9 %}{{ raise_exception('ids are 9 characters') }}{% endif %}[CALL {{ c.id }}]{% endfor %}{% elif m.role == 'tool' %}{% if m.tool_call_id|length != 9 %}{{ raise_exception('ids are 9 characters') }}{% endif %}[RESULT {{ m.tool_call_id }}]{% else %}{{ m.content }}{% endif %}{% endfor %}";
    let any = nine
        .replace("{% if c.id|length != 9 %}{{ raise_exception('ids are 9 characters') }}{% endif %}", "")
        .replace("{% if m.tool_call_id|length != 9 %}{{ raise_exception('ids are 9 characters') }}{% endif %}", "");
    let call = |id: &str| crate::chat::ToolCall::function(id, "f", serde_json::json!({}));
    let messages = [
        Message::new(Role::User, "?"),
        Message {
            content: None,
            tool_calls: vec![call("call_Xy7_0123456789abcdefghij"), call("call_0")],
            ..Message::new(Role::Assistant, "")
        },
        Message {
            tool_call_id: Some("call_Xy7_0123456789abcdefghij".into()),
            ..Message::new(Role::Tool, "{}")
        },
    ];
    let t = ChatTemplate::from_jinja(nine, "", "").expect("compile");
    assert!(t.wants_short_call_ids());
    assert_eq!(
        t.render(&messages, false).expect("render"),
        "?[CALL bcdefghij][CALL 0000call0][RESULT bcdefghij]"
    );
    let t = ChatTemplate::from_jinja(&any, "", "").expect("compile");
    assert!(!t.wants_short_call_ids());
    assert!(
        t.render(&messages, false)
            .expect("render")
            .contains("[CALL call_0]")
    );
}

/// A template that fails on the null content of a turn that only calls tools (Qwen3's
/// first: `'</think>' in message.content`) is handed `""` there; one that takes null gets
/// null.
#[test]
fn null_call_content_is_given_as_empty_only_to_a_template_that_needs_it() {
    let strict = "{% for m in messages %}{% if m.role == 'assistant' %}{% if '</think>' in m.content %}R{% endif %}[{{ m.content }}]{% for c in m.tool_calls %}<{{ c.function.name }}>{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}";
    let lenient = "{% for m in messages %}{% if m.role == 'assistant' %}[{{ m.content is none }}]{% for c in m.tool_calls %}<{{ c.function.name }}>{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}";
    let messages = [
        Message::new(Role::User, "?"),
        Message {
            content: None,
            tool_calls: vec![crate::chat::ToolCall::function(
                "call_0",
                "f",
                serde_json::json!({}),
            )],
            ..Message::new(Role::Assistant, "")
        },
    ];
    let t = ChatTemplate::from_jinja(strict, "", "").expect("compile");
    assert_eq!(t.render(&messages, false).expect("render"), "?[]<f>");
    let t = ChatTemplate::from_jinja(lenient, "", "").expect("compile");
    assert_eq!(t.render(&messages, false).expect("render"), "?[True]<f>");
}

/// What OpenAI's answers carry besides content and calls, which its SDK sends back with
/// an appended answer, is accepted on an assistant message (its reasoning kept for the
/// template) and refused elsewhere or of another type, the field named.
#[test]
fn an_echoed_answer_is_taken_back_and_misplaced_fields_are_named() {
    let request = |messages: serde_json::Value| {
        let obj = json!({ "messages": messages });
        crate::request_conversation(obj.as_object().expect("object"))
    };
    let echoed = json!({"role": "assistant", "content": "Two.", "refusal": null,
                        "annotations": [], "audio": null, "reasoning_content": "1 + 1"});
    let conversation = request(json!([{"role": "user", "content": "1 + 1?"}, echoed]))
        .expect("an echoed answer is taken");
    assert_eq!(
        conversation.messages[1].reasoning_content.as_deref(),
        Some("1 + 1")
    );
    let problems = request(json!([
        {"role": "user", "content": "?", "refusal": null},
        {"role": "assistant", "content": "!", "refusal": 3, "annotations": {}},
    ]))
    .expect_err("refused");
    let fields: Vec<&str> = problems.iter().map(|(field, _)| field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "messages[0].refusal",
            "messages[1].refusal",
            "messages[1].annotations"
        ]
    );
    // A template that reads the reasoning gets it.
    let reads = "{% for m in messages %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}{% endfor %}";
    let t = ChatTemplate::from_jinja(reads, "", "").expect("compile");
    assert_eq!(
        t.render(&conversation.messages, false).expect("render"),
        "1 + 1?<think>1 + 1</think>Two."
    );
}

/// A template that writes `<think>` blocks says so (its model's answers are read for
/// one); ChatML does not.
#[test]
fn a_template_says_whether_it_writes_reasoning_blocks() {
    let qwen3_like = "{% for m in messages %}{% if m.reasoning_content %}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{% endif %}{{ m.content }}{% endfor %}";
    let t = ChatTemplate::from_jinja(qwen3_like, "", "").expect("compile");
    assert!(t.writes_reasoning());
    let t = ChatTemplate::from_jinja(crate::CHATML_TEMPLATE, "", "").expect("compile");
    assert!(!t.writes_reasoning());
}

#[test]
fn a_request_s_variables_reach_the_template_but_never_the_rendering_s_own_names() {
    let source = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}";
    let t = ChatTemplate::from_jinja(source, "", "").expect("compile");
    let messages = [Message::new(Role::User, "hi")];
    let variables = |value: serde_json::Value| value.as_object().expect("object").clone();
    let render = |v: &crate::TemplateVariables| {
        t.render_with_variables(&messages, &[], true, v)
            .expect("render")
    };
    assert_eq!(render(&Default::default()), "hi>");
    assert_eq!(
        render(&variables(json!({"enable_thinking": false}))),
        "hi><think></think>"
    );
    assert_eq!(render(&variables(json!({"enable_thinking": true}))), "hi>");
    // The rendering's own names keep their values.
    assert_eq!(
        render(&variables(
            json!({"messages": [{"content": "x"}], "add_generation_prompt": false})
        )),
        "hi>"
    );
}
