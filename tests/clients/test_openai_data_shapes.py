"""Training data in every chat shape OpenAI's fine-tuning accepts, through the official
`openai` SDK against a real `tuneq up`: function-calling records (tools, tool calls with
null content, tool results, parallel calls), weights, names, text parts, records without
a user turn and the legacy functions upload with token statistics and train to a
succeeded job; a malformed tool call is refused at upload naming its line and field."""

from __future__ import annotations

import json
import time

import openai
import pytest

from conftest import REPO_ROOT

DEMO_MODEL = "tuneq-tiny-demo"
TOOLS = (REPO_ROOT / "examples/data/openai-tools.jsonl").read_bytes()


def test_function_calling_data_uploads_and_trains(client):
    uploaded = client.files.create(file=("tools.jsonl", TOOLS), purpose="fine-tune")
    validation = uploaded.model_extra["validation"]
    assert validation["format"] == "chat"
    assert validation["examples"] == 10
    tokens = validation["tokens"]
    assert 0 < tokens["trained_tokens"] < tokens["tokens"], "tool results and prompts carry no loss"

    job = client.fine_tuning.jobs.create(
        model=DEMO_MODEL,
        training_file=uploaded.id,
        method={"type": "supervised",
                "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 2}}},
    )
    deadline = time.monotonic() + 300
    while job.status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"job still {job.status}"
        time.sleep(0.5)
        job = client.fine_tuning.jobs.retrieve(job.id)
    assert job.status == "succeeded", job.error
    assert job.trained_tokens and job.trained_tokens > 0


def test_a_malformed_tool_call_is_refused_naming_line_and_field(client):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "get_weather", "arguments": "{city: Paris}"}}]},
        {"role": "tool", "tool_call_id": "c9", "content": "18 C"},
        {"role": "assistant", "content": "18 C.", "weight": 3},
    ]}
    data = "\n".join(json.dumps(r) for r in (good, bad)).encode()
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("bad-tools.jsonl", data), purpose="fine-tune")
    error = caught.value.body
    assert error["code"] == "invalid_jsonl" and error["param"] == "file"
    named = {(line["line"], line["field"]) for line in error["lines"]}
    assert named >= {
        (2, "messages[1].tool_calls[0].function.arguments"),
        (2, "messages[2].tool_call_id"),
        (2, "messages[3].weight"),
    }, error["lines"]
