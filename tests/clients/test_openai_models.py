"""Deleting a fine-tuned model through the official `openai` SDK (`models.delete`)
against a real `tuneq up`: the model leaves the list, its adapter and checkpoints leave
the store, the job stays and says when; base models are the operator's (403), another
tenant's model is not found, and a second delete is a 404. And the operator's side of
the list: `tuneq models add|list|remove` against the same service."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import urllib.error
import urllib.request

import openai
import pytest

from conftest import REPO_ROOT, tuneq_bin
from test_openai_fine_tuning import refusal, terminal, wait_for

DEMO_MODEL = "tuneq-tiny-demo"
TRAIN = (REPO_ROOT / "examples/data/tiny-task-train.jsonl").read_bytes()


def succeeded_job(client):
    file = client.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune").id
    job = client.fine_tuning.jobs.create(
        model=DEMO_MODEL, training_file=file, suffix="to-delete",
        method={"type": "supervised",
                "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 16}}})
    job = wait_for(client, job.id, terminal)
    assert job.status == "succeeded", job.error
    return job


def other_tenant(service):
    """A client of a new tenant of `service`."""
    from openai import OpenAI

    tenant = "t" + secrets.token_hex(4)
    service.admin("POST", "/admin/tenants", {"id": tenant})
    key = service.admin("POST", f"/admin/tenants/{tenant}/keys")["api_key"]
    return OpenAI(base_url=f"{service.url}/v1", api_key=key, max_retries=0)


def test_a_deleted_fine_tuned_model_leaves_the_list_and_the_store(client, service):
    job = succeeded_job(client)
    name = job.fine_tuned_model
    output = service.data_dir / "objects" / "tenants" / "default" / "jobs" / job.id / "output"
    assert any(p.is_file() for p in output.rglob("*")), "the adapter is in the store"
    assert list(client.fine_tuning.jobs.checkpoints.list(job.id)), "checkpoints before"

    # Another tenant cannot see it, so cannot delete it.
    stranger = other_tenant(service)
    with pytest.raises(openai.NotFoundError):
        stranger.models.delete(name)

    deleted = client.models.delete(name)
    assert (deleted.id, deleted.object, deleted.deleted) == (name, "model", True)
    assert name not in {m.id for m in client.models.list()}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(name)
    assert not any(p.is_file() for p in output.rglob("*")), "adapter and checkpoints are gone"

    kept = client.fine_tuning.jobs.retrieve(job.id)
    assert kept.status == "succeeded" and kept.fine_tuned_model == name
    assert kept.model_extra["model_deleted_at"] >= kept.finished_at
    assert kept.model_extra["adapter"] is None
    assert list(client.fine_tuning.jobs.checkpoints.list(job.id)) == []
    request = urllib.request.Request(f"{service.url}/v1/fine_tuning/jobs/{job.id}/adapter",
                                     headers=service.headers())
    with pytest.raises(urllib.error.HTTPError) as gone:
        urllib.request.urlopen(request, timeout=30)
    assert gone.value.code == 410

    with pytest.raises(openai.NotFoundError):
        client.models.delete(name)
    with pytest.raises(openai.PermissionDeniedError):
        client.models.delete(DEMO_MODEL)


def first_step_loss(client, job_id: str) -> float:
    steps = {e.data["step"]: e.data["train_loss"] for e in client.fine_tuning.jobs.list_events(job_id, limit=100)
             if e.type == "metrics" and e.data and "train_loss" in e.data}
    return steps[min(steps)]


def continue_from(client, model: str, file: str):
    """A one-epoch job that trains `model` (a fine-tuned model or checkpoint) further."""
    return client.fine_tuning.jobs.create(
        model=model, training_file=file,
        method={"type": "supervised",
                "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 16}}})


def test_a_fine_tuned_model_is_trained_further_from_its_adapter(client, service):
    first = succeeded_job(client)
    # Data meant for the fine-tuned model is counted with its base model's tokenizer.
    uploaded = client.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune",
                                   extra_body={"model": first.fine_tuned_model})
    assert uploaded.model_extra["validation"]["tokens"]["model"] == DEMO_MODEL
    file = uploaded.id

    # Another tenant cannot continue it: it does not exist for them.
    stranger = other_tenant(service)
    theirs = stranger.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune").id
    assert refusal(lambda: stranger.fine_tuning.jobs.create(
        model=first.fine_tuned_model, training_file=theirs))[0] == "model_not_found"

    second = continue_from(client, first.fine_tuned_model, file)
    assert second.model == first.fine_tuned_model
    assert second.model_extra["base_model"] == DEMO_MODEL
    assert second.model_extra["parent_job"] == first.id
    assert second.model_extra["lora"] == first.model_extra["lora"]

    # The model it continues cannot be deleted while it runs.
    assert refusal(lambda: client.models.delete(first.fine_tuned_model))[0] == "model_in_use"

    second = wait_for(client, second.id, terminal)
    assert second.status == "succeeded", second.error
    assert second.fine_tuned_model.startswith(f"ft:{DEMO_MODEL}:default:"), "the name keeps the base"
    # It started where the first run ended, not from fresh factors (a fresh start's
    # loss is about ln 4096 = 8.3; one epoch takes it below 7).
    fresh = first_step_loss(client, first.id)
    assert first_step_loss(client, second.id) < fresh - 1.0

    # A checkpoint the first run still keeps is continued the same way; one it dropped
    # (it keeps its last two) is not found.
    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(first.id))
    assert len(checkpoints) > 2
    kept, dropped = checkpoints[0], checkpoints[-1]
    assert refusal(lambda: client.fine_tuning.jobs.create(
        model=dropped.fine_tuned_model_checkpoint, training_file=file))[0] == "model_not_found"
    third = continue_from(client, kept.fine_tuned_model_checkpoint, file)
    assert third.model == kept.fine_tuned_model_checkpoint
    assert third.model_extra["parent_job"] == first.id
    third = wait_for(client, third.id, terminal)
    assert third.status == "succeeded", third.error
    assert first_step_loss(client, third.id) < fresh - 1.0


def test_the_cli_adds_lists_and_removes_a_base_model(service):
    """The demo model's folder registered again under another id, with a display name
    and a built-in template; shown in `tuneq models list`'s table and JSON; a bad
    location refused as bad input naming it; then removed."""
    env = {**os.environ, "TUNEQ_URL": service.url, "TUNEQ_ADMIN_KEY": service.admin_key,
           "TUNEQ_API_KEY": service.api_key}

    def models(*args):
        return subprocess.run([str(tuneq_bin()), "models", *args], env=env,
                              capture_output=True, text=True, timeout=120)

    folder = service.data_dir / "models" / DEMO_MODEL
    added = models("add", "demo-alpaca", str(folder), "--display-name", "Demo (Alpaca)",
                   "--chat-template", "alpaca")
    assert added.returncode == 0, added.stderr
    assert json.loads(added.stdout)["details"]["template"] == "alpaca"
    table = models("list")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split()[:3] == ["ID", "KIND", "ARCHITECTURE"]
    row = next(line for line in lines if line.split()[0] == "demo-alpaca")
    assert "llama" in row.split() and "alpaca (built-in)" in row, row
    listed = json.loads(models("list", "--json").stdout)
    assert any(m["id"] == "demo-alpaca" and m["display_name"] == "Demo (Alpaca)"
               for m in listed["data"])
    refused = models("add", "demo-other", "relative/folder")
    assert refused.returncode == 2 and "absolute" in refused.stderr, refused.stderr
    removed = models("remove", "demo-alpaca")
    assert removed.returncode == 0 and json.loads(removed.stdout)["deleted"] is True
    assert "demo-alpaca" not in models("list").stdout
