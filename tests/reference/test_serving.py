"""What `/v1/chat/completions` serves against transformers + PEFT: a real `tuneq up`
fine-tunes a tiny random model of each family tuneq trains (Llama, Qwen2 with its q/k/v
biases, Qwen3 with its q/k head norms, Mistral, the Gemmas, Phi-3 with `tuneq model init`'s
Phi-4-mini-like partial RoPE and LongRoPE, whose answers cross its pretraining context of
32 positions) in a job like any client's, then answers chat requests greedily with the base model and with the job's adapter, and each answer must be the one
transformers' `generate` gives — PEFT's `PeftModel` over the same adapter file for the
fine-tuned model — token for token (each token compared through its text, which the
answer's `logprobs` carry one by one).

Two float32 implementations may part where the top two logits are within rounding of
each other; anywhere else the tokens must agree. The adapter has to change at least one
answer, so the comparison with an adapter cannot pass by ignoring it.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

import harness
from conftest import CHATS

PROMPTS = ["What is the capital of France?", "Name a primary colour.",
           "Write a haiku about the sea.", "Who wrote Hamlet?"]
NEW_TOKENS = 24
MODEL = "tiny-ref"


class Up:
    """`tuneq up` in a temp dir with `model_dir` registered as MODEL."""

    def __init__(self, tuneq: harness.Tuneq, model_dir: Path, data_dir: Path):
        self.key = "tq_" + secrets.token_hex(20)
        self.data_dir = data_dir
        self.proc = subprocess.Popen(
            [str(tuneq.binary), "up", "--port", "0", "--data-dir", str(data_dir),
             "--api-key", self.key, "--model", f"{MODEL}={model_dir}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=tuneq.env)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(l) for l in self.proc.stdout],
                         daemon=True).start()
        deadline = time.monotonic() + 60
        while True:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            if line.startswith("tuneq is up at "):
                self.url = line.removeprefix("tuneq is up at ").strip()
                break

    def call(self, method: str, path: str, body: bytes | None = None,
             content_type: str = "application/json") -> dict:
        request = urllib.request.Request(self.url + path, method=method, data=body, headers={
            "Authorization": f"Bearer {self.key}", "Content-Type": content_type})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{method} {path}: {e.code} {e.read().decode()}") from None

    def fine_tune(self, lines: bytes) -> tuple[str, Path]:
        """Uploads `lines`, fine-tunes MODEL on them; the fine-tuned model and its adapter."""
        boundary = "tuneq" + secrets.token_hex(8)
        form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
                f"fine-tune\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
                f"filename=\"train.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n").encode() \
            + lines + f"\r\n--{boundary}--\r\n".encode()
        file = self.call("POST", "/v1/files", form, f"multipart/form-data; boundary={boundary}")
        job = self.call("POST", "/v1/fine_tuning/jobs", json.dumps({
            "model": MODEL, "training_file": file["id"], "seed": 3,
            "hyperparameters": {"n_epochs": 2, "batch_size": 4, "max_seq_len": 256,
                                "learning_rate_multiplier": 1}}).encode())
        deadline = time.monotonic() + 600
        while job["status"] not in ("succeeded", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"job not done: {job}"
            time.sleep(0.5)
            job = self.call("GET", f"/v1/fine_tuning/jobs/{job['id']}")
        assert job["status"] == "succeeded", job.get("error")
        adapter = self.data_dir / "objects" / "tenants" / "default" / "jobs" / job["id"] / "output"
        return job["fine_tuned_model"], adapter

    def greedy(self, model: str, prompt: str) -> list[str]:
        """The greedy answer's tokens, each as its text."""
        answer = self.call("POST", "/v1/chat/completions", json.dumps({
            "model": model, "messages": [{"role": "user", "content": prompt}],
            "temperature": 0, "max_tokens": NEW_TOKENS, "logprobs": True}).encode())
        return [t["token"] for t in answer["choices"][0]["logprobs"]["content"]]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "mistral", "gemma2",
                                        "gemma3_text", "phi3"])
def served(request, tuneq, tiny_model, tmp_path_factory):
    """A family's tiny random model (`tuneq model init --arch`, which transformers loads
    as the family's own class) and a `tuneq up` serving it."""
    model = tiny_model
    if request.param != "llama":
        model = tmp_path_factory.mktemp(request.param) / "model"
        tuneq.run("model", "init", "--preset", "tiny", "--seed", 0, "--arch", request.param,
                  "--out", model)
    service = Up(tuneq, model, tmp_path_factory.mktemp("up"))
    yield service, model
    service.stop()


def reference_tokens(model, tokenizer, prompt: str, stop_ids: list[int]) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                        add_generation_prompt=True, return_tensors="pt",
                                        return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=stop_ids, pad_token_id=stop_ids[0])[0, ids.shape[1]:]
    return [t for t in out.tolist() if t not in stop_ids], ids


def check_same(model, tokenizer, prompt: str, got: list[str], stop_ids: list[int], label: str):
    want_ids, prompt_ids = reference_tokens(model, tokenizer, prompt, stop_ids)
    want = [tokenizer.decode([t]) for t in want_ids]
    print(f"{label} {prompt!r}: {''.join(got)!r}")
    if got == want:
        return
    n = next(i for i in range(min(len(got), len(want)) + 1)
             if i == min(len(got), len(want)) or got[i] != want[i])
    assert n < len(got) and n < len(want), \
        f"{label}: one answer is a prefix of the other:\ntuneq {got}\nreference {want}"
    with torch.no_grad():
        context = torch.cat([prompt_ids[0], torch.tensor(want_ids[:n])])[None]
        logits = model(input_ids=context).logits[0, -1].double()
    ours = [i for i in torch.topk(logits, 50).indices.tolist() if tokenizer.decode([i]) == got[n]]
    assert ours, f"{label}: tuneq's token {got[n]!r} at {n} is not among the reference's top 50"
    margin = float(logits[want_ids[n]] - logits[ours[0]])
    print(f"{label}: answers part at token {n}; logit margin {margin:.2e}")
    assert margin <= 1e-3, (f"{label}: tuneq {got}\nreference {want}\nparting at token {n}, "
                            f"where the reference's choice leads by {margin:.2e}")


def test_greedy_answers_equal_transformers_and_peft_token_for_token(served):
    from transformers import AutoTokenizer

    up, model_dir = served
    lines = "".join(json.dumps({"messages": [{"role": "user", "content": u},
                                             {"role": "assistant", "content": a}]}) + "\n"
                    for u, a in CHATS).encode()
    tuned, adapter = up.fine_tune(lines)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    stop_ids = sorted({tokenizer.eos_token_id,
                       *[i for t in ("<|im_end|>", "<|eot_id|>", "<|end|>")
                         if (i := tokenizer.convert_tokens_to_ids(t)) is not None
                         and i != tokenizer.unk_token_id]})
    base = harness.load_hf(model_dir)
    peft = harness.load_peft(model_dir, adapter)
    changed = 0
    for prompt in PROMPTS:
        got_base = up.greedy(MODEL, prompt)
        got_tuned = up.greedy(tuned, prompt)
        check_same(base, tokenizer, prompt, got_base, stop_ids, "base")
        check_same(peft, tokenizer, prompt, got_tuned, stop_ids, "adapter")
        changed += got_base != got_tuned
    assert changed, "the adapter changed no answer: the comparison would not notice it missing"
