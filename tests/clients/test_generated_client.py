"""A Python client generated from the committed `openapi/openapi.json` (with
openapi-python-client, as a customer would) runs a fine-tune end to end against a real
`tuneq up`, parsing every answer with the document's own models."""

from __future__ import annotations

import io
import sys
import tarfile
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT, generated_package

TRAIN = (REPO_ROOT / "examples/data/tiny-task-train.jsonl").read_text().splitlines()


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("generated")
    cli = Path(sys.executable).with_name("openapi-python-client")
    command = [str(cli), "generate", "--path", str(REPO_ROOT / "openapi/openapi.json"),
               "--meta", "none", "--output-path", str(out / "tuneq_client")]
    yield from generated_package(command, out, "tuneq_client")


def test_a_generated_client_runs_a_job_end_to_end(generated, service):
    from tuneq_client import AuthenticatedClient
    from tuneq_client.api.files import upload_file_native
    from tuneq_client.api.fine_tuning import (
        create_fine_tuning_job, download_adapter_native, list_fine_tuning_events_native,
        retrieve_fine_tuning_job_native)
    from tuneq_client.api.models import list_models
    from tuneq_client.models import (ErrorBody, FileObject, FineTuneCreate, FineTuneEventList,
                                     FineTuneJob, HyperparametersRequest, ModelList)
    from tuneq_client.types import File

    client = AuthenticatedClient(base_url=service.url, token=service.api_key)
    data = ("\n".join(TRAIN[:48]) + "\n").encode()
    uploaded = upload_file_native.sync(
        client=client, body=File(payload=io.BytesIO(data), file_name="train.jsonl"),
        filename="train.jsonl")
    assert isinstance(uploaded, FileObject), uploaded
    assert uploaded.validation.examples == 48

    refused = create_fine_tuning_job.sync(
        client=client, body=FineTuneCreate(model="no-such-model", training_file=uploaded.id))
    assert isinstance(refused, ErrorBody) and refused.error.param == "model"

    job = create_fine_tuning_job.sync(client=client, body=FineTuneCreate(
        model="tuneq-tiny-demo", training_file=uploaded.id, suffix="generated",
        hyperparameters=HyperparametersRequest(n_epochs=2, batch_size=8)))
    assert isinstance(job, FineTuneJob), job
    deadline = time.monotonic() + 300
    while job.status not in ("succeeded", "failed", "cancelled"):
        assert time.monotonic() < deadline, f"still {job.status}"
        time.sleep(0.5)
        job = retrieve_fine_tuning_job_native.sync(job.id, client=client)
        assert isinstance(job, FineTuneJob), job
    assert job.status == "succeeded", job.error
    assert job.progress.step == job.progress.total_steps == 12

    events = list_fine_tuning_events_native.sync(job.id, client=client, limit=100)
    assert isinstance(events, FineTuneEventList)
    assert events.data[0].message == "The job has successfully completed"
    models = list_models.sync(client=client)
    assert isinstance(models, ModelList)
    assert job.fine_tuned_model in [m.id for m in models.data]

    archive = download_adapter_native.sync_detailed(job.id, client=client)
    assert archive.status_code == 200
    with tarfile.open(fileobj=io.BytesIO(archive.content)) as tar:
        assert sorted(tar.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]
