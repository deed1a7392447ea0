"""Fine-tuning through the official `openai` Python SDK against a real `tuneq up`: the
whole job life (upload, create, watch, events, checkpoints, models, cancel), refusals,
idempotency, the adapter loaded with PEFT, and restarts in the middle of a job."""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import tarfile
import time
import urllib.request
import uuid
from pathlib import Path

import openai
import pytest

from conftest import REPO_ROOT, Service

DEMO_MODEL = "tuneq-tiny-demo"
TRAIN = (REPO_ROOT / "examples/data/tiny-task-train.jsonl").read_text().splitlines()
VALID = (REPO_ROOT / "examples/data/tiny-task-val.jsonl").read_text().splitlines()


def upload(client, lines: list[str], name: str) -> str:
    data = ("\n".join(lines) + "\n").encode()
    return client.files.create(file=(name, data), purpose="fine-tune").id


def wait_for(client, job_id: str, done, timeout: float = 300.0, what: str = "terminal"):
    deadline = time.monotonic() + timeout
    while True:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if done(job):
            return job
        if job.status in ("succeeded", "failed", "cancelled") and not done(job):
            pytest.fail(f"job ended {job.status} while waiting for {what}: {job.error}")
        if time.monotonic() > deadline:
            pytest.fail(f"job {job_id} not {what} after {timeout} s: {job.status} {job.model_extra}")
        time.sleep(0.5)


def refusal(call) -> tuple[str, str]:
    """The `code` and `param` of the 400 that `call` must raise."""
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    return caught.value.code, caught.value.param


def terminal(job) -> bool:
    return job.status in ("succeeded", "failed", "cancelled")


def step_of(job) -> int:
    progress = (job.model_extra or {}).get("progress") or {}
    return int(progress.get("step") or 0)


def http_get(service: Service, path: str) -> bytes:
    request = urllib.request.Request(service.url + path, headers=service.headers())
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read()


def watch(service: Service, job_id: str, last_event_id: str | None = None):
    """Reads the job's server-sent events until the stream ends: (event, id, data)."""
    headers = dict(service.headers())
    if last_event_id:
        headers["Last-Event-ID"] = last_event_id
    request = urllib.request.Request(
        f"{service.url}/v1/fine_tuning/jobs/{job_id}/events?stream=true", headers=headers)
    events, kind, event_id, data = [], None, None, []
    with urllib.request.urlopen(request, timeout=300) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith(":"):
                continue
            if line == "":
                if kind:
                    events.append((kind, event_id, "\n".join(data)))
                kind, event_id, data = None, None, []
            elif line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("id: "):
                event_id = line.removeprefix("id: ")
            elif line.startswith("data: "):
                data.append(line.removeprefix("data: "))
    return events


