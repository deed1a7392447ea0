"""The chat templates, rendered by tuneq (minijinja) and by transformers (jinja2), agree on
every record of the shipped chat and alpaca datasets: the same text, the same token ids,
and loss on the same tokens. With the tiny preset's tokenizer, the real models' (SmolLM2,
Qwen2.5, Gemma 3), the weightless tokenizers of scripts/fetch-tokenizer (Qwen3, Mistral
NeMo, Llama 3.2, Gemma 2), and Phi-3's template (which closes every conversation with
`eos_token`) on the tiny tokenizer: MODELS, less the combinations of NOT_COMPARED.

`tuneq debug encode` prints each record as training sees it: the conversation, the
rendered text, the token ids and the labels. transformers renders the same conversation
with `apply_chat_template` and the same template source, and the labels are rebuilt
independently from transformers' renderings: a token takes loss where it overlaps an
assistant turn, i.e. the text between the conversation rendered up to that turn with the
generation prompt and the conversation rendered through it (trailing whitespace trimmed),
found in the whole conversation's text by the rules of `answer_in` where a template renders
an earlier answer otherwise once later turns follow (Phi-3, Qwen3, Mistral).
"""

from __future__ import annotations

import json

import pytest

from harness import REPO_ROOT

DATASETS = ["tiny-task-train.jsonl", "tiny-task-val.jsonl", "alpaca.jsonl"]
TEMPLATES = ["model", "chatml", "llama2", "alpaca"]
MAX_LEN = 4096


# The tiny preset's tokenizer, the real Qwen2's (Qwen2.5's 151k-token BPE and template), the
# real Gemma 3's (a 262k-token SentencePiece-style BPE with byte fallback, Gemma 3's template:
# system folded into the first user turn, `model` turns) and the real model's (a 49152-token
# byte-level BPE with its own chat template); and, without weights (scripts/fetch-tokenizer),
# Qwen3's, Mistral NeMo's (Tekken, a 131k-token BPE; [INST] turns, no spaces), Llama 3.2's
# (128k-token BPE; header turns under a dated system header) and Gemma 2's (a 256k-token
# SentencePiece-style BPE; no template of its own: the built-in ones only).
MODELS = ["tiny_model", "real_model", "real_qwen2", "real_gemma3", "qwen3_tokenizer",
          "mistral_nemo_tokenizer", "llama3_2_tokenizer", "gemma2_tokenizer",
          "phi3_template_model"]
_TOKENIZERS: dict = {}


def hf_tokenizer_of(model_dir):
    from transformers import AutoTokenizer

    if model_dir not in _TOKENIZERS:
        _TOKENIZERS[model_dir] = AutoTokenizer.from_pretrained(str(model_dir))
    return _TOKENIZERS[model_dir]


