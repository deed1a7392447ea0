"""Writes a Llama 2 7B–shaped model with random bf16 weights, for measuring memory.

    python scripts/random_llama7b.py TOKENIZER_DIR OUT_DIR

Hidden 4096, intermediate 11008, 32 layers of 32 heads, vocab 32000, untied head: the
shape of Llama 2 7B, 12.55 GiB of bf16 in ten safetensors shards with an index. The
tokenizer files and the rest of config.json come from TOKENIZER_DIR, a folder that
`tuneq model init --preset small` wrote (its vocabulary has the same 32000 entries). The
weights are N(0, 0.02²), so the losses mean nothing; what the model is for is the memory
and the time of a 7B step (`tuneq train --progress json` reports `peak_memory_bytes`).
Nothing can be downloaded from a model hub here, and a real 7B checkpoint would be the
same bytes to the trainer.

It needs about 14 GiB of disk and two minutes; memory stays under 2 GiB (one shard of
four layers at a time). The folder is written beside OUT_DIR and renamed into place when
complete.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, INTERMEDIATE, LAYERS, HEADS, VOCAB = 4096, 11008, 32, 32, 32000
LAYERS_PER_SHARD = 4


def write(tokenizer_dir: Path, out: Path) -> None:
    config_path = tokenizer_dir / "config.json"
    if not config_path.is_file():
        sys.exit(f"random_llama7b: {config_path} is missing (write it with "
                 "`tuneq model init --preset small --out DIR`)")
    config = json.loads(config_path.read_text())
    if config.get("vocab_size") != VOCAB:
        sys.exit(f"random_llama7b: {tokenizer_dir}'s vocab_size is {config.get('vocab_size')}, "
                 f"not {VOCAB}")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, staging / f.name)
    config.update(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=HEADS, head_dim=HIDDEN // HEADS, vocab_size=VOCAB,
                  max_position_embeddings=4096, torch_dtype="bfloat16",
                  tie_word_embeddings=False)
    config.pop("rope_scaling", None)
    (staging / "config.json").write_text(json.dumps(config, indent=2))

    generator = torch.Generator().manual_seed(0)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    def ones() -> torch.Tensor:
        return torch.ones(HIDDEN, dtype=torch.bfloat16)

    layer_shards = LAYERS // LAYERS_PER_SHARD
    count = layer_shards + 2
    weight_map: dict[str, str] = {}
    total = 0

    def flush(index: int, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total
        name = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        save_file(tensors, str(staging / name), metadata={"format": "pt"})
        for key, tensor in tensors.items():
            weight_map[key] = name
            total += tensor.numel() * tensor.element_size()

    flush(0, {"model.embed_tokens.weight": normal(VOCAB, HIDDEN)})
    for s in range(layer_shards):
        tensors = {}
        for layer in range(s * LAYERS_PER_SHARD, (s + 1) * LAYERS_PER_SHARD):
            p = f"model.layers.{layer}."
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
                tensors[p + f"self_attn.{proj}.weight"] = normal(HIDDEN, HIDDEN)
            tensors[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
            tensors[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE, HIDDEN)
            tensors[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTERMEDIATE)
            tensors[p + "input_layernorm.weight"] = ones()
            tensors[p + "post_attention_layernorm.weight"] = ones()
        flush(1 + s, tensors)
        print(f"random_llama7b: layers {s * LAYERS_PER_SHARD}–{(s + 1) * LAYERS_PER_SHARD - 1}",
              flush=True)
    flush(count - 1, {"model.norm.weight": ones(), "lm_head.weight": normal(VOCAB, HIDDEN)})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    print(f"random_llama7b: {out} ({total / 2**30:.2f} GiB of weights)")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    write(Path(sys.argv[1]), Path(sys.argv[2]))