def test_a_fine_tune_runs_to_an_adapter_that_peft_loads(client, service, tmp_path):
    train = upload(client, TRAIN[:96], "train.jsonl")
    valid = upload(client, VALID[:16], "valid.jsonl")
    job = client.fine_tuning.jobs.create(
        model=DEMO_MODEL,
        training_file=train,
        validation_file=valid,
        suffix="sdk-e2e",
        seed=7,
        metadata={"team": "search"},
        method={"type": "supervised",
                "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 8}}},
    )
    assert job.object == "fine_tuning.job"
    assert job.id.startswith("ftjob-")
    assert job.status in ("queued", "running")
    assert job.model == DEMO_MODEL
    assert job.training_file == train and job.validation_file == valid
    assert job.hyperparameters.n_epochs == 2 and job.hyperparameters.batch_size == 8
    assert job.seed == 7 and job.metadata == {"team": "search"}
    assert job.fine_tuned_model is None and job.finished_at is None

    # Watch it as server-sent events until it is done.
    streamed = watch(service, job.id)
    assert streamed[-1][0] == "done"
    assert json.loads(streamed[-1][2])["status"] == "succeeded"
    kinds = [kind for kind, _, _ in streamed]
    assert "metrics" in kinds and kinds.count("done") == 1
    ids = [event_id for _, event_id, _ in streamed[:-1]]
    assert len(set(ids)) == len(ids), "each event is sent once"
    messages = [json.loads(data)["message"] for _, _, data in streamed[:-1]]
    assert messages[0] == f"Created fine-tuning job: {job.id}"
    assert messages[-1] == "The job has successfully completed"
    # Reconnecting with Last-Event-ID resumes after that event.
    again = watch(service, job.id, last_event_id=ids[-2])
    assert [e[1] for e in again[:-1]] == ids[-1:]

    done = client.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model == f"ft:{DEMO_MODEL}:default:sdk-e2e:{job.id.removeprefix('ftjob-')}"
    assert done.trained_tokens and done.trained_tokens > 0
    assert done.finished_at >= done.created_at
    extra = done.model_extra or {}
    assert extra["progress"]["step"] == extra["progress"]["total_steps"] == 24
    assert extra["progress"]["validation_loss"] is not None

    # Events: newest first, paged by `after`; the SDK's auto-pagination walks them all.
    events = list(client.fine_tuning.jobs.list_events(job.id, limit=5))
    assert len({e.id for e in events}) == len(events) > 10
    assert [e.created_at for e in events] == sorted((e.created_at for e in events), reverse=True)
    assert events[0].message == "The job has successfully completed"
    assert events[-1].message == f"Created fine-tuning job: {job.id}"
    metrics = [e for e in events if e.type == "metrics" and "train_loss" in (e.data or {})]
    assert metrics and all(e.message.startswith("Step ") for e in metrics)
    first_page = client.fine_tuning.jobs.list_events(job.id, limit=3)
    assert first_page.has_more and len(first_page.data) == 3

    # The result file: every step's metrics as OpenAI writes them, read with files.content.
    assert len(done.result_files) == 1, done.result_files
    results = client.files.retrieve(done.result_files[0])
    assert results.purpose == "fine-tune-results" and results.filename == "step_metrics.csv"
    rows = list(csv.DictReader(io.StringIO(client.files.content(results.id).text)))
    assert [int(r["step"]) for r in rows] == list(range(1, 25))
    assert list(rows[0]) == ["step", "train_loss", "train_accuracy", "valid_loss",
                             "valid_mean_token_accuracy"]
    assert all(float(r["train_loss"]) > 0 and 0 <= float(r["train_accuracy"]) <= 1 for r in rows)
    validated = [r for r in rows if r["valid_loss"]]
    assert validated and validated[-1]["step"] == "24", "the last step is validated"
    assert all(0 <= float(r["valid_mean_token_accuracy"]) <= 1 for r in validated)
    # The demo task is learnable: by the end the model ranks some answer tokens first.
    assert float(rows[-1]["train_accuracy"]) > 0
    assert results.id in {f.id for f in client.files.list(purpose="fine-tune-results")}
    assert results.id not in {f.id for f in client.files.list(purpose="fine-tune")}
    with pytest.raises(openai.BadRequestError) as caught:
        client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=results.id)
    assert caught.value.body["param"] == "training_file"

    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert checkpoints, "the run checkpoints about ten times"
    steps = [c.step_number for c in checkpoints]
    assert steps == sorted(steps, reverse=True) and steps[0] == 24
    assert checkpoints[0].fine_tuned_model_checkpoint.endswith(":ckpt-step-24")

    models = [m.id for m in client.models.list()]
    assert DEMO_MODEL in models and done.fine_tuned_model in models
    # models.retrieve, on a base model and on the tenant's own fine-tuned model.
    assert client.models.retrieve(DEMO_MODEL).id == DEMO_MODEL
    tuned = client.models.retrieve(done.fine_tuned_model)
    assert tuned.id == done.fine_tuned_model and tuned.owned_by != "tuneq"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("ft:" + DEMO_MODEL + ":nobody:x:ftjob-000000000000000000000000")

    # The adapter download is a tar of the PEFT folder; PEFT loads it on the base model.
    archive = http_get(service, extra["adapter"]["download_url"])
    adapter_dir = tmp_path / "adapter"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        assert sorted(tar.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]
        tar.extractall(adapter_dir, filter="data")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir = service.data_dir / "models" / DEMO_MODEL
    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 42, 7]])
    with torch.no_grad():
        before = base(ids).logits.clone()
        tuned = PeftModel.from_pretrained(base, adapter_dir)
        after = tuned(ids).logits
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    assert not torch.allclose(before, after), "a trained adapter changes the model's output"


