"""Llama 3 `rope_scaling` (factor, low/high frequency bands, original context): a model
written with `tuneq model init --llama3-rope` gives the same logits in tuneq as in
transformers, and the scaling really changes the logits (so the check is not vacuous)."""

from __future__ import annotations

import json

import torch

import harness
from harness import LOGITS_ATOL


def logits_matching_transformers(tuneq, model_dir, input_ids_file, tmp_path, what: str) -> torch.Tensor:
    """tuneq's logits of `model_dir` (written under `tmp_path`), checked to be within
    LOGITS_ATOL of transformers' for the same input ids."""
    ids_file, ids = input_ids_file
    with torch.no_grad():
        ref = harness.load_hf(model_dir)(input_ids=ids).logits.float()
    got = harness.tuneq_logits(tuneq, model_dir, ids_file, tmp_path / "logits.safetensors")
    diff = harness.max_abs_diff(got, ref)
    print(f"{what}: max |tuneq - transformers| logits = {diff:.3e}")
    assert diff <= LOGITS_ATOL, f"max abs logits diff {diff:.3e} > {LOGITS_ATOL:g}"
    return got


def test_llama3_rope_scaling_matches_transformers(tuneq, input_ids_file, tmp_path):
    model_dir = tmp_path / "tiny-llama3-rope"
    tuneq.run("model", "init", "--preset", "tiny", "--seed", "4", "--out", model_dir, "--llama3-rope")
    config = harness.read_json(model_dir / "config.json")
    scaling = config.get("rope_scaling") or {}
    assert scaling.get("rope_type") == "llama3" and scaling.get("factor") == 8.0, scaling

    got = logits_matching_transformers(tuneq, model_dir, input_ids_file, tmp_path, "llama3 rope")

    # The same weights without scaling must give different logits.
    del config["rope_scaling"]
    (model_dir / "config.json").write_text(json.dumps(config))
    plain = harness.tuneq_logits(tuneq, model_dir, input_ids_file[0], tmp_path / "plain.safetensors")
    assert harness.max_abs_diff(plain, got) > 1e-3, "rope_scaling had no effect on the logits"


def test_rope_parameters_written_by_transformers_5_are_read(tuneq, input_ids_file, tmp_path):
    """transformers >= 5 saves `rope_parameters` (with rope_theta inside) instead of
    top-level `rope_theta`/`rope_scaling`; a model re-saved that way must give the same logits."""
    from transformers import LlamaConfig

    model_dir = tmp_path / "tiny-resaved"
    tuneq.run("model", "init", "--preset", "tiny", "--seed", "5", "--out", model_dir, "--llama3-rope")
    config = harness.read_json(model_dir / "config.json")
    config["rope_theta"] = 50000.0  # not the default, so falling back to 10000 would show
    (model_dir / "config.json").write_text(json.dumps(config))
    LlamaConfig.from_pretrained(model_dir).save_pretrained(model_dir)
    saved = harness.read_json(model_dir / "config.json")
    if "rope_parameters" not in saved:
        raise AssertionError(f"this transformers did not write rope_parameters: {sorted(saved)}")
    assert "rope_theta" not in saved, "expected rope_theta only inside rope_parameters"

    logits_matching_transformers(tuneq, model_dir, input_ids_file, tmp_path, "rope_parameters config")