def closing_of(tok, source: str | None, tools: list | None) -> str:
    """What the template writes for a conversation of no messages: the closing a
    template like Phi-3's writes at the end of every conversation (`eos_token`).
    transformers refuses to render no messages, so its own Jinja compiler renders it."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = source or tok.chat_template
    if not isinstance(template, str):
        return ""
    try:
        return _compile_jinja_template(template).render(
            messages=[], tools=tools or None, add_generation_prompt=False,
            **tok.special_tokens_map)
    except Exception:
        return ""


# What opens and closes the reasoning block that Qwen3's and DeepSeek-R1's templates drop
# from an earlier answer once a later user turn follows.
REASONING_BLOCK = ("<think>", "</think>")


# Whitespace after a reasoning block whose every amount is tried as dropped; past it,
# only all of it (as tuneq's DROPPED_SPACES).
DROPPED_SPACES = 16


def answer_forms(answer: str) -> list[str]:
    """The answer as rendered last, then without a reasoning block it opens with (and each
    amount of the first DROPPED_SPACES characters of the whitespace after it, then all of
    it)."""
    forms = [answer]
    opening, closing = REASONING_BLOCK
    opened = answer.lstrip()
    if opened.startswith(opening) and closing in opened[len(opening):]:
        after = opened[len(opening):].split(closing, 1)[1]
        spaces = len(after) - len(after.lstrip())
        forms += [after[k:] for k in range(min(spaces, DROPPED_SPACES))] + [after[spaces:]]
    return forms


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def answer_in_through(before: str, through: str, i: int) -> tuple[int, str]:
    """Where turn i's answer starts in `through`, and its text: what `through` adds to
    `before`, or, where the template moves text out of the rendering up to the turn once
    the turn follows (Mistral's system message), what follows the longest end of `before`
    that `through` holds right where the two part."""
    if through.startswith(before):
        return len(before), through[len(before):]
    parted = common_prefix(before, through)
    rest = before[parted:]
    kept = [k for k in range(len(rest), 0, -1) if through[parted:parted + k] == rest[len(rest) - k:]]
    assert kept, f"message {i}: the rendering through it holds no end of the one before it"
    return parted + kept[0], through[parted + kept[0]:]


def answer_in(text: str, before: str, through: str, closing: str, i: int) -> tuple[int, str]:
    """Where turn i's answer starts in the whole conversation's text, and the text it has
    there: where `through` has it (`answer_in_through`) if `through` opens `text`; up to
    the template's closing where only `text` goes on without it (Phi-3); else at the first
    place after where `before` and `text` part at which `text` holds an end of `before` (a
    system message moved to the last user turn, Mistral) and then the answer, or the answer
    without its reasoning block (Qwen3)."""
    at, answer = answer_in_through(before, through, i)
    if text.startswith(through):
        return at, answer
    if closing and answer.endswith(closing) and text.endswith(closing) \
            and text.startswith(through[:-len(closing)]):
        return at, answer[:-len(closing)]
    parted = common_prefix(before, text)
    rest = before[parted:]
    found = []
    for form in answer_forms(answer):
        if not form.strip():
            continue
        starts = [parted + k for k in range(len(rest) + 1)
                  if rest.endswith(text[parted:parted + k]) and text.startswith(form, parted + k)]
        if starts:
            found.append((starts[0], form))
    assert found, f"message {i}: the answer is not in the whole conversation's rendering"
    return min(found, key=lambda f: f[0])


def expected_labels(tok, source: str, messages: list, text: str, tools: list | None = None) -> list[int]:
    """Loss on the assistant turns not weighted 0, from transformers' renderings alone.
    A turn's answer is what the conversation rendered through it adds to the one
    rendered up to it with the generation prompt, found in the whole conversation's
    text by `answer_in`'s rules; trailing whitespace takes no loss."""
    def render(upto, **kw):
        return tok.apply_chat_template(messages[:upto], tools=tools or None, chat_template=source,
                                       tokenize=False, **kw)

    closing = closing_of(tok, source, tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or message.get("weight") == 0 or i == 0:
            continue
        start, answer = answer_in(text, render(i, add_generation_prompt=True), render(i + 1),
                                  closing, i)
        end = start + len(answer.rstrip())
        if end > start:
            spans.append((start, end))
    encoding = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return [token if any(start < e and end > s for s, e in spans) else -100
            for token, (start, end) in zip(encoding["input_ids"], encoding["offset_mapping"])]


# Combinations that are not compared: Qwen3's tokenizer has no BOS, which Llama 2's
# template requires (transformers raises). Gemma 2's package ships no chat template:
# transformers has none to render with, and tuneq's `model` falls back to ChatML, which the
# `chatml` cases compare. (Qwen3's own template, which drops an earlier answer's <think>
# block, and Mistral NeMo's, which moves the system message to the last user turn, are
# compared on every file: `answer_in` finds their earlier answers.)
NOT_COMPARED = {("qwen3_tokenizer", "llama2"), ("gemma2_tokenizer", "model")}
CASES = [(m, d, t) for m in MODELS for d in DATASETS for t in TEMPLATES
         if (m, t) not in NOT_COMPARED and (m, t, d) not in NOT_COMPARED]


@pytest.mark.parametrize("model,dataset,template", CASES)
def test_tuneq_renders_and_labels_like_transformers(request, tuneq, model, dataset, template):
    model_dir = request.getfixturevalue(model)
    hf_tokenizer = hf_tokenizer_of(model_dir)
    path = REPO_ROOT / "examples" / "data" / dataset
    out = tuneq.run("debug", "encode", "--model", model_dir, "--data", path,
                    "--chat-template", template, "--max-seq-len", MAX_LEN).stdout
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    head, records = lines[0], lines[1:]
    assert len(records) == sum(1 for line in open(path) if line.strip()), "one line per record"
    source = head["template"]
    if template == "model":
        assert source == hf_tokenizer.chat_template, "the model's own template is the tokenizer's"
    # A tokenizer without one (Qwen3 has no BOS) renders it as nothing on both sides.
    assert (head["bos_token"] or None, head["eos_token"]) == (hf_tokenizer.bos_token,
                                                             hf_tokenizer.eos_token)
    labelled_total = 0
    for n, record in enumerate(records, start=1):
        messages = record["messages"]
        assert messages and any(m["role"] == "assistant" for m in messages), f"record {n}: no conversation"
        text = hf_tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False)
        assert record["text"] == text, f"record {n}: tuneq rendered\n{record['text']!r}\ntransformers\n{text!r}"
        ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert record["input_ids"] == ids[:MAX_LEN], f"record {n}: token ids differ"
        want = expected_labels(hf_tokenizer, source, messages, text)[:MAX_LEN]
        assert record["labels"] == want, (f"record {n}: labels differ at positions "
                                          f"{[i for i, (a, b) in enumerate(zip(record['labels'], want)) if a != b][:10]}")
        labelled_total += sum(1 for label in want if label != -100)
    assert labelled_total > 0, "no record took loss: the comparison would be vacuous"
    print(f"{model} {dataset} / {template}: {len(records)} records, {labelled_total} labelled tokens agree")
