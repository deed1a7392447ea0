"""`tuneq merge` writes W + scale*B*A in the base model's layout and dtype: transformers
loads it, its weights equal PEFT's merge_and_unload() (max |diff| <= 1e-5) and its logits
match (max |diff| <= 1e-4)."""

from __future__ import annotations

import pytest
import torch

import harness
from conftest import ADAPTERS, MODEL_FIXTURES
from harness import LOGITS_ATOL, MERGED_WEIGHT_ATOL

CASES = [("single", "all7"), ("sharded", "all7"), ("single", "rslora_qv")]


@pytest.mark.parametrize(("variant", "adapter_name"), CASES)
def test_merge_matches_peft_merge_and_unload(request, adapters, tuneq, input_ids_file, tmp_path,
                                             variant, adapter_name):
    base_dir = request.getfixturevalue(MODEL_FIXTURES[variant])
    adapter_dir = adapters.get(adapter_name)
    merged_dir = tmp_path / "merged"
    tuneq.run("merge", "--model", base_dir, "--adapter", adapter_dir, "--out", merged_dir)

    # Same files, same tensor -> shard assignment, same dtypes as the base.
    base_layout, merged_layout = harness.model_layout(base_dir), harness.model_layout(merged_dir)
    assert merged_layout["files"] == base_layout["files"], \
        f"merged files {merged_layout['files']}, base files {base_layout['files']}"
    assert merged_layout["weight_map"] == base_layout["weight_map"], "merged index weight_map differs from base"
    base_tensors = harness.model_file_tensors(base_dir)
    merged_tensors = harness.model_file_tensors(merged_dir)
    assert set(merged_tensors) == set(base_tensors), \
        f"tensor names differ: {sorted(set(merged_tensors) ^ set(base_tensors))[:6]}"
    for key, t in merged_tensors.items():
        assert t.dtype == base_tensors[key].dtype, f"{key}: merged dtype {t.dtype}, base {base_tensors[key].dtype}"

    peft_model = harness.load_peft(base_dir, adapter_dir)
    reference = peft_model.merge_and_unload()
    reference.eval()
    ref_state = reference.state_dict()

    worst_key, worst = None, 0.0
    for key, t in merged_tensors.items():
        ref = ref_state[key].to(t.dtype)
        d = harness.max_abs_diff(t.float(), ref.float())
        if d > worst:
            worst_key, worst = key, d
    print(f"{variant}/{adapter_name}: max |tuneq merge - peft merge| = {worst:.3e} at {worst_key}")
    assert worst <= MERGED_WEIGHT_ATOL, f"merged weight {worst_key} differs by {worst:.3e} > {MERGED_WEIGHT_ATOL:g}"

    # The merge must have changed every targeted weight (otherwise the comparison proves little).
    spec_targets = set(ADAPTERS[adapter_name]["targets"])
    for key in merged_tensors:
        module = key.rsplit(".", 2)[-2] if key.endswith(".weight") else ""
        if module in spec_targets:
            assert not torch.equal(merged_tensors[key], base_tensors[key]), f"{key} unchanged by merge"
        else:
            assert torch.equal(merged_tensors[key], base_tensors[key]), f"{key} is not targeted but changed"

    merged = harness.load_hf(merged_dir)
    _, ids = input_ids_file
    with torch.no_grad():
        got = merged(input_ids=ids).logits.float()
        ref = reference(input_ids=ids).logits.float()
    diff = harness.max_abs_diff(got, ref)
    print(f"{variant}/{adapter_name}: max |merged - peft merged| logits = {diff:.3e}")
    assert diff <= LOGITS_ATOL, f"merged logits differ by {diff:.3e} > {LOGITS_ATOL:g}"


def test_merged_dir_is_self_contained(tiny_model, adapters, tuneq, tmp_path):
    """A merged model is served on its own, so it carries the base's config and tokenizer."""
    from transformers import AutoTokenizer

    merged_dir = tmp_path / "merged"
    tuneq.run("merge", "--model", tiny_model, "--adapter", adapters.get("all7"), "--out", merged_dir)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (merged_dir / name).is_file(), f"merged model lacks {name}"
    base_cfg = harness.read_json(tiny_model / "config.json")
    merged_cfg = harness.read_json(merged_dir / "config.json")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "tie_word_embeddings"):
        assert merged_cfg.get(key) == base_cfg.get(key), f"config {key}: {merged_cfg.get(key)} vs {base_cfg.get(key)}"
    text = "Merged models keep the tokenizer."
    assert (AutoTokenizer.from_pretrained(str(merged_dir))(text).input_ids
            == AutoTokenizer.from_pretrained(str(tiny_model))(text).input_ids)
