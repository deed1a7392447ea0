"""`tuneq model init` writes an HF Llama that transformers loads, and `tuneq debug logits`
computes the same logits as `LlamaForCausalLM` (fp32, max |diff| <= 1e-4)."""

from __future__ import annotations

import pytest
import torch

import harness
from conftest import MODEL_FIXTURES
from harness import LOGITS_ATOL, TINY

REQUIRED_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]


@pytest.mark.parametrize("variant", sorted(MODEL_FIXTURES))
def test_model_init_writes_hf_layout(request, variant):
    model_dir = request.getfixturevalue(MODEL_FIXTURES[variant])
    for name in REQUIRED_FILES:
        assert (model_dir / name).is_file(), f"model init did not write {name}"
    assert harness.read_json(model_dir / "tokenizer_config.json").get("chat_template"), \
        "tokenizer_config.json has no chat_template"

    config = harness.read_json(model_dir / "config.json")
    assert config.get("model_type") == "llama", config.get("model_type")
    assert "LlamaForCausalLM" in config.get("architectures", []), config.get("architectures")
    for key, want in TINY.items():
        assert config.get(key) == want, f"config.json {key} = {config.get(key)}, tiny preset has {want}"

    layout = harness.model_layout(model_dir)
    tensors = harness.model_file_tensors(model_dir)
    if variant == "sharded":
        k = 3
        want_files = [f"model-{i:05d}-of-{k:05d}.safetensors" for i in range(1, k + 1)]
        assert layout["files"] == want_files, f"shards {layout['files']}, want {want_files}"
        assert not (model_dir / "model.safetensors").exists(), "sharded model also has model.safetensors"
        assert set(layout["weight_map"]) == set(tensors), "index weight_map does not list exactly the stored tensors"
    else:
        assert (model_dir / "model.safetensors").is_file()
        assert not (model_dir / "model.safetensors.index.json").exists()

    tied = variant == "tied"
    assert bool(config.get("tie_word_embeddings", False)) == tied
    assert ("lm_head.weight" in tensors) != tied, \
        "lm_head.weight must be stored exactly when embeddings are not tied"
    n_layers = TINY["num_hidden_layers"]
    want = {"model.embed_tokens.weight", "model.norm.weight"}
    if not tied:
        want.add("lm_head.weight")
    for i in range(n_layers):
        p = f"model.layers.{i}."
        want |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        want |= {f"{p}self_attn.{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
        want |= {f"{p}mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")}
    assert set(tensors) == want, f"unexpected tensor set: extra {sorted(set(tensors) - want)}, missing {sorted(want - set(tensors))}"


@pytest.mark.parametrize("variant", sorted(MODEL_FIXTURES))
def test_logits_match_transformers(request, tuneq, input_ids_file, tmp_path, variant):
    model_dir = request.getfixturevalue(MODEL_FIXTURES[variant])
    ids_file, ids = input_ids_file

    model = harness.load_hf(model_dir)
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()

    got = harness.tuneq_logits(tuneq, model_dir, ids_file, tmp_path / "logits.safetensors")
    assert tuple(got.shape) == (2, 64, TINY["vocab_size"]), f"logits shape {tuple(got.shape)}"
    diff = harness.max_abs_diff(got, ref)
    print(f"{variant}: max |tuneq - transformers| logits = {diff:.3e} (max |ref| {float(ref.abs().max()):.3e})")
    assert diff <= LOGITS_ATOL, f"{variant}: max abs logits diff {diff:.3e} > {LOGITS_ATOL:g}"
