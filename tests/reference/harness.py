"""Helpers of the reference suite: run the `tuneq` binary, load the same files with
transformers / PEFT, and compare tensors with stated tolerances.

Tolerances (the acceptance criteria of the reference suite):
- logits, tuneq vs transformers/PEFT, fp32:            max |diff| <= LOGITS_ATOL
- loss and LoRA gradients, tuneq vs PEFT backward:     rel_max_err <= GRAD_RTOL (see `rel_max_err`)
- merged weights, tuneq merge vs PEFT merge_and_unload: max |diff| <= MERGED_WEIGHT_ATOL
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

REPO_ROOT = Path(__file__).resolve().parents[2]

LOGITS_ATOL = 1e-4
GRAD_RTOL = 1e-4
MERGED_WEIGHT_ATOL = 1e-5

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTN_TARGETS = {"q_proj", "k_proj", "v_proj", "o_proj"}

# The tiny preset as the issue defines it.
TINY = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4)

THREADS = int(os.environ.get("TUNEQ_TEST_THREADS", "2"))


def _tail(text: str, n: int = 6000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


class Tuneq:
    """Runs the tuneq binary; any unexpected exit status fails the test with stderr attached."""

    def __init__(self, binary: Path):
        self.binary = binary
        self.env = dict(os.environ)
        self.env.setdefault("RAYON_NUM_THREADS", str(THREADS))
        self.env.setdefault("OMP_NUM_THREADS", str(THREADS))
        self.env.setdefault("RUST_BACKTRACE", "1")

    def run(self, *args, expect_rc: int = 0, timeout: float = 900) -> subprocess.CompletedProcess:
        cmd = [str(self.binary), *map(str, args)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                                  timeout=timeout, env=self.env, cwd=REPO_ROOT)
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"`{shlex.join(cmd)}` timed out after {timeout} s\n"
                        f"--- stderr ---\n{_tail((e.stderr or b'').decode(errors='replace'))}",
                        pytrace=False)
        took = time.perf_counter() - t0
        print(f"[tuneq] {shlex.join(cmd)}  -> rc {proc.returncode} in {took:.1f} s")
        if proc.returncode != expect_rc:
            pytest.fail(f"`{shlex.join(cmd)}` exited with {proc.returncode} (expected {expect_rc})\n"
                        f"--- stdout ---\n{_tail(proc.stdout, 2000)}\n"
                        f"--- stderr ---\n{_tail(proc.stderr)}", pytrace=False)
        return proc


def find_tuneq() -> Path:
    """TUNEQ_BIN (relative paths are taken from the repo root), default target/debug/tuneq."""
    raw = os.environ.get("TUNEQ_BIN", "target/debug/tuneq")
    path = Path(raw)
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not (path.is_file() and os.access(path, os.X_OK)):
        pytest.fail(f"tuneq binary not found or not executable at {path} (TUNEQ_BIN={raw!r}).\n"
                    f"Build it with `cargo build` in {REPO_ROOT}, or set TUNEQ_BIN.", pytrace=False)
    return path


# The real models scripts/fetch-real-model writes, and the weightless tokenizers
# scripts/fetch-tokenizer writes: name -> (environment variable, folder).
REAL_MODELS = {
    "smollm2": ("TUNEQ_REAL_MODEL", "smollm2-135m-instruct-q4_1"),
    "qwen2": ("TUNEQ_REAL_QWEN2", "qwen2.5-coder-0.5b-instruct-q4_k_m"),
    "gemma3": ("TUNEQ_REAL_GEMMA3", "gemma-3-270m-q4_k_m"),
    # Tokenizers and chat templates without weights (`scripts/fetch-tokenizer FAMILY`, the
    # family being the name less `-tokenizer`; `scripts/fetch-tokenizer all` writes them all).
    "qwen3-tokenizer": ("TUNEQ_QWEN3_TOKENIZER", "qwen3-tokenizer"),
    "mistral-nemo-tokenizer": ("TUNEQ_MISTRAL_NEMO_TOKENIZER", "mistral-nemo-tokenizer"),
    "llama3.2-tokenizer": ("TUNEQ_LLAMA3_2_TOKENIZER", "llama3.2-tokenizer"),
    "gemma2-tokenizer": ("TUNEQ_GEMMA2_TOKENIZER", "gemma2-tokenizer"),
}


def fetcher(name: str) -> str:
    """The command that writes the folder of REAL_MODELS[name]."""
    if name.endswith("-tokenizer"):
        return f"scripts/fetch-tokenizer {name.removesuffix('-tokenizer')}"
    return f"scripts/fetch-real-model {name}"


def find_real_model(name: str = "smollm2") -> Path:
    """The real model `name` (REAL_MODELS): its environment variable, default
    target/models/<folder> (what `scripts/fetch-real-model NAME` or
    `scripts/fetch-tokenizer FAMILY` writes); a loud failure naming that script when it
    is missing."""
    variable, folder = REAL_MODELS[name]
    raw = os.environ.get(variable, f"target/models/{folder}")
    path = Path(raw)
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not (path / "config.json").is_file():
        pytest.fail(f"the real model {name} is missing at {path} ({variable}={raw!r}).\n"
                    f"Fetch it with `{fetcher(name)}` (scripts/test does).",
                    pytrace=False)
    return path


# ----------------------------------------------------------------------------------- files

def read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def write_input_ids(path: Path, ids: torch.Tensor) -> Path:
    save_file({"input_ids": ids.to(torch.int64).contiguous()}, str(path))
    return path


def random_input_ids(vocab_size: int, batch: int = 2, seq: int = 64, seed: int = 1234) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq), generator=g, dtype=torch.int64)


def safetensors_metadata(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def model_layout(model_dir: Path) -> dict:
    """How a model directory stores its weights: {"files": [...], "weight_map": {...} or None}."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json(index)["weight_map"]
        return {"files": sorted(set(weight_map.values())), "weight_map": weight_map}
    return {"files": ["model.safetensors"], "weight_map": None}


