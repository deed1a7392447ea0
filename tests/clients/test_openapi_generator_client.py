"""A Python client generated from the committed `openapi/openapi.json` with
openapi-generator (generator `python`, its spec validation on, as a customer runs it)
runs a fine-tune end to end against a real `tuneq up` through the client's own API
classes: upload, create, wait, events, checkpoints, and both downloads as bytes."""

from __future__ import annotations

import io
import sys
import tarfile
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT, generated_package

TRAIN = (REPO_ROOT / "examples/data/tiny-task-train.jsonl").read_text().splitlines()
PACKAGE = "tuneq_og_client"


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("openapi-generator")
    # The PyPI package ships the generator's jar; `java` runs it (scripts/setup-test-deps
    # installs both). Validation stays on: a document it refuses is a failure here.
    cli = Path(sys.executable).with_name("openapi-generator-cli")
    command = [str(cli), "generate", "--input-spec", str(REPO_ROOT / "openapi/openapi.json"),
               "--generator-name", "python", "--output", str(out),
               "--package-name", PACKAGE,
               "--global-property", "apiTests=false,modelTests=false,apiDocs=false,modelDocs=false"]
    yield from generated_package(command, out, PACKAGE)


def test_an_openapi_generator_client_runs_a_job_end_to_end(generated, service):
    api_client = generated.ApiClient(generated.Configuration(
        host=service.url, access_token=service.api_key))
    files = generated.FilesApi(api_client)
    fine_tuning = generated.FineTuningApi(api_client)

    data = ("\n".join(TRAIN[:48]) + "\n").encode()
    uploaded = files.upload_file(data, filename="train.jsonl", purpose="fine-tune")
    assert isinstance(uploaded, generated.FileObject), uploaded
    assert uploaded.validation.examples == 48

    # A refusal arrives as the client's exception, with the OpenAI error body.
    with pytest.raises(generated.ApiException) as refused:
        fine_tuning.create_fine_tuning_job(generated.FineTuneCreate(
            model="no-such-model", training_file=uploaded.id))
    assert refused.value.status == 400
    assert generated.ErrorBody.from_json(refused.value.body).error.param == "model"

    job = fine_tuning.create_fine_tuning_job(generated.FineTuneCreate(
        model="tuneq-tiny-demo", training_file=uploaded.id, suffix="openapi-generator",
        # `n_epochs` and `batch_size` are a number or "auto" (oneOf): the client wraps them.
        hyperparameters=generated.HyperparametersRequest(
            n_epochs=generated.AutoOrInt(2), batch_size=generated.AutoOrInt(8))))
    assert isinstance(job, generated.FineTuneJob), job
    deadline = time.monotonic() + 300
    while job.status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"still {job.status}"
        time.sleep(0.5)
        job = fine_tuning.retrieve_fine_tuning_job(job.id)
    assert job.status == "succeeded", job.error
    assert job.progress.step == job.progress.total_steps == 12

    events = fine_tuning.list_fine_tuning_events(job.id, limit=100)
    assert isinstance(events, generated.FineTuneEventList)
    assert events.data[0].message == "The job has successfully completed"
    assert events.data[-1].message == f"Created fine-tuning job: {job.id}"

    checkpoints = fine_tuning.list_fine_tuning_checkpoints(job.id)
    assert isinstance(checkpoints, generated.FineTuneCheckpointList)
    steps = [c.step_number for c in checkpoints.data]
    assert steps and steps == sorted(steps, reverse=True) and steps[0] == 12
    assert all(c.fine_tuning_job_id == job.id for c in checkpoints.data)

    # Downloads come back as the bytes sent: a tar, and the dataset exactly as uploaded.
    archive = fine_tuning.download_adapter(job.id)
    assert isinstance(archive, bytes)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        assert sorted(tar.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]
    content = files.download_file(uploaded.id)
    assert content == data
