"""Each way a fine-tune can fail, end to end through a real `tuneq up` and the official
`openai` SDK: the trainer names its failure in its exit code, the dispatcher and the
queue carry it as a type, and the tenant reads it as `error.code` — a diverging run, an
input the trainer cannot read, and a trainer that crashes past its retry budget. (A
job whose attempts vanish is `job_lost`: `api/tests/it/failure_codes.rs` drives the
queue to it.)"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest
from openai import OpenAI

from conftest import Service, tuneq_bin
from test_openai_fine_tuning import (DEMO_MODEL, TRAIN, signal_the_trainer, terminal, upload,
                                     wait_for)


def failed_event(client: OpenAI, job_id: str):
    events = list(client.fine_tuning.jobs.list_events(job_id, limit=100))
    return [e for e in events if e.level == "error"]


def fine_tune(service: Service, model: str, timeout: float, **create):
    """Uploads the tiny task's data, fine-tunes `model` on it and waits for the end:
    (the client, the finished job)."""
    client = OpenAI(base_url=f"{service.url}/v1", api_key=service.api_key, max_retries=0)
    train = upload(client, TRAIN, "train.jsonl")
    job = client.fine_tuning.jobs.create(model=model, training_file=train, **create)
    return client, wait_for(client, job.id, terminal, timeout=timeout)


def init_model(folder: Path) -> Path:
    """A tiny random Llama written by `tuneq model init`."""
    subprocess.run([str(tuneq_bin()), "model", "init", "--out", str(folder)], check=True,
                   capture_output=True, timeout=120)
    return folder


def test_a_run_whose_loss_diverges_fails_as_training_diverged_and_is_not_retried(tmp_path):
    # A model whose last norm scales every hidden state past float32's range: its logits
    # overflow, so the very first loss is NaN, whatever the learning rate.
    import numpy as np
    from safetensors.numpy import load_file, save_file

    model = init_model(tmp_path / "overflowing")
    weights_file = next(model.glob("*.safetensors"))
    weights = load_file(str(weights_file))
    weights["model.norm.weight"] = np.full_like(weights["model.norm.weight"], 3e38)
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    service = Service(tmp_path / "data", extra_args=["--model", f"overflowing={model}"])
    try:
        client, done = fine_tune(service, "overflowing", timeout=300)
        assert done.status == "failed", done
        assert done.error.code == "training_diverged", done.error
        assert "learning rate" in done.error.message
        assert done.model_extra["failed_attempts"] == 1, "a diverged run is never retried"
        assert failed_event(client, done.id), "the job's events say it failed"
    finally:
        service.stop()


def test_a_model_the_trainer_cannot_read_fails_as_invalid_training_input(tmp_path):
    model = init_model(tmp_path / "mine")
    service = Service(tmp_path / "data", extra_args=["--model", f"mine={model}"])
    try:
        # Registered while whole; its weights are damaged afterwards (a disk, a bad copy).
        weights = next(model.glob("*.safetensors"))
        weights.write_bytes(weights.read_bytes()[:64])
        _, done = fine_tune(service, "mine", timeout=120)
        assert done.status == "failed", done
        assert done.error.code == "invalid_training_input", done.error
        assert done.model_extra["failed_attempts"] == 1, "bad input is never retried"
        assert str(tmp_path) not in done.error.message, "no server paths reach the tenant"
    finally:
        service.stop()


def test_a_trainer_that_crashes_every_attempt_fails_as_training_failed(tmp_path):
    service = Service(tmp_path / "data", extra_args=["--retry-base", "1s", "--retry-max", "2s"])
    try:
        client = OpenAI(base_url=f"{service.url}/v1", api_key=service.api_key, max_retries=0)
        train = upload(client, TRAIN, "train.jsonl")
        job = client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train,
                                             hyperparameters={"n_epochs": 3})
        kills = 0
        deadline = time.monotonic() + 240
        while client.fine_tuning.jobs.retrieve(job.id).status not in ("succeeded", "failed",
                                                                        "cancelled"):
            assert time.monotonic() < deadline, "the job did not fail in time"
            try:
                signal_the_trainer(service, signal.SIGKILL)
                kills += 1
            except AssertionError:
                continue  # between attempts: no trainer to kill yet
            time.sleep(1.0)
        done = client.fine_tuning.jobs.retrieve(job.id)
        assert done.status == "failed", done
        assert done.error.code == "training_failed", done.error
        assert done.model_extra["failed_attempts"] == 3, done.model_extra
        assert kills >= 3
        assert "signal 9" in done.error.message
    finally:
        service.stop()