def model_file_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a (possibly sharded) safetensors checkpoint, as stored on disk."""
    tensors: dict[str, torch.Tensor] = {}
    for name in model_layout(model_dir)["files"]:
        part = load_file(str(model_dir / name))
        overlap = tensors.keys() & part.keys()
        assert not overlap, f"{model_dir}: tensors stored twice: {sorted(overlap)[:5]}"
        tensors.update(part)
    return tensors


# ----------------------------------------------------------------------------------- tuneq

def tuneq_logits(tuneq: Tuneq, model_dir: Path, ids_file: Path, out_file: Path,
                 adapter_dir: Path | None = None) -> torch.Tensor:
    args = ["debug", "logits", "--model", model_dir, "--input-ids", ids_file, "--out", out_file]
    if adapter_dir is not None:
        args += ["--adapter", adapter_dir]
    tuneq.run(*args)
    out = load_file(str(out_file))
    assert "logits" in out, f"{out_file} has no 'logits' tensor (has {sorted(out)})"
    logits = out["logits"]
    assert logits.dtype == torch.float32, f"logits dtype {logits.dtype}, want float32"
    return logits


# ----------------------------------------------------------------------------------- HF / PEFT

def load_hf(model_dir: Path):
    """The folder's causal LM class (LlamaForCausalLM, Qwen2ForCausalLM, …, as its
    config.json names it) in fp32, eval mode; fails on any missing/unexpected/mismatched
    key."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                       output_loading_info=True)
    problems = {k: v for k, v in info.items() if k != "error_msgs" and v}
    if info.get("error_msgs"):
        problems["error_msgs"] = info["error_msgs"]
    assert not problems, f"transformers could not load {model_dir} cleanly: {problems}"
    model.eval()
    return model


def load_peft(model_dir: Path, adapter_dir: Path, trainable: bool = False):
    """PeftModel over a fresh HF base; fails if PEFT reports missing or unexpected adapter keys."""
    import warnings

    from peft import PeftModel

    base = load_hf(model_dir)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=trainable)
    key_warnings = [str(w.message) for w in caught
                    if any(s in str(w.message).lower() for s in ("missing", "unexpected", "adapter keys"))]
    assert not key_warnings, f"PEFT warned while loading {adapter_dir}: {key_warnings}"
    model.train() if trainable else model.eval()
    return model


def lora_params(peft_model, adapter_name: str = "default") -> dict[str, torch.nn.Parameter]:
    """The LoRA factors of one adapter of a PeftModel, under their adapter-file keys."""
    return {n.replace(f".{adapter_name}.", "."): p for n, p in peft_model.named_parameters()
            if (".lora_A." in n or ".lora_B." in n) and f".{adapter_name}." in n}


def expected_lora_shapes(config: dict, targets, r: int) -> dict[str, tuple[int, ...]]:
    """Adapter-file key -> shape for every targeted projection of every layer (A [r, in], B [out, r])."""
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    io = {
        "q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }
    shapes = {}
    for layer in range(config["num_hidden_layers"]):
        for t in targets:
            block = "self_attn" if t in ATTN_TARGETS else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{t}"
            fan_in, fan_out = io[t]
            shapes[f"{prefix}.lora_A.weight"] = (r, fan_in)
            shapes[f"{prefix}.lora_B.weight"] = (fan_out, r)
    return shapes


# ----------------------------------------------------------------------------------- comparisons

def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    return float((a.double() - b.double()).abs().max())


def rel_max_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max|got - ref| / max|ref| over the whole tensor.

    Gradient entries span several orders of magnitude and many sit near zero, so an
    element-wise relative error is dominated by noise on the tiny entries. Normalising the
    worst absolute error by the tensor's largest reference magnitude measures the error on
    the scale that matters for an optimizer step, and it is independent of the loss scale
    (the same bound holds whether a gradient is 1e-6 or 1e+2 overall).
    """
    assert got.shape == ref.shape, f"shape {tuple(got.shape)} vs {tuple(ref.shape)}"
    scale = float(ref.double().abs().max())
    err = float((got.double() - ref.double()).abs().max())
    if scale == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return err / scale