def test_early_stopping_ends_a_job_whose_validation_loss_stops_improving(client):
    train = upload(client, TRAIN[:96], "train.jsonl")
    valid = upload(client, VALID[:16], "valid.jsonl")
    hyperparameters = {"n_epochs": 6, "batch_size": 8, "learning_rate": 0.05,
                       "early_stopping": {"patience": 1, "min_delta": 0.0}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.fine_tuning.jobs.create(
            model=DEMO_MODEL, training_file=train,
            method={"type": "supervised", "supervised": {"hyperparameters": hyperparameters}})
    assert caught.value.body["param"] == "hyperparameters.early_stopping"
    # A fixed seed: the same trajectory, whose validation loss turns back up, every run.
    job = client.fine_tuning.jobs.create(
        model=DEMO_MODEL, training_file=train, validation_file=valid, seed=7,
        method={"type": "supervised", "supervised": {"hyperparameters": hyperparameters}})
    done = wait_for(client, job.id, terminal)
    assert done.status == "succeeded", done.error
    progress = done.model_extra["progress"]
    assert progress["step"] < progress["total_steps"], progress
    kept = [e for e in client.fine_tuning.jobs.list_events(job.id, limit=100)
            if e.message.startswith("Early stopping at step")]
    assert len(kept) == 1, [e.message for e in client.fine_tuning.jobs.list_events(job.id)]
    assert kept[0].data["best_step"] < kept[0].data["stopped_at"] == progress["step"]
    rows = list(csv.DictReader(io.StringIO(client.files.content(done.result_files[0]).text)))
    assert int(rows[-1]["step"]) == progress["step"]


def test_requests_that_can_never_run_are_refused_and_change_nothing(client):
    train = upload(client, TRAIN[:16], "small.jsonl")
    before = len(list(client.fine_tuning.jobs.list()))
    cases = [
        (dict(model="no-such-model", training_file=train), "model", "model_not_found"),
        (dict(model=DEMO_MODEL, training_file="file-doesnotexist"), "training_file", "file_not_found"),
        (dict(model=DEMO_MODEL, training_file=train, hyperparameters={"n_epochs": 0}),
         "hyperparameters.n_epochs", "invalid_value"),
        (dict(model=DEMO_MODEL, training_file=train, suffix="bad suffix!"), "suffix", "invalid_value"),
        (dict(model=DEMO_MODEL, training_file=train, method={"type": "reinforcement"}),
         "method.type", "unsupported_method"),
        (dict(model=DEMO_MODEL, training_file=train, method={"type": "dpo"}), "method",
         "method_mismatch"),
        (dict(model=DEMO_MODEL, training_file=train,
              method={"type": "supervised", "supervised": {"hyperparameters": {"beta": 0.1}}}),
         "hyperparameters.beta", "invalid_value"),
        (dict(model=DEMO_MODEL, training_file=train,
              method={"type": "dpo", "supervised": {}}), "method", "conflicting_values"),
        (dict(model=DEMO_MODEL, training_file=train,
              method={"type": "supervised", "bogus": 1}), "method.bogus", "invalid_json"),
        (dict(model=DEMO_MODEL, training_file=train, suffix=".."), "suffix", "invalid_value"),
        (dict(model=DEMO_MODEL, training_file=train, extra_body={"hardware": "gpu"}), "hardware",
         "no_pool_fits"),
        (dict(model=DEMO_MODEL, training_file=train, extra_body={"priority": 12}), "priority",
         "invalid_value"),
    ]
    for kwargs, param, code in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.fine_tuning.jobs.create(**kwargs)
        assert err.value.param == param, (kwargs, err.value.body)
        assert err.value.code == code, (kwargs, err.value.body)
    assert len(list(client.fine_tuning.jobs.list())) == before


def test_idempotency_keys_list_filters_and_cancel(client):
    train = upload(client, TRAIN[:16], "small.jsonl")
    tag = uuid.uuid4().hex
    key = {"Idempotency-Key": f"create-{tag}"}
    first = client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train,
                                           metadata={"batch": tag}, extra_headers=key)
    again = client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train,
                                           metadata={"batch": tag}, extra_headers=key)
    assert again.id == first.id
    with pytest.raises(openai.BadRequestError) as err:
        client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train, suffix="other",
                                       metadata={"batch": tag}, extra_headers=key)
    assert err.value.code == "idempotency_key_reused"
    others = [client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train,
                                             metadata={"batch": tag}).id for _ in range(2)]
    ids = [first.id, *others]
    for job_id in ids:
        client.fine_tuning.jobs.cancel(job_id)
    for job_id in ids:
        assert wait_for(client, job_id, terminal).status == "cancelled"
    # A finished job cannot be cancelled again: 400 (never 409, which SDKs retry).
    with pytest.raises(openai.BadRequestError) as err:
        client.fine_tuning.jobs.cancel(first.id)
    assert err.value.code == "job_already_finished"

    page = client.fine_tuning.jobs.list(limit=2, metadata={"batch": tag})
    assert len(page.data) == 2 and page.has_more
    listed = [j.id for j in client.fine_tuning.jobs.list(limit=2, metadata={"batch": tag})]
    assert listed == list(reversed(ids)), "newest first, filtered by metadata"
    cancelled = [j.id for j in client.fine_tuning.jobs.list(extra_query={"status": "cancelled"})]
    assert set(ids) <= set(cancelled)
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("ftjob-000000000000000000000000")


