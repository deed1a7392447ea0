"""Converts a GGUF file of a family tuneq trains (Llama, Qwen2, Gemma 3 text) into a Hugging
Face model folder.

    python scripts/gguf_to_hf.py [--chat-template FILE] MODEL.gguf OUT_DIR

A GGUF without a chat template (a pretrained model's) takes the one in FILE, when given.

transformers reads the GGUF (its tensors dequantized to float32, its tokenizer and chat
template rebuilt) and writes config.json, model.safetensors (float32), tokenizer.json,
tokenizer_config.json, chat_template.jinja and generation_config.json. The dequantized
weights are the quantized model's values exactly; they are not the original checkpoint's.

The folder is written beside OUT_DIR and renamed into place only after the saved model has
been read back and gives the GGUF model's logits, so an interrupted or wrong conversion
never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

PROBE = [{"role": "user", "content": "What is the capital of France?"}]
# The model types tuneq trains (tuneq_pools::Architecture).
TRAINED = ("llama", "qwen2", "gemma3_text")


def convert(gguf: Path, out: Path, chat_template: Path | None = None) -> None:
    if not gguf.is_file():
        sys.exit(f"gguf_to_hf: {gguf} is not a file")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if model.config.model_type not in TRAINED:
        sys.exit(f"gguf_to_hf: {gguf.name} holds a {model.config.model_type!r} model; "
                 f"tuneq trains {', '.join(TRAINED)} models")
    if chat_template is not None and not tokenizer.chat_template:
        tokenizer.chat_template = chat_template.read_text()
    # The dequantized weights are plain float32 tensors: the folder is an ordinary model,
    # not a quantized one, and transformers saves it only without the GGUF marker.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.eval()
    model.save_pretrained(str(partial), safe_serialization=True, max_shard_size="4GB")
    tokenizer.save_pretrained(str(partial))

    ids = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    reread = AutoModelForCausalLM.from_pretrained(str(partial), dtype=torch.float32).eval()
    if type(reread) is not type(model):
        sys.exit(f"gguf_to_hf: the saved folder loads as {type(reread).__name__}, "
                 f"the GGUF as {type(model).__name__}")
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = reread(input_ids=ids).logits
    if not torch.equal(want, got):
        sys.exit(f"gguf_to_hf: the saved model's logits differ from the GGUF model's "
                 f"(max |diff| {float((want - got).abs().max()):.3e}); {partial} kept for inspection")
    (partial / "tuneq-source.json").write_text(json.dumps({
        "gguf": gguf.name,
        "converted_by": "scripts/gguf_to_hf.py",
        "dtype": "float32 (dequantized)",
    }, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    print(f"gguf_to_hf: {gguf.name} -> {out} ({model.num_parameters() / 1e6:.0f}M parameters, "
          f"{model.config.num_hidden_layers} layers, vocabulary {model.config.vocab_size})")


if __name__ == "__main__":
    args = sys.argv[1:]
    template = None
    if args[:1] == ["--chat-template"] and len(args) >= 2:
        template, args = Path(args[1]).resolve(), args[2:]
    if len(args) != 2:
        sys.exit("usage: python scripts/gguf_to_hf.py [--chat-template FILE] MODEL.gguf OUT_DIR")
    convert(Path(args[0]).resolve(), Path(args[1]).resolve(), template)
