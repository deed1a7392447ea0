"""scripts/bench-dpo's body: see that script's header for what it measures and how."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the quick brown fox jumps over a lazy dog while model train data token adapter "
         "layer weight memory answer prefers gently slowly river mountain").split()


def parse_args():
    p = argparse.ArgumentParser(description="DPO tokens/s: tuneq against TRL")
    p.add_argument("--preset", default="tiny", choices=["tiny", "small", "smollm2-135m"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-load", type=float, default=None)
    return p.parse_args()


def write_pairs(path: Path, count: int) -> None:
    """`count` preference pairs of random words: a 60-word prompt, 80-word answers."""
    rng = random.Random(7)
    text = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({
                "input": {"messages": [{"role": "user", "content": text(60)}]},
                "preferred_output": [{"role": "assistant", "content": text(80)}],
                "non_preferred_output": [{"role": "assistant", "content": text(80)}],
            }) + "\n")


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def settle(max_load: float | None) -> float:
    """With --max-load, waits (up to 120 s) for the 1-minute load to fall below it."""
    waited = 0
    while max_load is not None and load() >= max_load and waited < 120:
        time.sleep(5)
        waited += 5
    return load()


def run(cmd: list, env: dict) -> str:
    print(f"==> load {load():.2f}: {' '.join(map(str, cmd))}", file=sys.stderr)
    proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"bench-dpo: {cmd[0]} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def tuneq_figures(stdout: str, warmup: int) -> dict:
    """tokens/s and s/step over the steps after the warm-up, from the step events."""
    steps = [e for e in map(json.loads, filter(None, stdout.splitlines())) if e.get("event") == "step"]
    seen = [0] + [e["tokens_seen"] for e in steps]
    tokens = [b - a for a, b in zip(seen, seen[1:])]
    times = [t / e["tokens_per_s"] for t, e in zip(tokens, steps)]
    timed, timed_tokens = times[warmup:], tokens[warmup:]
    finished = [e for e in map(json.loads, filter(None, stdout.splitlines())) if e.get("event") == "finished"]
    return {"tokens_per_s": sum(timed_tokens) / sum(timed), "s_per_step": statistics.mean(timed),
            "timed_steps": len(timed), "losses": [e["loss"] for e in steps],
            "peak_rss_mib": (finished[-1].get("peak_memory_bytes") or 0) / 2**20}


def main():
    args = parse_args()
    tuneq = os.environ["TUNEQ_BIN"]
    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads),
               MKL_NUM_THREADS=str(args.threads))
    total = args.warmup + args.steps
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model, pairs = tmp / "model", tmp / "pairs.jsonl"
        run([tuneq, "model", "init", "--preset", args.preset, "--out", model], env)
        write_pairs(pairs, args.batch * total)
        results = []
        for i in range(args.runs):
            load_tuneq = settle(args.max_load)
            ours = tuneq_figures(run([
                tuneq, "train", "--model", model, "--train-file", pairs, "--output", tmp / f"out{i}",
                "--method", "dpo", "--beta", 0.1, "--epochs", 1, "--max-steps", total,
                "--batch-size", args.batch, "--grad-accum", 1, "--lr", 1e-4, "--warmup-steps", 0,
                "--scheduler", "constant", "--weight-decay", 0, "--max-grad-norm", 1,
                "--max-seq-len", 1024, "--lora-r", 8, "--lora-alpha", 16, "--lora-dropout", 0,
                "--samples", 0, "--activation-checkpointing", "off", "--progress", "json"], env),
                args.warmup)
            load_peer = settle(args.max_load)
            out = run([sys.executable, ROOT / "scripts" / "peer_dpo_bench.py", "--model", model,
                       "--pairs", pairs, "--out", tmp / f"trl{i}", "--batch", args.batch,
                       "--steps", args.steps, "--warmup", args.warmup, "--threads", args.threads], env)
            peer = json.loads(out.strip().splitlines()[-1])
            results.append({"tuneq": ours, "trl": peer, "loads": [load_tuneq, load_peer],
                            "ratio": ours["tokens_per_s"] / peer["tokens_per_s"]})
    print(f"\nDPO, preset {args.preset}, {args.batch} pairs a step, {args.warmup} warm-up + "
          f"{args.steps} timed steps, {args.threads} threads, LoRA r=8 alpha=16 on 7 projections, fp32")
    print(f"| {'pair':>4} | {'tuneq tok/s':>11} | {'TRL tok/s':>10} | {'tuneq/TRL':>9} | {'load before':>13} |")
    print(f"|{'-' * 6}|{'-' * 13}|{'-' * 12}|{'-' * 11}|{'-' * 15}|")
    for i, r in enumerate(results):
        print(f"| {i + 1:>4} | {r['tuneq']['tokens_per_s']:>11.1f} | {r['trl']['tokens_per_s']:>10.1f} | "
              f"{r['ratio']:>9.3f} | {r['loads'][0]:>5.2f} / {r['loads'][1]:<5.2f} |")
    ratios = [r["ratio"] for r in results]
    print(f"median ratio {statistics.median(ratios):.3f}; median tokens/s: tuneq "
          f"{statistics.median(r['tuneq']['tokens_per_s'] for r in results):.1f}, TRL "
          f"{statistics.median(r['trl']['tokens_per_s'] for r in results):.1f}")
    if max(max(r["loads"]) for r in results) > args.threads * 0.6:
        print("note: machine busy (1-minute load above 0.6 per thread): figures pessimistic")
    print(json.dumps({"bench": "bench-dpo", "preset": args.preset, "batch": args.batch,
                      "steps": args.steps, "warmup": args.warmup, "threads": args.threads,
                      "ratio_median": round(statistics.median(ratios), 4), "pairs": results}))


if __name__ == "__main__":
    main()
