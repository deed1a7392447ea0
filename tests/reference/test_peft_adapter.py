"""Adapters written by `tuneq train` are PEFT adapters: PEFT loads them with no missing or
unexpected keys, the config carries what PEFT / vLLM / LoRAX read, and `tuneq debug logits
--adapter` matches the PeftModel's logits (fp32, max |diff| <= 1e-4)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import harness
from conftest import ADAPTERS
from harness import LOGITS_ATOL

ADAPTER_NAMES = sorted(ADAPTERS)


@pytest.mark.parametrize("name", ADAPTER_NAMES)
def test_train_writes_run_directory(adapters, name):
    out = adapters.get(name)
    for f in ("adapter_config.json", "adapter_model.safetensors", "metrics.jsonl", "manifest.json"):
        assert (out / f).is_file(), f"tuneq train did not write {f}"
    harness.read_json(out / "manifest.json")
    lines = [ln for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert lines, "metrics.jsonl is empty"
    for i, ln in enumerate(lines, 1):
        try:
            json.loads(ln)
        except json.JSONDecodeError as e:
            pytest.fail(f"metrics.jsonl line {i} is not JSON ({e}): {ln[:200]}")


@pytest.mark.parametrize("name", ADAPTER_NAMES)
def test_adapter_config_has_what_loaders_read(adapters, name):
    from peft import LoraConfig

    spec = ADAPTERS[name]
    cfg = harness.read_json(adapters.get(name) / "adapter_config.json")
    # PEFT dispatches on peft_type; vLLM requires r, lora_alpha, target_modules; LoRAX reads
    # r, target_modules, fan_in_fan_out, lora_alpha, use_rslora.
    for key in ("peft_type", "task_type", "r", "lora_alpha", "target_modules", "bias", "use_rslora",
                "use_dora", "fan_in_fan_out", "base_model_name_or_path"):
        assert key in cfg, f"adapter_config.json lacks {key!r}: {sorted(cfg)}"
    assert cfg["peft_type"] == "LORA"
    assert cfg["task_type"] == "CAUSAL_LM"
    assert cfg["r"] == spec["r"]
    assert float(cfg["lora_alpha"]) == float(spec["alpha"])
    assert isinstance(cfg["target_modules"], list), "target_modules should be a list of module names"
    assert sorted(cfg["target_modules"]) == sorted(spec["targets"])
    assert cfg["use_rslora"] is spec["rslora"]
    # vLLM rejects these; anything else changes the maths.
    assert cfg["bias"] == "none"
    assert cfg["use_dora"] is False
    assert cfg["fan_in_fan_out"] is False
    assert cfg.get("modules_to_save") in (None, [])
    assert not cfg.get("rank_pattern") and not cfg.get("alpha_pattern"), "per-module rank/alpha not expected"
    assert float(cfg.get("lora_dropout", 0.0)) == 0.0

    loaded = LoraConfig.from_pretrained(str(adapters.get(name)))
    assert loaded.r == spec["r"] and loaded.use_rslora is spec["rslora"]
    assert set(loaded.target_modules) == set(spec["targets"])


@pytest.mark.parametrize("name", ADAPTER_NAMES)
def test_adapter_tensors_are_peft_names_and_shapes(adapters, tiny_model, name):
    spec = ADAPTERS[name]
    path = adapters.get(name) / "adapter_model.safetensors"
    meta = harness.safetensors_metadata(path)
    assert meta.get("format") == "pt", f"adapter safetensors metadata {meta}, want format=pt"

    tensors = load_file(str(path))
    want = harness.expected_lora_shapes(harness.read_json(tiny_model / "config.json"), spec["targets"], spec["r"])
    assert set(tensors) == set(want), (f"extra keys {sorted(set(tensors) - set(want))[:6]}, "
                                       f"missing keys {sorted(set(want) - set(tensors))[:6]}")
    for key, t in tensors.items():
        assert tuple(t.shape) == want[key], f"{key}: shape {tuple(t.shape)}, want {want[key]}"
        assert t.dtype == torch.float32, f"{key}: dtype {t.dtype} (base is fp32)"
        assert torch.isfinite(t).all(), f"{key}: non-finite values"
        if ".lora_B." in key:
            assert float(t.abs().max()) > 0, f"{key} is all zeros after training at lr 1e-2"


@pytest.mark.parametrize("name", ADAPTER_NAMES)
def test_peft_loads_adapter_exactly(adapters, tiny_model, name):
    adapter_dir = adapters.get(name)
    model = harness.load_peft(tiny_model, adapter_dir)

    # A second load through load_adapter returns PEFT's own account of the key match.
    result = model.load_adapter(str(adapter_dir), adapter_name="probe")
    assert not result.missing_keys, f"PEFT missing keys: {result.missing_keys[:6]}"
    assert not result.unexpected_keys, f"PEFT unexpected keys: {result.unexpected_keys[:6]}"

    stored = load_file(str(adapter_dir / "adapter_model.safetensors"))
    loaded = harness.lora_params(model)
    assert set(loaded) == set(stored), (f"PeftModel has {sorted(set(loaded) - set(stored))[:6]} not in the file, "
                                        f"file has {sorted(set(stored) - set(loaded))[:6]} not in the model")
    for key, t in stored.items():
        assert torch.equal(loaded[key].detach(), t), f"{key}: PEFT holds different values than the file"

    spec = ADAPTERS[name]
    want_scale = spec["alpha"] / (spec["r"] ** 0.5 if spec["rslora"] else spec["r"])
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.scaling["default"] == pytest.approx(want_scale)


@pytest.mark.parametrize("name", ADAPTER_NAMES)
def test_adapter_logits_match_peft(adapters, tiny_model, tuneq, input_ids_file, tmp_path, name):
    adapter_dir = adapters.get(name)
    ids_file, ids = input_ids_file

    model = harness.load_peft(tiny_model, adapter_dir)
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()
        with model.disable_adapter():
            base = model(input_ids=ids).logits.float()
    effect = harness.max_abs_diff(ref, base)
    # Guard against a vacuous pass: the adapter must move the logits far more than the tolerance.
    assert effect > 100 * LOGITS_ATOL, f"adapter barely changes the logits (max {effect:.2e}); training too weak"

    got = harness.tuneq_logits(tuneq, tiny_model, ids_file, tmp_path / "logits.safetensors", adapter_dir=adapter_dir)
    diff = harness.max_abs_diff(got, ref)
    print(f"{name}: max |tuneq - peft| logits = {diff:.3e}; adapter effect {effect:.3e}")
    assert diff <= LOGITS_ATOL, f"{name}: max abs logits diff {diff:.3e} > {LOGITS_ATOL:g}"
