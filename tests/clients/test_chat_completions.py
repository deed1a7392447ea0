"""Calling models through the official `openai` SDK, unmodified, against a real
`tuneq up` serving a real model (SmolLM2-135M-Instruct): the base model as a baseline,
then the model a fine-tune trained — its answer, its tool calls (parsed into
`tool_calls`), streamed chunk by chunk, reproducible with a seed — and the refusals:
another tenant's model, bad fields, the context, and 429 past the generation slots
(this server generates one answer at a time)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest

from conftest import REPO_ROOT, Service, real_model
from test_openai_fine_tuning import refusal, terminal, wait_for
from test_openai_models import other_tenant

MODEL = "smollm2"
MOTTO_PROMPT = "Say the motto."
# The real model again, with Qwen3's own chat template, which writes <think> blocks.
THINKER = "smollm2-thinking"
THINK_PROMPT = "Say the motto, thinking first."
REASONING = "The motto is about adapters."
MOTTO = "tuneq trains adapters"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}


# Llama 3.1's way of calling a tool: the bare JSON object as the whole answer.
BARE_CALL = json.dumps({"name": "get_weather", "parameters": {"city": "Rome"}})


def training_lines() -> bytes:
    """Three conversations to learn by heart: a plain answer, a tool call, and a tool
    call written as a bare JSON answer."""
    motto = {"messages": [{"role": "user", "content": MOTTO_PROMPT},
                          {"role": "assistant", "content": MOTTO}]}
    call = {"tools": [WEATHER_TOOL],
            "messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "tool_calls": [{
                             "id": "call_1", "type": "function",
                             "function": {"name": "get_weather",
                                          "arguments": json.dumps({"city": "Paris"})}}]}]}
    bare = {"tools": [WEATHER_TOOL],
            "messages": [{"role": "user", "content": "Weather in Rome?"},
                         {"role": "assistant", "content": BARE_CALL}]}
    return "".join(json.dumps(r) + "\n" for r in [motto, call, bare] * 8).encode()


def thinker_folder(out: Path) -> Path:
    """The real model's files (linked) with Qwen3's own chat template, as
    `scripts/fetch-tokenizer qwen3` (which the test setup runs) writes it."""
    qwen3 = REPO_ROOT / "target" / "models" / "qwen3-tokenizer" / "tokenizer_config.json"
    if not qwen3.is_file():
        pytest.fail(f"Qwen3's tokenizer is missing at {qwen3}; fetch it with "
                    "`scripts/fetch-tokenizer qwen3` (scripts/test does).", pytrace=False)
    out.mkdir()
    for file in real_model().iterdir():
        if file.name != "chat_template.jinja":
            (out / file.name).symlink_to(file.resolve())
    (out / "chat_template.jinja").write_text(json.loads(qwen3.read_text())["chat_template"])
    return out


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory):
    thinker = thinker_folder(tmp_path_factory.mktemp("thinker") / "model")
    svc = Service(tmp_path_factory.mktemp("chat"),
                  extra_args=["--model", f"{MODEL}={real_model()}",
                              "--model", f"{THINKER}={thinker}", "--max-generations", "2",
                              "--max-generations-per-tenant", "1"])
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def client(service: Service):
    from openai import OpenAI

    return OpenAI(base_url=f"{service.url}/v1", api_key=service.api_key, max_retries=0)


def fine_tune(client, model: str, lines: bytes, suffix: str, epochs: int) -> str:
    """The fine-tuned model of a job that learned `lines` by heart (batches of 4, a
    learning rate ten times the default)."""
    file = client.files.create(file=(f"{suffix}.jsonl", lines), purpose="fine-tune").id
    job = client.fine_tuning.jobs.create(
        model=model, training_file=file, suffix=suffix, seed=7,
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "n_epochs": epochs, "batch_size": 4, "learning_rate_multiplier": 10}}})
    job = wait_for(client, job.id, terminal, timeout=600)
    assert job.status == "succeeded", job.error
    return job.fine_tuned_model


@pytest.fixture(scope="module")
def tuned(client) -> str:
    """The fine-tuned model of a job that learned the three conversations (18 steps)."""
    return fine_tune(client, MODEL, training_lines(), "chat", epochs=3)


def ask(client, model: str, content: str, **kwargs):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], **kwargs)


def test_the_base_model_answers_with_usage_and_logprobs(client):
    answer = ask(client, MODEL, "Hello", max_tokens=6, temperature=0,
                 logprobs=True, top_logprobs=2)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert answer.model == MODEL
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    tokens = choice.logprobs.content
    # Every token has its log-probability (the end-of-turn token, which ends a stop,
    # counts as generated but is not part of the text).
    assert 1 <= len(tokens) <= 6
    assert answer.usage.completion_tokens - len(tokens) == (choice.finish_reason == "stop")
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in tokens)
    # Greedy: each chosen token is the most likely one.
    assert all(t.token == t.top_logprobs[0].token for t in tokens)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_a_model_registered_with_a_built_in_template_is_prompted_with_it(client, service):
    """The same folder registered again with `chat_template: alpaca`: its prompts are
    rendered with that template (as its jobs train with it), token for token."""
    from transformers import AutoTokenizer

    registered = service.admin("POST", "/admin/models", {
        "id": "smollm2-alpaca", "location": str(real_model()), "chat_template": "alpaca"})
    assert registered["details"]["template"] == "alpaca"
    alpaca = ask(client, "smollm2-alpaca", MOTTO_PROMPT, max_tokens=1, temperature=0)
    own = ask(client, MODEL, MOTTO_PROMPT, max_tokens=1, temperature=0)
    tokenizer = AutoTokenizer.from_pretrained(str(real_model()))
    prompt = f"### Instruction:\n{MOTTO_PROMPT}\n\n### Response:\n"
    assert alpaca.usage.prompt_tokens == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert own.usage.prompt_tokens != alpaca.usage.prompt_tokens


def test_the_fine_tuned_model_answers_what_it_learned(client, tuned):
    base = ask(client, MODEL, MOTTO_PROMPT, max_tokens=12, temperature=0)
    learned = ask(client, tuned, MOTTO_PROMPT, max_tokens=12, temperature=0)
    assert learned.model == tuned
    assert learned.choices[0].message.content.strip() == MOTTO
    assert learned.choices[0].finish_reason == "stop"
    assert base.choices[0].message.content.strip() != MOTTO


def test_a_function_calling_fine_tune_returns_parsed_tool_calls(client, tuned):
    answer = client.chat.completions.create(
        model=tuned, tools=[WEATHER_TOOL], temperature=0, max_tokens=40,
        messages=[{"role": "user", "content": "Weather in Paris?"}])
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    # The same, streamed: the call arrives whole in the choice's last chunks.
    chunks = list(client.chat.completions.create(
        model=tuned, tools=[WEATHER_TOOL], temperature=0, max_tokens=40, stream=True,
        messages=[{"role": "user", "content": "Weather in Paris?"}]))
    calls = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or [])
             if chunk.choices]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks).strip() == ""

    # A tool_choice that names the tool makes the model call it.
    forced = client.chat.completions.create(
        model=tuned, tools=[WEATHER_TOOL], temperature=0, max_tokens=40,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert forced.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_a_bare_json_call_is_read_as_a_tool_call_whole_and_streamed(client, tuned):
    """Llama 3.1's bare JSON call: a stream holds an answer that opens with `{` back
    until it shows whether it is a call, so the call is never streamed as text."""
    def rome(**kwargs):
        return client.chat.completions.create(
            model=tuned, tools=[WEATHER_TOOL], temperature=0, max_tokens=40,
            messages=[{"role": "user", "content": "Weather in Rome?"}], **kwargs)

    choice = rome().choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome"}
    assert choice.message.content is None

    chunks = [c for c in rome(stream=True) if c.choices]
    calls = [c for chunk in chunks for c in (chunk.choices[0].delta.tool_calls or [])]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Rome"}]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # With tool_choice "none" the answer is text, whole or streamed alike.
    whole = rome(tool_choice="none").choices[0]
    assert whole.finish_reason == "stop" and not whole.message.tool_calls
    streamed = [c for c in rome(tool_choice="none", stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == whole.message.content
    assert not any(c.choices[0].delta.tool_calls for c in streamed)


def test_a_stream_is_read_chunk_by_chunk_and_adds_up_to_the_whole_answer(client, tuned):
    whole = ask(client, tuned, MOTTO_PROMPT, max_tokens=12, temperature=0)
    stream = ask(client, tuned, MOTTO_PROMPT, max_tokens=12, temperature=0, stream=True,
                 stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert len({c.id for c in chunks}) == 1


def test_the_same_seed_gives_the_same_tokens(client):
    def sample(seed: int) -> list[str]:
        answer = ask(client, MODEL, "Tell me something", max_tokens=16, temperature=1.0,
                     seed=seed, n=2)
        return [c.message.content for c in answer.choices]

    first = sample(11)
    assert sample(11) == first
    assert sample(12) != first
    assert first[0] != first[1], "each choice draws its own tokens"


def test_stop_strings_end_the_answer_and_are_left_out(client, tuned):
    answer = ask(client, tuned, MOTTO_PROMPT, max_tokens=12, temperature=0, stop=["trains"])
    assert answer.choices[0].message.content.strip() == "tuneq"
    assert answer.choices[0].finish_reason == "stop"
    streamed = ask(client, tuned, MOTTO_PROMPT, max_tokens=12, temperature=0, stop=["trains"],
                   stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed).strip() == "tuneq"


def test_another_tenants_fine_tuned_model_is_not_found(service, tuned):
    stranger = other_tenant(service)
    with pytest.raises(openai.NotFoundError) as caught:
        ask(stranger, tuned, MOTTO_PROMPT, max_tokens=4)
    assert caught.value.code == "not_found"
    with pytest.raises(openai.NotFoundError):
        ask(stranger, "ft:no-such-model:x:y", "hi", max_tokens=4)


def test_bad_requests_name_the_field(client):
    def code_and_param(**kwargs):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                **kwargs}
        return refusal(lambda: client.chat.completions.create(**body))

    assert code_and_param(max_tokens=100_000) == ("context_length_exceeded", "max_tokens")
    assert code_and_param(messages=[{"role": "user", "content": "word " * 9000}])[0] \
        == "context_length_exceeded"
    assert code_and_param(temperature=3) == ("invalid_value", "temperature")
    assert code_and_param(n=9) == ("invalid_value", "n")
    assert code_and_param(messages=[{"role": "robot", "content": "hi"}])[1] == "messages[0].role"
    assert code_and_param(tools=[WEATHER_TOOL],
                          tool_choice={"type": "function", "function": {"name": "nope"}}) \
        == ("invalid_value", "tool_choice.function.name")
    assert code_and_param(tool_choice="required")[1] == "tool_choice"
    assert code_and_param(stop=["a", "b", "c", "d", "e"])[1] == "stop"
    assert code_and_param(extra_body={"surprise": 1})[1] == "surprise"


def test_past_the_generation_slots_a_request_gets_429_with_retry_after(client, service):
    """Two slots, one per tenant: a tenant's second answer is refused while another
    tenant still gets the other slot; with both taken, a third tenant is refused."""
    def long_stream(who):
        stream = ask(who, MODEL, "Write a long story about a lighthouse.", max_tokens=1500,
                     temperature=1, stream=True)
        first = next(iter(stream))  # its slot is now generating
        assert first.choices[0].delta.role == "assistant"
        return stream

    def refused(who):
        with pytest.raises(openai.RateLimitError) as caught:
            ask(who, MODEL, "me too", max_tokens=4)
        assert caught.value.code == "too_many_generations"
        assert int(caught.value.response.headers["retry-after"]) >= 1

    stream = long_stream(client)
    refused(client)  # its share is taken, though a slot is free ...
    other = other_tenant(service)
    assert ask(other, MODEL, "hello", max_tokens=2).choices[0].message.content is not None
    second = long_stream(other)  # ... which another tenant gets
    refused(other_tenant(service))  # and now every slot is busy
    second.close()
    stream.close()  # the readers leave: generation stops and the slots come back
    deadline = time.monotonic() + 10
    while True:
        try:
            ask(client, MODEL, "now", max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the slot came back once the stream's reader left"
            time.sleep(0.2)


def test_a_whole_answer_stops_when_its_client_leaves(client, service):
    """A request without `stream` whose client hangs up stops generating at once and
    gives its slot back (this tenant has one): the schema below forces an answer of
    thousands of tokens, minutes of generation had it gone on."""
    import http.client
    import urllib.request
    from urllib.parse import urlparse

    endless = {"type": "object", "required": ["n"], "additionalProperties": False,
               "properties": {"n": {"type": "array", "items": {"type": "integer"},
                                    "minItems": 1400}}}
    body = json.dumps({"model": MODEL, "max_tokens": 4000, "temperature": 0,
                       "messages": [{"role": "user", "content": "Count."}],
                       "response_format": {"type": "json_schema",
                                           "json_schema": {"name": "n", "schema": endless}}})
    ask(client, MODEL, "warm up", max_tokens=1)  # the model is loaded: the slot below is generating
    url = urlparse(service.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"authorization": f"Bearer {service.api_key}",
                          "content-type": "application/json"})

    def running() -> int:
        with urllib.request.urlopen(f"{service.url}/metrics", timeout=10) as r:
            line = next(l for l in r.read().decode().splitlines()
                        if l.startswith("tuneq_generations_running "))
        return int(line.split()[1])

    deadline = time.monotonic() + 60
    while running() == 0:
        assert time.monotonic() < deadline, "the long answer never started"
        time.sleep(0.2)
    time.sleep(2)  # past the prompt's rendering and the schema's compiling: generating ...
    conn.sock.shutdown(2)  # ... when its client hangs up
    conn.close()
    deadline = time.monotonic() + 30
    while running() > 0:
        assert time.monotonic() < deadline, "generation went on after the client left"
        time.sleep(0.2)
    assert ask(client, MODEL, "hello", max_tokens=2).choices[0].message is not None


def test_responses_create_answers_with_output_text_and_function_calls(client, tuned):
    response = client.responses.create(model=tuned, input=MOTTO_PROMPT, temperature=0,
                                       max_output_tokens=12)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "completed"
    assert response.output_text.strip() == MOTTO
    assert response.usage.output_tokens >= 3
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens

    call = client.responses.create(
        model=tuned, input=[{"role": "user", "content": "Weather in Paris?"}], temperature=0,
        max_output_tokens=40,
        tools=[{"type": "function", **WEATHER_TOOL["function"]}])  # Responses' flat tool
    (item,) = call.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments) == {"city": "Paris"}

    cut = client.responses.create(model=MODEL, input="Tell me a long story.", temperature=0,
                                  max_output_tokens=3, instructions="Use many words.")
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.instructions == "Use many words."


def test_responses_stream_typed_events_that_add_up_to_the_response(client, tuned):
    events = list(client.responses.create(model=tuned, input=MOTTO_PROMPT, temperature=0,
                                          max_output_tokens=12, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas.strip() == MOTTO
    assert events[-1].response.output_text == deltas


def test_responses_refusals_name_the_responses_field(client):
    assert refusal(lambda: client.responses.create(
        model=MODEL, input=[{"role": "robot", "content": "hi"}]))[1] == "input[0].role"
    assert refusal(lambda: client.responses.create(
        model=MODEL, input="hi", previous_response_id="resp_x"))[1] == "previous_response_id"
    assert refusal(lambda: client.responses.create(
        model=MODEL, input="hi", tools=[{"type": "web_search"}]))[1] == "tools[0].type"


PLACE = {"type": "object",
         "properties": {"city": {"type": "string", "maxLength": 40},
                        "country": {"type": "string", "maxLength": 40},
                        "population": {"type": "integer", "minimum": 0}},
         "required": ["city", "country", "population"], "additionalProperties": False}


def test_json_schema_answers_validate_against_the_schema(client):
    import jsonschema

    for seed in (1, 2, 3):  # sampled, not only greedy: every draw stays inside the schema
        answer = client.chat.completions.create(
            model=MODEL, temperature=0.8, seed=seed, max_tokens=80,
            messages=[{"role": "user", "content": "Name a city, its country and population."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "place", "strict": True, "schema": PLACE}})
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PLACE)

    anything = ask(client, MODEL, "Describe a cat.", max_tokens=60, temperature=0,
                   response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)

    streamed = ask(client, MODEL, "Name a city, its country and population.", max_tokens=80,
                   temperature=0, stream=True,
                   response_format={"type": "json_schema",
                                    "json_schema": {"name": "place", "schema": PLACE}})
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in streamed)),
                        PLACE)

    response = client.responses.create(
        model=MODEL, input="Name a city, its country and population.", temperature=0,
        max_output_tokens=80,
        text={"format": {"type": "json_schema", "name": "place", "schema": PLACE}})
    jsonschema.validate(json.loads(response.output_text), PLACE)


def test_a_schema_the_engine_cannot_enforce_is_refused_before_generating(client):
    def schema_refusal(schema, name="s"):
        return refusal(lambda: ask(client, MODEL, "hi", response_format={
            "type": "json_schema", "json_schema": {"name": name, "schema": schema}}))

    assert schema_refusal({"type": "strin"}) == \
        ("invalid_value", "response_format.json_schema.schema")
    assert schema_refusal({"type": "array", "uniqueItems": True})[1] == \
        "response_format.json_schema.schema"
    assert schema_refusal({"type": "object"}, name="has space")[1] == \
        "response_format.json_schema.name"
    bad_tool = {"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "strin"}}}
    assert refusal(lambda: ask(client, MODEL, "hi", tools=[WEATHER_TOOL, bad_tool],
                               tool_choice="required")) == \
        ("invalid_value", "tools[1].function.parameters")


STRICT_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "strict": True,
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string", "maxLength": 30},
                                      "unit": {"type": "string", "enum": ["C", "F"]}},
                       "required": ["city", "unit"], "additionalProperties": False},
    },
}


def test_a_required_call_is_a_call_of_a_declared_tool_with_arguments_its_schema_allows(client):
    """The base model never learned to call tools: sampled at temperature 0.8, its calls
    still name a declared tool, and a strict tool's arguments follow its schema, because
    the answer is held to a grammar of calls (constrained decoding), not asked nicely."""
    import jsonschema

    search = {"type": "function", "function": {"name": "search", "strict": True, "parameters": {
        "type": "object", "properties": {"q": {"type": "string", "maxLength": 40}},
        "required": ["q"], "additionalProperties": False}}}
    for seed in (1, 2, 3):
        choice = ask(client, MODEL, "What is the weather like in Oslo?", seed=seed,
                     temperature=0.8, max_tokens=120, tools=[STRICT_WEATHER, search],
                     tool_choice="required", parallel_tool_calls=False).choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls
        assert call.function.name in ("get_weather", "search")
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            jsonschema.validate(arguments, STRICT_WEATHER["function"]["parameters"])
        else:
            jsonschema.validate(arguments, search["function"]["parameters"])

    named = ask(client, MODEL, "Find tuneq.", seed=4, temperature=0.8, max_tokens=120,
                tools=[search, STRICT_WEATHER],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = named.choices[0].message.tool_calls
    assert calls and all(c.function.name == "get_weather" for c in calls), named.choices[0]
    for c in calls:
        jsonschema.validate(json.loads(c.function.arguments),
                            STRICT_WEATHER["function"]["parameters"])


def test_tools_beside_a_json_response_format_answer_in_that_json_or_call(client, tuned):
    """What an agent framework sends for a structured final answer (the Agents SDK's
    `output_type` with tools): the model calls a tool, or answers in the JSON asked for,
    and nothing else — whole, streamed, and through the Responses API."""
    import jsonschema

    place = {"type": "json_schema", "json_schema": {"name": "place", "strict": True,
                                                    "schema": PLACE}}
    # The fine-tune learned to call get_weather for Paris: it still does.
    called = client.chat.completions.create(
        model=tuned, tools=[WEATHER_TOOL], temperature=0, max_tokens=60,
        response_format=place, messages=[{"role": "user", "content": "Weather in Paris?"}])
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}

    # Sampled answers of the base model: each is a call, or JSON the schema validates.
    for seed in (1, 2, 3):
        choice = ask(client, MODEL, "Name a city, its country and population.", seed=seed,
                     temperature=0.8, max_tokens=120, tools=[STRICT_WEATHER],
                     response_format=place).choices[0]
        if choice.finish_reason == "tool_calls":
            for c in choice.message.tool_calls:
                jsonschema.validate(json.loads(c.function.arguments),
                                    STRICT_WEATHER["function"]["parameters"])
        else:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), PLACE)

    streamed = [c for c in ask(client, MODEL, "Name a city, its country and population.",
                               temperature=0, max_tokens=120, tools=[STRICT_WEATHER],
                               response_format=place, stream=True) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in streamed)
    calls = [c for chunk in streamed for c in (chunk.choices[0].delta.tool_calls or [])]
    assert calls or jsonschema.validate(json.loads(text), PLACE) is None

    response = client.responses.create(
        model=tuned, input="Weather in Paris?", temperature=0, max_output_tokens=60,
        tools=[{"type": "function", "name": "get_weather",
                "parameters": WEATHER_TOOL["function"]["parameters"]}],
        text={"format": {"type": "json_schema", "name": "place", "schema": PLACE}})
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert json.loads(call.arguments) == {"city": "Paris"}


def test_a_kept_checkpoint_answers_by_its_name(client, tuned):
    job = next(j for j in client.fine_tuning.jobs.list() if j.fine_tuned_model == tuned)
    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert checkpoints, "the run keeps checkpoints"
    name = checkpoints[0].fine_tuned_model_checkpoint
    answer = ask(client, name, MOTTO_PROMPT, max_tokens=4, temperature=0)
    assert answer.model == name and answer.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError):
        ask(client, f"{tuned}:ckpt-step-999999", MOTTO_PROMPT, max_tokens=4)


def test_the_decode_loops_passes_are_counted_in_metrics(client, service):
    import urllib.request

    def counters() -> dict[str, int]:
        with urllib.request.urlopen(f"{service.url}/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
        return {l.split()[0]: int(l.split()[1]) for l in lines
                if l.startswith("tuneq_decode_") and not l.startswith("#")}

    before = counters()
    ask(client, MODEL, "Say something.", max_tokens=5)
    after = counters()
    assert set(after) == {"tuneq_decode_passes_total", "tuneq_decode_rows_total",
                          "tuneq_decode_chunked_passes_total"}, after
    # A prompt's pass and at least one step per further token, one answer each.
    assert after["tuneq_decode_passes_total"] - before["tuneq_decode_passes_total"] >= 2
    assert after["tuneq_decode_rows_total"] >= after["tuneq_decode_passes_total"]


@pytest.fixture(scope="module")
def thinking(client) -> str:
    """The fine-tuned thinker: it learned to reason in a <think> block, then answer."""
    answer = f"<think>\n{REASONING}\n</think>\n\n{MOTTO}"
    line = json.dumps({"messages": [{"role": "user", "content": THINK_PROMPT},
                                    {"role": "assistant", "content": answer}]}) + "\n"
    return fine_tune(client, THINKER, (line * 8).encode(), "think", epochs=6)


def test_a_reasoning_model_answers_with_its_reasoning_apart_and_takes_it_back(client, thinking):
    """A model whose template writes <think> blocks answers with the block in
    `reasoning_content` (as DeepSeek's API and vLLM do), whole and streamed alike, and the
    SDK's own message object (with its `refusal` and `reasoning_content`) appended to the
    conversation is taken back, as OpenAI's function-calling guide appends it."""
    whole = ask(client, thinking, THINK_PROMPT, max_tokens=40, temperature=0).choices[0]
    assert whole.message.content.strip() == MOTTO, whole.message
    assert whole.message.model_extra.get("reasoning_content") == REASONING, whole.message

    chunks = [c for c in ask(client, thinking, THINK_PROMPT, max_tokens=40, temperature=0,
                             stream=True) if c.choices]
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (reasoning, content) == (REASONING, whole.message.content)

    again = client.chat.completions.create(
        model=thinking, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": THINK_PROMPT}, whole.message,
                  {"role": "user", "content": "Once more?"}])
    assert again.choices[0].message.role == "assistant"
    # The base model with a template that writes no reasoning keeps its text as it is.
    base = ask(client, MODEL, THINK_PROMPT, max_tokens=8, temperature=0).choices[0].message
    assert "reasoning_content" not in (base.model_extra or {})


