"""Pause and resume through the official `openai` SDK against a real `tuneq up`: a
running job writes a checkpoint and gives its machine up, waits paused while another
job runs, and once resumed continues from that checkpoint to the adapter an
uninterrupted run of the same job makes, byte for byte."""

from __future__ import annotations

import io
import tarfile

import openai
import pytest

from test_openai_fine_tuning import (DEMO_MODEL, TRAIN, http_get, refusal, step_of, terminal,
                                     upload, wait_for)

# 600 examples, 8 a step, 2 epochs: 150 steps, long enough to pause half way.
HYPERPARAMETERS = {"n_epochs": 2, "batch_size": 8}


def adapter_weights(service, job) -> bytes:
    archive = http_get(service, job.model_extra["adapter"]["download_url"])
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        member = tar.extractfile("adapter_model.safetensors")
        assert member is not None
        return member.read()


def test_a_paused_job_frees_its_machine_and_resumes_to_the_adapter_of_an_uninterrupted_run(
        client, service):
    train = upload(client, TRAIN, "train.jsonl")
    create = dict(model=DEMO_MODEL, training_file=train, seed=11,
                  hyperparameters=HYPERPARAMETERS)
    paused = client.fine_tuning.jobs.create(**create)
    wait_for(client, paused.id, lambda j: step_of(j) >= 10, what="training")
    answer = client.fine_tuning.jobs.pause(paused.id)
    assert answer.id == paused.id
    assert answer.status == "running" and answer.model_extra["pause_requested"], answer
    assert refusal(lambda: client.fine_tuning.jobs.resume(paused.id)) == ("job_not_paused", "id")
    job = wait_for(client, paused.id, lambda j: j.status == "paused", timeout=120, what="paused")
    assert not job.model_extra["pause_requested"]
    assert client.fine_tuning.jobs.pause(paused.id).status == "paused", "pausing again changes nothing"
    stopped_at = step_of(job)
    assert 10 <= stopped_at < 150, stopped_at
    messages = [e.message for e in client.fine_tuning.jobs.list_events(paused.id, limit=100)]
    assert "Pausing: the running attempt writes a checkpoint and stops" in messages
    assert any(m.startswith("The job was paused") for m in messages), messages

    # Paused, it holds no machine: the same job created again runs to the end on the one
    # slot `tuneq up` has, while the paused one waits where it stopped.
    uninterrupted = client.fine_tuning.jobs.create(**create)
    whole = wait_for(client, uninterrupted.id, terminal)
    assert whole.status == "succeeded", whole.error
    still = client.fine_tuning.jobs.retrieve(paused.id)
    assert still.status == "paused" and step_of(still) == stopped_at

    resumed = client.fine_tuning.jobs.resume(paused.id)
    assert resumed.status in ("queued", "running"), resumed.status
    done = wait_for(client, paused.id, terminal)
    assert done.status == "succeeded", done.error
    assert done.model_extra["progress"]["step"] == 150
    assert done.model_extra["preemptions"] == 0 and done.model_extra["failed_attempts"] == 0
    events = list(client.fine_tuning.jobs.list_events(paused.id, limit=200))
    resumes = [e for e in events if e.message.startswith("Resumed from the checkpoint")]
    assert [e.data["step"] for e in resumes] == [stopped_at], "it continued where it stopped"
    assert "The job was resumed; it continues from its last checkpoint" in [e.message for e in events]
    assert adapter_weights(service, done) == adapter_weights(service, whole)

    # A finished job can be neither paused nor resumed.
    assert refusal(lambda: client.fine_tuning.jobs.pause(done.id)) == ("job_already_finished", "id")
    assert refusal(lambda: client.fine_tuning.jobs.resume(done.id)) == ("job_already_finished", "id")


def test_a_waiting_job_is_paused_at_once_and_a_paused_one_can_be_cancelled(client):
    train = upload(client, TRAIN[:64], "train.jsonl")
    # The first job holds the one slot, so the second waits in line.
    running = client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train,
                                             hyperparameters={"n_epochs": 20})
    waiting = client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train)
    wait_for(client, running.id, lambda j: j.status == "running", what="running")
    assert client.fine_tuning.jobs.pause(waiting.id).status == "paused"
    listed = {j.id: j.status for j in client.fine_tuning.jobs.list(limit=20)}
    assert listed[waiting.id] == "paused"
    assert refusal(lambda: client.fine_tuning.jobs.resume(running.id)) == ("job_not_paused", "id")
    assert client.fine_tuning.jobs.cancel(waiting.id).status == "cancelled"
    assert client.fine_tuning.jobs.cancel(running.id).status in ("running", "cancelled")
    assert wait_for(client, running.id, terminal, timeout=120).status == "cancelled"
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.pause("ftjob-000000000000000000000000")
