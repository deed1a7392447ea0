"""DPO in tuneq against TRL's `DPOTrainer` (the reference implementation), on a tiny
random Llama whose chat template renders tools (`examples/templates/chatml-tools.jinja`)
and OpenAI's preference format (`examples/data/openai-preference.jsonl`, tool calls
included, given to TRL as conversational `prompt` / `chosen` / `rejected` / `tools`, the
call arguments parsed as tuneq hands them to a template):

- one step's loss, reported figures (rewards chosen / rejected, accuracy, margin,
  log-probabilities) and every LoRA gradient, for a policy adapter far from its reference
  (the base model), on the fused CPU path and on candle's graph (`tuneq debug
  dpo-grads` against `trainer.compute_loss(...).backward()`);
- a run of `tuneq train --method dpo` from a fresh adapter (B = 0, so the reference is the
  base model in both) against `trainer.train()`: every step's loss, gradient norm and
  figures, with AdamW, clipping and a constant learning rate.

Tolerance: 1e-4, relative to the figure's size for losses, norms and log-probabilities,
absolute for rewards, margins and accuracy (which sit near 0), and `rel_max_err` for
gradients (the suite's GRAD_RTOL).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import harness
from harness import ALL_TARGETS, GRAD_RTOL, REPO_ROOT, rel_max_err
from test_tool_chats import tools_model  # noqa: F401 (a fixture)

PAIRS = REPO_ROOT / "examples" / "data" / "openai-preference.jsonl"
BETA = 0.1
TOL = 1e-4
# tuneq's figure name -> TRL's metric name.
FIGURES = {
    "rewards_chosen": "rewards/chosen",
    "rewards_rejected": "rewards/rejected",
    "rewards_accuracy": "rewards/accuracies",
    "rewards_margin": "rewards/margins",
    "logps_chosen": "logps/chosen",
    "logps_rejected": "logps/rejected",
}


def parsed_calls(messages: list) -> list:
    """`messages` with each tool call's arguments parsed from their JSON text."""
    for message in messages:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return messages


def trl_dataset():
    """The preference file as TRL's conversational preference dataset."""
    from datasets import Dataset

    rows = []
    for line in PAIRS.read_text().splitlines():
        record = json.loads(line)
        row = {"prompt": parsed_calls(record["input"]["messages"]),
               "chosen": parsed_calls(record["preferred_output"]),
               "rejected": parsed_calls(record["non_preferred_output"])}
        # Every row names the column: a dataset takes its columns from the first row.
        row["tools"] = record["input"].get("tools")
        rows.append(row)
    return Dataset.from_list(rows)


def trl_trainer(policy, ref_model, model_dir: Path, out: Path, *, lr=1e-3, max_steps=1):
    """A DPOTrainer over every pair as one batch, in fp32 on the CPU, without shuffling
    mattering (the loss is a mean over the batch)."""
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    pairs = len(PAIRS.read_text().splitlines())
    config = DPOConfig(
        output_dir=str(out), per_device_train_batch_size=pairs, gradient_accumulation_steps=1,
        learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, max_steps=max_steps, num_train_epochs=max_steps, beta=BETA,
        logging_steps=1, report_to="none", seed=0, max_length=1024, use_cpu=True, bf16=False,
        save_strategy="no", dataloader_num_workers=0, dataset_num_proc=None,
    )
    return DPOTrainer(model=policy, ref_model=ref_model, args=config, train_dataset=trl_dataset(),
                      processing_class=tok)


def close(got: float, want: float, relative: bool) -> bool:
    scale = max(abs(want), 1.0) if relative else 1.0
    return abs(got - want) <= TOL * scale


def check_figures(where: str, got: dict, want: dict) -> None:
    for ours, theirs in FIGURES.items():
        relative = ours.startswith("logps")
        assert close(got[ours], want[theirs], relative), \
            f"{where}: {ours} {got[ours]} vs TRL's {theirs} {want[theirs]}"