def test_a_running_job_is_cancelled_and_its_trainer_stops(client):
    train = upload(client, TRAIN, "train.jsonl")
    job = client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train,
                                         hyperparameters={"n_epochs": 5})
    wait_for(client, job.id, lambda j: step_of(j) >= 3, what="training")
    answer = client.fine_tuning.jobs.cancel(job.id)
    assert answer.status in ("running", "cancelled")
    done = wait_for(client, job.id, terminal, timeout=120)
    assert done.status == "cancelled"
    messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100)]
    assert "The job was cancelled" in messages


def test_restarts_mid_job_resume_from_the_last_checkpoint(tmp_path):
    """Stopped gracefully, then killed outright: the job resumes both times from a
    checkpoint and succeeds; nothing is lost."""
    from openai import OpenAI

    service = Service(tmp_path / "data")
    api_key = service.api_key
    try:
        client = OpenAI(base_url=f"{service.url}/v1", api_key=api_key, max_retries=0)
        train = upload(client, TRAIN, "train.jsonl")
        job = client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train,
                                             hyperparameters={"n_epochs": 2, "batch_size": 8})
        wait_for(client, job.id, lambda j: step_of(j) >= 20, what="training")
        service.stop()  # SIGTERM: the attempt checkpoints and the job goes back in line

        service = Service(tmp_path / "data", api_key=api_key)
        client = OpenAI(base_url=f"{service.url}/v1", api_key=api_key, max_retries=0)
        resumed = wait_for(client, job.id, lambda j: step_of(j) >= 60, what="training again")
        assert resumed.model_extra["preemptions"] == 1
        service.crash()  # SIGKILL: the trainer is orphaned; the next start kills it

        service = Service(tmp_path / "data", api_key=api_key)
        client = OpenAI(base_url=f"{service.url}/v1", api_key=api_key, max_retries=0)
        done = wait_for(client, job.id, terminal)
        assert done.status == "succeeded", done.error
        assert done.model_extra["preemptions"] == 2
        assert done.model_extra["progress"]["step"] == 150
        events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
        resumes = [e for e in events if e.message.startswith("Resumed from the checkpoint")]
        assert len(resumes) == 2, [e.message for e in events]
        assert all(e.data["step"] > 0 for e in resumes)
        stops = [e for e in events if e.message.startswith("The attempt stopped (")]
        assert len(stops) == 2
        # The graceful stop checkpointed where it was (step 20 or later): nothing lost.
        after_stop, after_kill = resumes[-1].data["step"], resumes[0].data["step"]  # newest first
        assert after_stop >= 20, after_stop
        # Work redone after the kill (steps past its last checkpoint) is counted, not
        # hidden: at least from where the resumed run was seen to where it restarted.
        lost = done.model_extra["lost_steps"]
        assert lost == done.model_extra["progress"]["lost_steps"]
        assert lost >= step_of(resumed) - after_kill, (lost, step_of(resumed), after_kill)
        assert lost < 150
    finally:
        service.stop()


