"""scripts/bench-serve's body: see that script's header for what it measures and how."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_dpo import load, settle  # the benchmarks' shared load gate

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Tell me about the sea.", "What is a LoRA adapter?", "Write a short poem about autumn.",
           "How do bees make honey?", "Explain why the sky is blue.", "Name three rivers in Europe.",
           "What should I cook tonight?", "Describe a train journey."]
CHATS = [("What is the capital of France?", "Paris is the capital of France."),
         ("Name a primary colour.", "Red is a primary colour."),
         ("How many legs does a spider have?", "A spider has eight legs."),
         ("Who wrote Hamlet?", "William Shakespeare wrote Hamlet.")]


def parse_args():
    p = argparse.ArgumentParser(description="decode tokens/s and time to first token: "
                                            "tuneq's engine against transformers + PEFT")
    p.add_argument("--model", default=os.environ.get(
        "TUNEQ_REAL_MODEL", str(ROOT / "target/models/smollm2-135m-instruct-q4_1")))
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-load", type=float, default=None)
    return p.parse_args()


def train_adapter(binary: str, model: str, out: Path, env: dict) -> Path:
    """A LoRA adapter on all seven projections, 3 steps: both sides serve it."""
    data = out.parent / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": u},
                                                     {"role": "assistant", "content": a}]}) + "\n"
                            for u, a in CHATS * 2))
    subprocess.run([binary, "train", "--model", model, "--train-file", str(data), "--output",
                    str(out), "--epochs", "1", "--max-steps", "3", "--batch-size", "2",
                    "--lr", "1e-3", "--lora-r", "8", "--lora-alpha", "16",
                    "--targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"],
                   check=True, capture_output=True, env=env)
    return out


def tuneq_run(binary: str, model: str, adapter: Path, concurrency: int, new_tokens: int,
              env: dict) -> dict:
    cmd = [binary, "bench", "serve", "--model", model, "--adapter", str(adapter),
           "--concurrency", str(concurrency), "--max-new-tokens", str(new_tokens)]
    for p in PROMPTS:
        cmd += ["--prompt", p]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    r = json.loads(out.strip().splitlines()[-1])
    return {"tokens_per_s": r["tokens_per_s"], "ttft_ms": r["ttft_ms_median"]}


class Peer:
    """transformers + PEFT: the adapter on the base model, the prompts of one round as one
    left-padded batch through `generate` (greedy, exactly `new_tokens` each), which is
    how transformers serves several requests at once."""

    def __init__(self, model: str, adapter: Path, threads: int):
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(threads)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        self.model = PeftModel.from_pretrained(base, str(adapter)).eval()

    def batch(self, concurrency: int):
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                    add_generation_prompt=True, tokenize=False)
                 for p in (PROMPTS * concurrency)[:concurrency]]
        return self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)

    def generate(self, inputs, new_tokens: int) -> float:
        with self.torch.no_grad():
            started = time.perf_counter()
            self.model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=self.tokenizer.pad_token_id)
            return time.perf_counter() - started

    def run(self, concurrency: int, new_tokens: int) -> dict:
        inputs = self.batch(concurrency)
        self.generate(inputs, 2)  # warm-up
        ttft = self.generate(inputs, 1)
        took = self.generate(inputs, new_tokens)
        return {"tokens_per_s": concurrency * new_tokens / took, "ttft_ms": ttft * 1e3}


def main() -> None:
    args = parse_args()
    binary = os.environ["TUNEQ_BIN"]
    env = {**os.environ, "RAYON_NUM_THREADS": str(args.threads),
           "OMP_NUM_THREADS": str(args.threads)}
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        adapter = train_adapter(binary, args.model, Path(tmp) / "adapter", env)
        peer = Peer(args.model, adapter, args.threads)
        results = {c: {"tuneq": [], "peer": []} for c in levels}
        for run in range(args.runs):
            for c in levels:
                # Alternated, the order flipped every run.
                sides = ["tuneq", "peer"] if run % 2 == 0 else ["peer", "tuneq"]
                for side in sides:
                    before = settle(args.max_load)
                    r = (tuneq_run(binary, args.model, adapter, c, args.max_new_tokens, env)
                         if side == "tuneq" else peer.run(c, args.max_new_tokens))
                    r["load"] = before
                    results[c][side].append(r)
                    print(f"run {run + 1} concurrency {c} {side:5}: {r['tokens_per_s']:7.1f} "
                          f"tokens/s, first token {r['ttft_ms']:7.1f} ms (load {before:.2f})",
                          file=sys.stderr)
    summary = {}
    for c in levels:
        med = {side: {k: statistics.median(r[k] for r in rs) for k in ("tokens_per_s", "ttft_ms")}
               for side, rs in results[c].items()}
        ratio = med["tuneq"]["tokens_per_s"] / med["peer"]["tokens_per_s"]
        ttft_ratio = med["peer"]["ttft_ms"] / med["tuneq"]["ttft_ms"]
        summary[str(c)] = {"tuneq": med["tuneq"], "peer": med["peer"],
                           "tokens_per_s_ratio": ratio, "ttft_speedup": ttft_ratio}
        print(f"concurrency {c}: tuneq {med['tuneq']['tokens_per_s']:.1f} tokens/s vs "
              f"transformers+PEFT {med['peer']['tokens_per_s']:.1f} → {ratio:.2f}×; first token "
              f"{med['tuneq']['ttft_ms']:.0f} ms vs {med['peer']['ttft_ms']:.0f} ms "
              f"({ttft_ratio:.2f}× sooner)")
    print(json.dumps({"model": args.model, "max_new_tokens": args.max_new_tokens,
                      "threads": args.threads, "runs": args.runs, "results": summary}))


if __name__ == "__main__":
    main()