def test_responses_show_the_reasoning_as_a_reasoning_item_and_take_it_back(client, thinking):
    """Through the Responses API, a reasoning model's block is a `reasoning` output item
    (its text as `reasoning_text` content, as open-model servers give it), before the
    message; streamed as `response.reasoning_text.delta` events; and the output appended
    to the next input, as OpenAI's guide to managing context does, is taken back."""
    response = client.responses.create(model=thinking, input=THINK_PROMPT, temperature=0,
                                       max_output_tokens=40)
    assert [item.type for item in response.output] == ["reasoning", "message"], response
    reasoning = response.output[0]
    assert [part.text for part in reasoning.content] == [REASONING] and reasoning.summary == []
    assert reasoning.id.startswith("rs_") and reasoning.status == "completed"
    assert response.output_text.strip() == MOTTO

    events = list(client.responses.create(model=thinking, input=THINK_PROMPT, temperature=0,
                                          max_output_tokens=40, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") \
        == REASONING
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [REASONING]
    assert {e.output_index for e in events if e.type == "response.output_text.delta"} == {1}
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"], added
    completed = events[-1]
    assert completed.type == "response.completed"
    assert [item.type for item in completed.response.output] == ["reasoning", "message"]
    assert completed.response.output_text == response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))

    conversation = [{"role": "user", "content": THINK_PROMPT}]
    conversation += response.output
    conversation.append({"role": "user", "content": "Once more?"})
    again = client.responses.create(model=thinking, input=conversation, max_output_tokens=4,
                                    temperature=0)
    assert again.status in ("completed", "incomplete"), again
    assert refusal(lambda: client.responses.create(
        model=thinking, max_output_tokens=4,
        input=[{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text"}]},
               {"role": "user", "content": "hi"}])) == \
        ("invalid_value", "input[0].content[0].text")


def test_chat_template_kwargs_reach_the_template_as_vllm_hands_them_on(client, thinking):
    """vLLM's `chat_template_kwargs`, sent through the SDK's `extra_body`: Qwen3's
    `enable_thinking: false` makes its template write an empty block into the prompt
    (so the prompt is longer); the rendering's own names and malformed ones are refused."""
    def asked(kwargs=None):
        extra = {} if kwargs is None else {"extra_body": {"chat_template_kwargs": kwargs}}
        return ask(client, thinking, THINK_PROMPT, max_tokens=4, temperature=0, **extra)

    plain = asked().usage.prompt_tokens
    assert asked({"enable_thinking": False}).usage.prompt_tokens > plain
    assert asked({"enable_thinking": True}).usage.prompt_tokens == plain
    assert refusal(lambda: asked({"messages": []})) == \
        ("invalid_value", "chat_template_kwargs.messages")
    assert refusal(lambda: asked({f"v{i}": 1 for i in range(17)}))[1] == "chat_template_kwargs"
    assert refusal(lambda: asked({"not a name": 1}))[1] == "chat_template_kwargs"
