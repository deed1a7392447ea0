"""Models of families tuneq does not train are refused, naming the architecture or the field,
instead of being trained as if they were Llama (or another family tuneq trains).

Each model is a tiny random one built by transformers' own class from a shrunken copy of the
real model's configuration (the fields that make the family differ from Llama kept as the
real model has them), saved with `save_pretrained`, with the tiny preset's tokenizer beside it.
`tuneq train` must exit 42 (bad input, never retried) before any step, and `tuneq up --model`
must refuse to register the folder.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import transformers


# The shape every model is shrunk to (as the tiny preset, smaller still).
SHRUNK = dict(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

# model_type -> (config class, model class, what the real model's config sets beyond Llama's).
# test_families.py builds the ones tuneq trains (TRAINED) the same way.
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(head_dim=16, rope_theta=1000000.0, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(sliding_window=4096, rope_theta=1000000.0)),
    # Windows shorter than the tests' 64 tokens, so that they bind, and a scalar unlike
    # head_dim, so that a scale taken from the wrong one shows.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
                         rope_local_base_freq=10000.0,
                         layer_types=["sliding_attention", "full_attention"])),
    # Phi-3-mini-4k's window (2047, not binding at 256 positions); test_families.py's
    # phi4-mini variant adds Phi-4-mini's partial RoPE and LongRoPE.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(rope_theta=10000.0, sliding_window=2047)),
    # Phi-2: LayerNorm with biases, a parallel attention and MLP, partial RoPE.
    "phi": ("PhiConfig", "PhiForCausalLM", dict(partial_rotary_factor=0.4)),
}


def build(family: str, out: Path, tokenizer_from: Path) -> Path:
    config_class, model_class, extra = FAMILIES[family]
    config = getattr(transformers, config_class)(**SHRUNK, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == family, written["model_type"]
    return out


# The families tuneq trains (proven in test_families.py).
TRAINED = {"qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3"}


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - TRAINED))
def test_another_family_is_refused_by_the_trainer_naming_it(family, tuneq, tiny_model,
                                                            chat_dataset, tmp_path):
    model = build(family, tmp_path / family, tiny_model)
    proc = tuneq.run("train", "--model", model, "--train-file", chat_dataset,
                     "--output", tmp_path / "out", "--max-steps", 2, "--max-seq-len", 64,
                     expect_rc=42, timeout=300)
    assert f'"{family}" architecture is not supported' in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()


def test_another_family_is_refused_at_registration(tuneq, tiny_model, tmp_path):
    model = build("phi", tmp_path / "phi", tiny_model)
    proc = subprocess.run(
        [str(tuneq.binary), "up", "--port", "0", "--data-dir", str(tmp_path / "data"),
         "--model", f"my-phi={model}"],
        capture_output=True, text=True, timeout=120, env=tuneq.env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert '"phi" architecture is not supported' in proc.stderr, proc.stderr


@pytest.mark.parametrize("field,value", [
    ("attention_bias", True),
    ("hidden_act", "gelu_pytorch_tanh"),
    ("sliding_window", 32),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
])
def test_a_llama_with_a_field_tuneq_does_not_implement_is_refused_naming_it(
        field, value, tuneq, tiny_model, chat_dataset, tmp_path):
    model = tmp_path / "llama"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    config[field] = value
    (model / "config.json").write_text(json.dumps(config))
    proc = tuneq.run("train", "--model", model, "--train-file", chat_dataset,
                     "--output", tmp_path / "out", "--max-steps", 2, "--max-seq-len", 64,
                     expect_rc=42, timeout=300)
    assert f"field {field} = " in proc.stderr, proc.stderr


def test_a_llama_saved_by_transformers_still_trains(tuneq, tiny_model, chat_dataset, tmp_path):
    # The same check on the family tuneq trains: a LlamaForCausalLM config exactly as
    # transformers writes it (every field it saves) is not refused.
    config = transformers.LlamaConfig(**SHRUNK)
    torch.manual_seed(0)
    model = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(model)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model / name).exists():
            shutil.copy(tiny_model / name, model / name)
    tuneq.run("train", "--model", model, "--train-file", chat_dataset,
              "--output", tmp_path / "out", "--max-steps", 1, "--max-seq-len", 64,
              timeout=300)
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()
