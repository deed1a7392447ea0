"""The files API through the official `openai` Python SDK, as a customer would call it."""

from __future__ import annotations

import json

import openai
import pytest

CHATS = [
    {"messages": [{"role": "user", "content": f"question {i}"},
                  {"role": "assistant", "content": f"answer {i}"}]}
    for i in range(12)
]


def jsonl(records) -> bytes:
    return ("\n".join(json.dumps(r) for r in records) + "\n").encode()


def test_upload_list_retrieve_download_delete(client):
    data = jsonl(CHATS)
    uploaded = client.files.create(file=("train.jsonl", data), purpose="fine-tune")
    assert uploaded.id.startswith("file-")
    assert uploaded.object == "file"
    assert uploaded.bytes == len(data)
    assert uploaded.filename == "train.jsonl"
    assert uploaded.purpose == "fine-tune"
    assert uploaded.status == "processed"
    extra = uploaded.model_extra or {}
    assert extra["validation"]["format"] == "chat"
    assert extra["validation"]["examples"] == 12

    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.files.content(uploaded.id).read() == data
    assert uploaded.id in [f.id for f in client.files.list()]

    deleted = client.files.delete(uploaded.id)
    assert deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_pages_follow_the_after_cursor(client):
    ids = [client.files.create(file=(f"f{i}.jsonl", jsonl(CHATS[:2])), purpose="fine-tune").id
           for i in range(5)]
    first = client.files.list(limit=2)
    assert len(first.data) == 2
    assert first.has_more
    seen = [f.id for f in client.files.list(limit=2)]  # the SDK's auto-pagination follows `after`
    for id in ids:
        assert id in seen
    for id in ids:
        client.files.delete(id)


def test_a_bad_dataset_is_a_400_naming_the_lines(client):
    bad = b'{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n'
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("bad.jsonl", bad), purpose="fine-tune")
    error = caught.value.body
    assert error["code"] == "invalid_jsonl"
    assert error["param"] == "file"
    assert {line["line"] for line in error["lines"]} >= {2}


def test_a_wrong_key_is_an_authentication_error(service):
    from openai import OpenAI

    stranger = OpenAI(base_url=f"{service.url}/v1", api_key="tq_" + "0" * 40, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.files.list()


def test_uploads_report_token_statistics_with_a_models_tokenizer(client, service):
    long_answer = " ".join(f"word{i}" for i in range(2000))
    records = [*CHATS, {"messages": [{"role": "user", "content": "say a lot"},
                                     {"role": "assistant", "content": long_answer}]}]
    uploaded = client.files.create(file=("train.jsonl", jsonl(records)), purpose="fine-tune")
    tokens = uploaded.model_extra["validation"]["tokens"]
    # `tuneq up` registers the demo model with local files: its tokenizer counts.
    assert tokens["model"] == "tuneq-tiny-demo"
    assert tokens["max_seq_len"] == 512
    assert tokens["truncated"] == 1, "the long example is cut at max_seq_len"
    assert tokens["max_len"] == 512
    assert 0 < tokens["min_len"] <= tokens["mean_len"] <= tokens["max_len"]
    assert abs(tokens["mean_len"] * len(records) - tokens["tokens"]) < 1e-6 * tokens["tokens"] + 1
    assert 0 < tokens["trained_tokens"] < tokens["tokens"], "only the answers carry a loss"
    assert tokens["unlabelled"] == 0

    # Naming a model that does not exist is refused, and nothing is stored.
    import urllib.error
    import urllib.request

    before = len(list(client.files.list()))
    request = urllib.request.Request(
        f"{service.url}/v1/files?filename=t.jsonl&model=no-such-model", method="POST",
        data=jsonl(CHATS), headers=service.headers())
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=30)
    assert err.value.code == 400
    body = json.loads(err.value.read())
    assert body["error"]["param"] == "model" and body["error"]["code"] == "model_not_found"
    assert len(list(client.files.list())) == before