@pytest.mark.parametrize("path", ["fused", "graph"])
def test_one_step_s_loss_figures_and_gradients_match_trl(adapters, tools_model, tuneq, tmp_path, path):
    tiny_model = tools_model
    adapter = adapters.get("all7")
    out = tmp_path / "grads.safetensors"
    if path == "graph":
        tuneq.env["TUNEQ_CPU_PATH"] = "graph"
    try:
        proc = tuneq.run("debug", "dpo-grads", "--model", tiny_model, "--adapter", adapter,
                         "--pairs", PAIRS, "--beta", BETA, "--out", out)
    finally:
        tuneq.env.pop("TUNEQ_CPU_PATH", None)
    ours = json.loads(proc.stdout.strip().splitlines()[-1])
    grads = load_file(str(out))

    # In float64: a DPO gradient subtracts the rejected rows' share from the chosen
    # rows' over the prompt they both read, and float32 on both sides would add both
    # sides' rounding of that difference to the comparison.
    policy = harness.load_peft(tiny_model, adapter, trainable=True).to(torch.float64)
    reference = harness.load_hf(tiny_model).to(torch.float64)
    trainer = trl_trainer(policy, reference, tiny_model, tmp_path / "trl")
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    figures = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    assert close(ours["loss"], float(loss), relative=True), f"loss {ours['loss']} vs TRL's {float(loss)}"
    # A policy far from its reference: the test sees real rewards, not log 2 and zeros.
    assert abs(float(loss) - math.log(2)) > 1e-3, float(loss)
    check_figures(path, ours["preference"], figures)
    params = harness.lora_params(trainer.model)
    assert set(params) == set(grads) - {"loss"}, sorted(set(params) ^ (set(grads) - {"loss"}))
    worst = max((rel_max_err(grads[k], p.grad), k) for k, p in params.items())
    print(f"{path}: loss {ours['loss']:.6f} (TRL {float(loss):.6f}), worst gradient error {worst}")
    assert worst[0] <= GRAD_RTOL, f"{path}: {worst[1]} off by {worst[0]:.2e} of its largest entry"


def fresh_adapter(model_dir: Path, out: Path) -> Path:
    """PEFT's own fresh LoRA (B = 0) on all seven projections, saved: the run's start."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = harness.load_hf(model_dir)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=ALL_TARGETS,
                        task_type="CAUSAL_LM")
    get_peft_model(base, config).save_pretrained(str(out))
    return out


def test_a_dpo_run_matches_trl_step_by_step(tools_model, tuneq, tmp_path):
    tiny_model = tools_model
    steps, lr = 3, 1e-3
    start = fresh_adapter(tiny_model, tmp_path / "start")
    pairs = len(PAIRS.read_text().splitlines())
    proc = tuneq.run(
        "train", "--model", tiny_model, "--train-file", PAIRS, "--output", tmp_path / "out",
        "--method", "dpo", "--beta", BETA, "--init-adapter", start,
        "--epochs", steps, "--max-steps", steps, "--batch-size", pairs, "--grad-accum", 1,
        "--lr", lr, "--warmup-steps", 0, "--scheduler", "constant", "--weight-decay", 0,
        "--max-grad-norm", 1.0, "--max-seq-len", 1024, "--lora-r", 8, "--lora-alpha", 16,
        "--lora-dropout", 0, "--targets", ",".join(ALL_TARGETS), "--seed", 0,
        "--samples", 0, "--progress", "json")
    ours = [e for e in map(json.loads, proc.stdout.splitlines()) if e.get("event") == "step"]

    trainer = trl_trainer(harness.load_peft(tiny_model, start, trainable=True), None, tiny_model,
                          tmp_path / "trl", lr=lr, max_steps=steps)
    trainer.train()
    theirs = [h for h in trainer.state.log_history if "rewards/chosen" in h]
    assert len(ours) == len(theirs) == steps, (len(ours), len(theirs))
    for got, want in zip(ours, theirs):
        where = f"step {got['step']}"
        print(f"{where}: loss {got['loss']:.6f} (TRL {want['loss']:.6f}), "
              f"grad_norm {got['grad_norm']:.6f} (TRL {want['grad_norm']:.6f}), "
              f"margin {got['preference']['rewards_margin']:.6f} (TRL {want['rewards/margins']:.6f})")
        assert close(got["loss"], want["loss"], relative=True), f"{where}: loss"
        assert close(got["grad_norm"], want["grad_norm"], relative=True), f"{where}: grad_norm"
        check_figures(where, got["preference"], want)
    # The steps after the first move the policy off its reference.
    assert abs(ours[-1]["preference"]["rewards_margin"]) > 10 * TOL
