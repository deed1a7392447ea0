#!/usr/bin/env python3
"""The DPO peer of scripts/bench-dpo: TRL's DPOTrainer (PyTorch + transformers + PEFT) on
the CPU, timed per optimiser step.

It trains what `tuneq train --method dpo` trains in the same run: the model folder
`tuneq model init` wrote (loaded as LlamaForCausalLM, fp32), a fresh LoRA adapter (r 8,
alpha 16, dropout 0, all seven projections), the same preference JSONL file, the same
batch of pairs, AdamW at a constant learning rate with clipping at 1. The reference's
log-probabilities are computed before the first step (`precompute_ref_log_probs`), as
tuneq computes them, so both sides' steps are the policy's forward and backward alone.

Per step it records the wall time (`on_step_begin` to `on_step_end`) and the
non-padding tokens (TRL's own `num_tokens`). The last line printed is one JSON object:
tokens/s and s/step over the steps after the warm-up, peak RSS, the losses.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a folder `tuneq model init` wrote")
    p.add_argument("--pairs", required=True, help="a JSONL file of OpenAI preference pairs")
    p.add_argument("--out", required=True, help="a scratch folder for the trainer")
    p.add_argument("--batch", type=int, default=4, help="pairs per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--max-length", type=int, default=1024)
    return p.parse_args()


def main():
    args = parse_args()
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, LlamaForCausalLM, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    with open(args.pairs) as f:
        for line in f:
            record = json.loads(line)
            rows.append({"prompt": record["input"]["messages"], "chosen": record["preferred_output"],
                         "rejected": record["non_preferred_output"]})
    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = LlamaForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                             target_modules=targets, task_type="CAUSAL_LM"))
    total = args.warmup + args.steps
    config = DPOConfig(
        output_dir=args.out, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=total, beta=args.beta, logging_steps=1, report_to="none",
        seed=0, max_length=args.max_length, use_cpu=True, bf16=False, save_strategy="no",
        precompute_ref_log_probs=True, dataloader_num_workers=0, disable_tqdm=True,
    )

    class Timer(TrainerCallback):
        def __init__(self):
            self.times, self.started = [], 0.0

        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.times.append(time.perf_counter() - self.started)

    timer = Timer()
    trainer = DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                         processing_class=tok, callbacks=[timer])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "num_tokens" in h and "loss" in h]
    seen = [0] + [int(h["num_tokens"]) for h in logs]
    tokens = [b - a for a, b in zip(seen, seen[1:])]
    timed, timed_tokens = timer.times[args.warmup:], tokens[args.warmup:]
    print(json.dumps({
        "bench": "trl_dpo", "batch": args.batch, "threads": args.threads,
        "timed_steps": len(timed), "tokens_per_s": sum(timed_tokens) / sum(timed),
        "s_per_step": statistics.mean(timed), "s_per_step_median": statistics.median(timed),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "losses": [h["loss"] for h in logs], "versions": {
            "torch": torch.__version__, "trl": __import__("trl").__version__},
    }))


if __name__ == "__main__":
    main()
