"""The families tuneq trains beside Llama, each proven the way Llama is: on a tiny random
model built by transformers' own class from a shrunken copy of the real model's config
(`test_architectures.FAMILIES`: the fields that make the family differ kept as the real
model has them), with the tiny preset's tokenizer beside it:

- its logits, with and without an adapter, equal transformers' and PEFT's (fp32,
  max |diff| <= LOGITS_ATOL);
- one batch's loss and LoRA gradients equal a PEFT backward pass in float64
  (rel_max_err <= GRAD_RTOL, or within 2x PyTorch float32's own distance, the rule of
  test_grads.py);
- on the fused CPU path and on candle's graph (`TUNEQ_CPU_PATH=graph`, the CUDA path's
  arithmetic) alike;
- the adapter `tuneq train` writes loads with `PeftModel.from_pretrained` without a
  missing or unexpected key, and `tuneq merge` equals PEFT's `merge_and_unload`, which
  `AutoModelForCausalLM` loads and whose logits match.

transformers initialises every bias to zero and every norm to one; the builder here draws
them (biases N(0, 0.1²), as `tuneq model init` does), so a family's bias or norm that tuneq
ignored would show. (Larger biases make the last layer's q/k gradients ill-conditioned:
at N(0, 0.5²) PyTorch's own float32 is 1.5e-4 from float64 there.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import harness
from conftest import train_adapter
from harness import ALL_TARGETS, GRAD_RTOL, LOGITS_ATOL, MERGED_WEIGHT_ATOL
from test_architectures import FAMILIES, SHRUNK

TRAINED = ["qwen2", "qwen3", "mistral", "mistral-windowed", "gemma2", "gemma3_text",
           "gemma3-wide-window", "phi3", "phi4-mini"]
PATHS = ["fused", "graph"]

# Variants of a family: a Mistral whose window (16 positions) binds on the tests' 64
# tokens, as Mistral 7B v0.1's 4096 binds on longer sequences.
# A Gemma 3 whose window is the whole context still rotates its sliding layers with the
# local RoPE base.
# Phi-4-mini (a Phi-3 to transformers): three quarters of each head rotate, LongRoPE
# with its two factor lists (made-up values, distinct per frequency) from a pretraining
# context of 32 positions, which the tests' 64 tokens pass (so the long factors and the
# attention factor √(1 + ln 8 / ln 32) are the ones at work), and tied embeddings.
VARIANTS = {"mistral-windowed": ("mistral", dict(sliding_window=16)),
            "gemma3-wide-window": ("gemma3_text", dict(sliding_window=256)),
            "phi4-mini": ("phi3", dict(
                partial_rotary_factor=0.75, original_max_position_embeddings=32,
                tie_word_embeddings=True, sliding_window=None,
                rope_scaling=dict(rope_type="longrope",
                                  short_factor=[1.0, 1.05, 1.1, 1.3, 1.7, 2.4],
                                  long_factor=[1.0, 1.5, 2.5, 4.0, 7.0, 12.0])))}


def family_spec(family: str) -> tuple[str, str, dict]:
    """(config class, model class, config fields beyond SHRUNK) of `family` or a variant."""
    base, changed = VARIANTS.get(family, (family, {}))
    config_class, model_class, extra = FAMILIES[base]
    return config_class, model_class, {**extra, **changed}


def build_family(family: str, out: Path, tokenizer_from: Path) -> Path:
    """A tiny random `family` model with its biases and norms drawn (not transformers'
    zeros and ones), saved with the tiny preset's tokenizer."""
    config_class, model_class, extra = family_spec(family)
    config = getattr(transformers, config_class)(**SHRUNK, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out


class Family:
    """One family's tiny model and an adapter `tuneq train` trained on it (all seven
    projections, five steps at a high learning rate so that lora_B is far from zero)."""

    def __init__(self, tuneq, family: str, root: Path, tiny_model: Path, data: Path):
        self.model = build_family(family, root / "model", tiny_model)
        self.adapter = train_adapter(tuneq, self.model, data, root / "adapter",
                                     targets=ALL_TARGETS, r=8, alpha=16, rslora=False)


@pytest.fixture(scope="module")
def families(tuneq, tiny_model, chat_dataset, tmp_path_factory):
    made: dict[str, Family] = {}

    def get(family: str) -> Family:
        if family not in made:
            made[family] = Family(tuneq, family, tmp_path_factory.mktemp(family), tiny_model,
                                  chat_dataset)
        return made[family]

    return get


@pytest.fixture
def on_path(tuneq, request):
    """`tuneq` on the CPU path the test names."""
    def choose(path: str):
        tuneq.env.pop("TUNEQ_CPU_PATH", None)
        if path == "graph":
            tuneq.env["TUNEQ_CPU_PATH"] = "graph"
        return tuneq

    yield choose
    tuneq.env.pop("TUNEQ_CPU_PATH", None)


@pytest.mark.parametrize("family", TRAINED)
def test_logits_match_transformers_and_peft(families, tuneq, input_ids_file, tmp_path, family):
    """`tuneq debug logits` runs the graph's forward (the fused path's forward is held to
    PEFT's by the loss of test_loss_and_lora_grads_match_peft)."""
    made = families(family)
    ids_file, ids = input_ids_file
    base = harness.load_hf(made.model)
    assert type(base).__name__ == family_spec(family)[1]
    with torch.no_grad():
        want = base(input_ids=ids).logits.float()
    got = harness.tuneq_logits(tuneq, made.model, ids_file, tmp_path / "base.safetensors")
    diff = harness.max_abs_diff(got, want)
    print(f"{family}: base logits max |diff| {diff:.2e}")
    assert diff <= LOGITS_ATOL, f"base logits differ by {diff:.3e}"

    peft = harness.load_peft(made.model, made.adapter)
    with torch.no_grad():
        want_tuned = peft(input_ids=ids).logits.float()
    got_tuned = harness.tuneq_logits(tuneq, made.model, ids_file,
                                     tmp_path / "tuned.safetensors", made.adapter)
    diff = harness.max_abs_diff(got_tuned, want_tuned)
    print(f"{family}: adapter logits max |diff| {diff:.2e}")
    assert diff <= LOGITS_ATOL, f"adapter logits differ by {diff:.3e}"
    assert harness.max_abs_diff(want_tuned, want) > 100 * LOGITS_ATOL, \
        "the adapter changes nothing: the comparison would not notice it ignored"


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", TRAINED)
def test_loss_and_lora_grads_match_peft(families, on_path, input_ids_file, tmp_path,
                                        family, path):
    from test_grads import peft_loss_and_grads

    made, tuneq = families(family), on_path(path)
    ids_file, ids = input_ids_file
    ref_loss, ref_grads = peft_loss_and_grads(made.model, made.adapter, ids, torch.float64)
    _, fp32_grads = peft_loss_and_grads(made.model, made.adapter, ids, torch.float32)
    out = tmp_path / "grads.safetensors"
    tuneq.run("debug", "grads", "--model", made.model, "--adapter", made.adapter,
              "--input-ids", ids_file, "--out", out)
    got = load_file(str(out))
    loss_err = abs(float(got.pop("loss")) - float(ref_loss)) / abs(float(ref_loss))
    assert loss_err <= GRAD_RTOL, f"loss rel err {loss_err:.2e}"
    assert set(got) == set(ref_grads), sorted(set(got) ^ set(ref_grads))[:6]
    worst = {}
    for key, ref in ref_grads.items():
        err = harness.rel_max_err(got[key].double(), ref)
        floor = harness.rel_max_err(fp32_grads[key], ref)
        worst[key] = (err, floor)
        assert err <= max(GRAD_RTOL, 2 * floor), \
            f"{key}: rel err {err:.2e} (PyTorch fp32 {floor:.2e})"
    key, (err, floor) = max(worst.items(), key=lambda kv: kv[1][0])
    print(f"{family}/{path}: loss rel err {loss_err:.2e}; worst gradient {err:.2e} at {key} "
          f"(PyTorch fp32 {floor:.2e})")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", TRAINED)
def test_adamw_steps_over_padded_micro_batches_match_peft(families, on_path, tmp_path, family,
                                                          path):
    """Three AdamW steps of `tuneq debug steps` on each CPU path (the fused step every
    family trains on, and candle's graph, the CUDA path's arithmetic) against PEFT +
    torch.optim.AdamW: right-padded rows of unequal labelled counts accumulated over two
    micro-batches, clipping and weight decay, rows up to 20 tokens, past the windowed
    families' 16 (no row pads more than 12, so no padded position sees only padding, which
    PyTorch's eager Gemma 2 turns into NaN); every step's loss and adapter within
    GRAD_RTOL (test_steps.compare)."""
    from test_steps import compare, make_batches, peft_steps, run_tuneq

    made, tuneq = families(family), on_path(path)
    data = make_batches(6, 2, 20, seed=21, ragged=True)
    opts = dict(micro=2, lr=1e-3, max_grad_norm=1.0, weight_decay=0.01)
    ref = peft_steps(made.model, made.adapter, data, **opts)
    fp32 = peft_steps(made.model, made.adapter, data, dtype=torch.float32, **opts)
    steps, _, _ = run_tuneq(tuneq, tmp_path, made.model, made.adapter, data, micro_batches=2,
                            lr=1e-3, max_grad_norm=1.0, weight_decay=0.01)
    compare(f"{family}/{path}", steps, ref, fp32)


@pytest.mark.parametrize("family", TRAINED)
def test_merge_matches_peft_and_loads_in_transformers(families, tuneq, input_ids_file, tmp_path,
                                                      family):
    made = families(family)
    merged_dir = tmp_path / "merged"
    tuneq.run("merge", "--model", made.model, "--adapter", made.adapter, "--out", merged_dir)
    reference = harness.load_peft(made.model, made.adapter).merge_and_unload()
    reference.eval()
    ref_state = reference.state_dict()
    merged_tensors = harness.model_file_tensors(merged_dir)
    base_tensors = harness.model_file_tensors(made.model)
    assert set(merged_tensors) == set(base_tensors)
    for key, t in merged_tensors.items():
        d = harness.max_abs_diff(t.float(), ref_state[key].float())
        assert d <= MERGED_WEIGHT_ATOL, f"{key} differs from PEFT's merge by {d:.3e}"
        if key.endswith(".bias"):
            assert torch.equal(t, base_tensors[key]), f"{key}: a bias is not the adapter's to change"
    merged = harness.load_hf(merged_dir)
    _, ids = input_ids_file
    with torch.no_grad():
        diff = harness.max_abs_diff(merged(input_ids=ids).logits.float(),
                                    reference(input_ids=ids).logits.float())
    assert diff <= LOGITS_ATOL, f"merged logits differ by {diff:.3e}"


@pytest.mark.parametrize("family", ["mistral-windowed", "gemma2", "gemma3_text"])
def test_a_training_run_takes_the_fused_kernels(tuneq, tiny_model, chat_dataset, tmp_path,
                                                family):
    """Their logits and gradients (on both paths) are checked with the others above; here,
    a plain `tuneq train` of a Mistral whose window binds and of each Gemma takes the fused
    path (the checkpoint records it) and warns of nothing."""
    model = build_family(family, tmp_path / family, tiny_model)
    proc = tuneq.run("train", "--model", model, "--train-file", chat_dataset,
                     "--output", tmp_path / "out", "--max-steps", 1, "--max-seq-len", 64,
                     "--progress", "json", timeout=300)
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    warnings = [e for e in events if e.get("event") == "warning"]
    assert not warnings, warnings
    state = json.loads((tmp_path / "out" / "checkpoints" / "step-00000001"
                        / "trainer_state.json").read_text())
    assert state["compute"]["path"] == "cpu-fused", state["compute"]
    assert (tmp_path / "out" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("family", ["llama"] + TRAINED + ["real_model", "real_qwen2", "real_gemma3"])
def test_parameters_are_counted_as_transformers_counts_them(request, tuneq, tiny_model, tmp_path,
                                                             family):
    """`tuneq model estimate` (and a registered model's `details.parameters`, the same
    count) against `num_parameters()` of the model transformers loads: biases, norms and
    a tied head (counted once) included; on each tiny family and the real models."""
    if family.startswith("real_"):
        model_dir = request.getfixturevalue(family)
    elif family == "llama":
        model_dir = tiny_model
    else:
        model_dir = build_family(family, tmp_path / family, tiny_model)
    counted = json.loads(tuneq.run("model", "estimate", "--model", model_dir).stdout)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    assert counted["parameters"] == model.num_parameters(), family