def trainers_of(service: Service) -> list[int]:
    """Process ids of the `tuneq train` children of a running `tuneq up`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == service.proc.pid and b"train" in cmdline:
            found.append(int(entry.name))
    return found


def signal_the_trainer(service: Service, signum: int) -> None:
    deadline = time.monotonic() + 30
    while not (pids := trainers_of(service)):
        assert time.monotonic() < deadline, "no trainer process found"
        time.sleep(0.2)
    assert len(pids) == 1, pids
    os.kill(pids[0], signum)


def test_a_trainer_stopped_from_outside_is_a_preemption_and_a_killed_one_a_retried_crash(
        tmp_path):
    """The launch contract on one machine: SIGTERM to the trainer (the machine shutting
    down) checkpoints and exits 75, and the job goes back in line with no retry spent;
    SIGKILL is a crash, retried from the last checkpoint. Both resume; nothing is lost."""
    from openai import OpenAI

    service = Service(tmp_path / "data")
    try:
        client = OpenAI(base_url=f"{service.url}/v1", api_key=service.api_key, max_retries=0)
        train = upload(client, TRAIN, "train.jsonl")
        job = client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train,
                                             hyperparameters={"n_epochs": 2, "batch_size": 8})
        wait_for(client, job.id, lambda j: step_of(j) >= 20, what="training")
        signal_the_trainer(service, signal.SIGTERM)
        resumed = wait_for(client, job.id,
                           lambda j: j.model_extra["preemptions"] == 1 and step_of(j) >= 60,
                           what="a resumed attempt")
        assert resumed.model_extra["failed_attempts"] == 0, "a preemption must not spend a retry"
        assert resumed.model_extra["attempts"] == 0, "the old name reads the same count"
        signal_the_trainer(service, signal.SIGKILL)
        done = wait_for(client, job.id, terminal)
        assert done.status == "succeeded", done.error
        assert done.model_extra["preemptions"] == 1
        assert done.model_extra["failed_attempts"] == 1, "a crash spends one retry"
        assert done.model_extra["attempts"] == 1, "the old name reads the same count"
        assert done.model_extra["progress"]["step"] == 150
        events = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100)]
        resumes = [m for m in events if m.startswith("Resumed from the checkpoint")]
        assert len(resumes) == 2, events
    finally:
        service.stop()


def test_tenant_limits_answer_429_with_retry_after(service):
    from openai import OpenAI

    tenant = "limited-" + uuid.uuid4().hex[:8]
    service.admin("POST", "/admin/tenants", {"id": tenant})
    key = service.admin("POST", f"/admin/tenants/{tenant}/keys")["api_key"]
    # Nothing of this tenant may run, so its jobs stay queued; one may wait.
    limits = {"max_queued": 1, "max_running": 0, "max_upload_bytes": 4096}
    record = service.admin("PUT", f"/admin/tenants/{tenant}/limits", limits)
    assert record["limits"] == limits
    client = OpenAI(base_url=f"{service.url}/v1", api_key=key, max_retries=0)

    # The tenant's upload limit is a quota like the others: 429, naming the field.
    with pytest.raises(openai.RateLimitError) as err:
        upload(client, TRAIN[:200], "big.jsonl")
    assert err.value.code == "tenant_upload_limit" and err.value.param == "file"
    assert err.value.response.headers["retry-after"] == "60"
    train = upload(client, TRAIN[:8], "small.jsonl")

    first = client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train)
    with pytest.raises(openai.RateLimitError) as err:
        client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train)
    assert err.value.code == "too_many_queued_jobs"
    assert err.value.response.headers["retry-after"] == "30"
    # Other tenants are not limited by it: another tenant's job, queued after this one,
    # starts. Once it has, the dispatcher has looked at the line and passed over the
    # limited job, which must still be queued (a condition, not a pause).
    other_client = service_client(service)
    other = other_client.fine_tuning.jobs.create(
        model=DEMO_MODEL, training_file=upload(other_client, TRAIN[:8], "other.jsonl")
    )
    wait_for(other_client, other.id, lambda j: j.status != "queued", what="started")
    assert client.fine_tuning.jobs.retrieve(first.id).status == "queued"
    assert len(list(client.fine_tuning.jobs.list())) == 1, "the refused job was not created"
    other_client.fine_tuning.jobs.cancel(other.id)
    client.fine_tuning.jobs.cancel(first.id)
    assert client.fine_tuning.jobs.retrieve(first.id).status == "cancelled"
    # With room again, a new job is accepted.
    second = client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train)
    client.fine_tuning.jobs.cancel(second.id)


def service_client(service: Service):
    from openai import OpenAI

    return OpenAI(base_url=f"{service.url}/v1", api_key=service.api_key, max_retries=0)
