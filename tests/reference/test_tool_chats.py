"""OpenAI's chat shapes (tools, tool calls, tool results, weights, names, text parts, the
legacy functions) render, tokenise and take loss in tuneq exactly as transformers'
`apply_chat_template(messages, tools=…)` does, on `examples/data/openai-tools.jsonl`:

- with a template that renders tools itself (`examples/templates/chatml-tools.jinja`,
  set as a tiny model's own template): tuneq passes the messages and the tools through,
  tool-call arguments parsed, tool schemas written with Python's `json.dumps` spacing;
- with a `chat_template` list whose `tool_use` entry renders them: that one for records
  with tools, `default` for the rest, as transformers picks;
- with templates that do not (the tiny model's ChatML, SmolLM2's own): tuneq writes the
  tools, calls and results into plain messages, and transformers renders those;
- with a real model's own template that renders tools (Qwen2.5's, from the real Qwen2;
  Llama 3.2's and Mistral NeMo's, from their weightless tokenizers), on a copy of the file
  without the records that template itself refuses (ADAPTED).

`tuneq debug encode` prints, per record, the conversation as the template sees it
(messages and tools), the text, the token ids and the labels. The labels are rebuilt here
from transformers' renderings alone: a token takes loss where it overlaps an assistant
turn that is not weighted 0, the text between the conversation rendered up to the turn
with the generation prompt and rendered through it (trailing whitespace trimmed).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness import REPO_ROOT
from test_chat_template import expected_labels, hf_tokenizer_of

DATASET = REPO_ROOT / "examples" / "data" / "openai-tools.jsonl"
TOOLS_TEMPLATE = REPO_ROOT / "examples" / "templates" / "chatml-tools.jinja"
MAX_LEN = 4096


@pytest.fixture(scope="session")
def tools_model(tiny_model, tmp_path_factory):
    """The tiny model with a chat template of its own that renders tools."""
    out = tmp_path_factory.mktemp("models") / "tiny-tools"
    shutil.copytree(tiny_model, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = TOOLS_TEMPLATE.read_text()
    config_path.write_text(json.dumps(config))
    return out


@pytest.fixture(scope="session")
def tool_use_model(tiny_model, tmp_path_factory):
    """The tiny model with a `chat_template` list: its ChatML as `default`, and a
    template that renders tools as `tool_use`, which transformers takes when tools are
    passed."""
    out = tmp_path_factory.mktemp("models") / "tiny-tool-use"
    shutil.copytree(tiny_model, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = [{"name": "default", "template": config["chat_template"]},
                               {"name": "tool_use", "template": TOOLS_TEMPLATE.read_text()}]
    config_path.write_text(json.dumps(config))
    return out


def short_call_id(call_id: str) -> str:
    """tuneq's rule for a template that takes only 9-letter-or-digit call ids (Mistral's;
    README): the id's last 9 letters and digits, zero-padded in front."""
    kept = "".join(c for c in call_id if c.isascii() and c.isalnum())[-9:]
    return kept.rjust(9, "0")


def with_short_call_ids(messages: list) -> list:
    """`messages` as tuneq hands them to such a template."""
    out = json.loads(json.dumps(messages))
    for m in out:
        for call in m.get("tool_calls") or []:
            call["id"] = short_call_id(call["id"])
        if m.get("tool_call_id"):
            m["tool_call_id"] = short_call_id(m["tool_call_id"])
    return out


def with_empty_call_content(messages: list) -> list:
    """`messages` as tuneq hands them to a template that takes no null content (Qwen3's
    first templates test `'</think>' in message.content`, which jinja2 raises on for None
    too): "" for a turn that only calls tools."""
    return [{**m, "content": ""} if m.get("content") is None else m for m in messages]


def _mistral(record: dict) -> dict | None:
    return record if any(m["role"] == "user" for m in record["messages"]) else None


# Own templates that render tools but refuse some records of the file, for a reason of the
# template itself (transformers raises, or its own renderings cannot place the answer):
# each is compared on a copy of the file, the record rewritten or left out (None).
# - Llama 3.2's takes one tool call per assistant turn ("This model only supports single
#   tool-calls at once!"): record 2, with two parallel calls, is left out.
# - Mistral NeMo's takes strict user/assistant alternation after the system message:
#   record 4, with no user turn, is left out. It also takes only call ids of 9 letters or
#   digits, which tuneq shortens OpenAI's ids to (SHORT_IDS): transformers is given the
#   same. (It writes the system message and the tools into the last user turn only, so an
#   earlier answer follows other text than the rendering up to it: `answer_in` finds it.)
ADAPTED = {
    "llama3_2_tokenizer": lambda r: None if any(
        len(m.get("tool_calls") or []) > 1 for m in r["messages"]) else r,
    "mistral_nemo_tokenizer": _mistral,
}


