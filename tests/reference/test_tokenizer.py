"""The tokenizer `tuneq model init` writes is an HF tokenizer: AutoTokenizer loads it,
encoding round-trips through decoding, and the shipped chat template renders with
apply_chat_template (and has the prefix property the trainer's label mask relies on)."""

from __future__ import annotations

import pytest

import harness

SAMPLES = {
    "ascii": "Hello, world! The quick brown fox jumps over the lazy dog.",
    "whitespace": "  two leading spaces,\nnew lines\tand tabs   and runs of spaces",
    "digits": "3.14159 is close to pi; 2 + 2 = 4 and 1,000,000 is a million.",
    "code": 'def f(x):\n    return {"a": [x, x * 2]}  # comment',
    "unicode": "naïve café, Grüße, 東京, emoji 🙂 and — dashes",
}

CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris is the capital of France."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome is the capital of Italy."},
]


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    assert tok.is_fast, "expected a fast (tokenizer.json) tokenizer"
    return tok


def test_tokenizer_matches_model(hf_tokenizer, tiny_model):
    config = harness.read_json(tiny_model / "config.json")
    assert len(hf_tokenizer) <= config["vocab_size"], \
        f"tokenizer has {len(hf_tokenizer)} tokens, model vocab_size is {config['vocab_size']}"
    assert hf_tokenizer.eos_token is not None, "tokenizer has no eos_token"
    eos_id = hf_tokenizer.convert_tokens_to_ids(hf_tokenizer.eos_token)
    gen = harness.read_json(tiny_model / "generation_config.json")
    for source, value in (("config.json", config.get("eos_token_id")),
                          ("generation_config.json", gen.get("eos_token_id"))):
        ids = value if isinstance(value, list) else [value]
        assert eos_id in ids, f"tokenizer eos {hf_tokenizer.eos_token!r}={eos_id}, {source} eos_token_id={value}"
    if hf_tokenizer.bos_token is not None and config.get("bos_token_id") is not None:
        assert hf_tokenizer.convert_tokens_to_ids(hf_tokenizer.bos_token) == config["bos_token_id"]


@pytest.mark.parametrize("sample", sorted(SAMPLES))
def test_encode_decode_round_trip(hf_tokenizer, tiny_model, sample):
    from tokenizers import Tokenizer

    text = SAMPLES[sample]
    ids = hf_tokenizer(text, add_special_tokens=False).input_ids
    assert ids and all(0 <= i < len(hf_tokenizer) for i in ids)
    # The raw tokenizers library (what the Rust side uses) gives the same ids.
    raw = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    assert raw.encode(text, add_special_tokens=False).ids == ids
    unk = hf_tokenizer.unk_token_id
    assert unk is None or unk not in ids, f"{sample}: text encodes to the unknown token"
    assert hf_tokenizer.decode(ids) == text, f"{sample}: decode(encode(text)) != text"


def test_chat_template_renders(hf_tokenizer):
    rendered = hf_tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert isinstance(rendered, str) and rendered
    pos = 0
    for m in CHAT:  # every message appears, in order
        i = rendered.find(m["content"], pos)
        assert i >= 0, f"{m['content']!r} missing or out of order in the rendered chat:\n{rendered}"
        pos = i + len(m["content"])

    ids = hf_tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)
    assert ids == hf_tokenizer(rendered, add_special_tokens=False).input_ids, \
        "tokenizing the rendered chat differs from apply_chat_template(tokenize=True)"


@pytest.mark.parametrize("turns", [1, 2])
def test_generation_prompt_is_prefix_of_conversation(hf_tokenizer, turns):
    """The trainer masks the prompt by rendering it with add_generation_prompt=True and the full
    conversation separately; that only works when the former is a prefix of the latter."""
    conversation = CHAT[: 2 * turns]
    prompt = hf_tokenizer.apply_chat_template(conversation[:-1], tokenize=False, add_generation_prompt=True)
    full = hf_tokenizer.apply_chat_template(conversation, tokenize=False)
    assert full.startswith(prompt), f"prompt is not a prefix of the conversation:\n{prompt!r}\n{full!r}"
    assert conversation[-1]["content"] not in prompt