def dataset_for(model: str, tmp_path) -> Path:
    """DATASET, or the copy of it that ADAPTED[model] makes."""
    if model not in ADAPTED:
        return DATASET
    out = tmp_path / f"{model}-tools.jsonl"
    with open(DATASET) as src, open(out, "w") as dst:
        for line in src:
            if line.strip() and (record := ADAPTED[model](json.loads(line))) is not None:
                dst.write(json.dumps(record) + "\n")
    return out


def tool_calls_in(path: Path) -> int:
    """The tool calls (and legacy function calls) the records of `path` make."""
    return sum(len(m.get("tool_calls") or []) + ("function_call" in m)
               for line in open(path) if line.strip() for m in json.loads(line)["messages"])


def render(tok, source, messages, tools, **kw):
    return tok.apply_chat_template(messages, tools=tools or None, chat_template=source,
                                   tokenize=False, **kw)


# The models whose template takes only 9-letter-or-digit call ids, and only string content.
SHORT_IDS = ("mistral_nemo_tokenizer",)
EMPTY_CALL_CONTENT = ("qwen3_tokenizer",)

# The models whose own template renders tools: the example template's, Qwen2.5's, Qwen3's
# (which drops an earlier answer's <think> block), Llama 3.2's and Mistral NeMo's.
RENDERS_TOOLS = ("tools_model", "real_qwen2", "qwen3_tokenizer", "llama3_2_tokenizer",
                 "mistral_nemo_tokenizer")


@pytest.mark.parametrize("model", ["tools_model", "tool_use_model", "tiny_model", "real_model",
                                   "real_qwen2", "qwen3_tokenizer", "llama3_2_tokenizer",
                                   "mistral_nemo_tokenizer"])
def test_openai_shapes_render_and_label_like_transformers(request, tuneq, tmp_path, model):
    model_dir = request.getfixturevalue(model)
    tok = hf_tokenizer_of(model_dir)
    data = dataset_for(model, tmp_path)
    out = tuneq.run("debug", "encode", "--model", model_dir, "--data", data,
                    "--chat-template", "model", "--max-seq-len", MAX_LEN).stdout
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    head, records = lines[0], lines[1:]
    source = head["template"]
    if model == "tool_use_model":
        # transformers picks `default` or `tool_use` itself, as tuneq must have.
        assert head["tool_use_template"] == TOOLS_TEMPLATE.read_text()
        source = None
    assert len(records) == sum(1 for line in open(data) if line.strip())
    labelled = calls = 0
    for n, record in enumerate(records, start=1):
        messages, tools = record["messages"], record["tools"]
        knows_tools = model in RENDERS_TOOLS or (model == "tool_use_model" and tools)
        if knows_tools:
            # The template gets the tools and the structured turns, arguments parsed.
            calls += sum(len(m.get("tool_calls", [])) for m in messages)
            assert all(isinstance(c["function"]["arguments"], dict)
                       for m in messages for c in m.get("tool_calls", []))
        else:
            # Written into plain messages: no tools, no calls, no tool role.
            assert tools == [] and all(m["role"] != "tool" and "tool_calls" not in m for m in messages)
            calls += sum(m["content"].count("<tool_call>") for m in messages if m["role"] == "assistant")
        if model in SHORT_IDS:
            messages = with_short_call_ids(messages)
        if model in EMPTY_CALL_CONTENT:
            messages = with_empty_call_content(messages)
        text = render(tok, source, messages, tools)
        assert record["text"] == text, f"record {n}: tuneq rendered\n{record['text']!r}\ntransformers\n{text!r}"
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert record["input_ids"] == ids[:MAX_LEN], f"record {n}: token ids differ"
        want = expected_labels(tok, source, messages, text, tools)[:MAX_LEN]
        assert record["labels"] == want, (f"record {n}: labels differ at positions "
                                          f"{[i for i, (a, b) in enumerate(zip(record['labels'], want)) if a != b][:10]}")
        labelled += sum(1 for label in want if label != -100)
    assert labelled > 0 and calls == tool_calls_in(data) > 0, "the comparison would be vacuous"
    print(f"{model}: {len(records)} records, {calls} tool calls, {labelled} labelled tokens agree")
