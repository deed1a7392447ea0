"""Experiment tracking in a real `mlflow server` started here: a job created through
the official `openai` SDK with `integrations: [{"type": "mlflow", …}]` gets a run in its
tenant's experiment with its parameters, every step's metrics and the adapter as
artifacts (byte for byte the one the job serves), ended FINISHED or KILLED as the job
ends; `wandb`, a server without a tracking server and one whose tracking server is down
refuse the create, naming the field."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from conftest import Service, free_port
from test_openai_fine_tuning import (DEMO_MODEL, TRAIN, VALID, http_get, refusal, terminal, upload,
                                     wait_for)


@pytest.fixture(scope="module")
def mlflow_url(tmp_path_factory):
    cli = Path(sys.executable).with_name("mlflow")
    if not cli.exists():
        pytest.fail(f"mlflow is not installed at {cli} (scripts/setup-test-deps installs "
                    "tests/clients/requirements.txt into .venv)", pytrace=False)
    root = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [str(cli), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
         "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                if answer.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("mlflow server did not start:\n" + (root / "server.log").read_text()[-5000:],
                        pytrace=False)
        time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


def raw_job(service: Service, job_id: str) -> dict:
    return json.loads(http_get(service, f"/v1/fine_tuning/jobs/{job_id}"))


def ended(tracking, run_id: str, status: str):
    deadline = time.monotonic() + 60
    while (run := tracking.get_run(run_id)).info.status != status:
        assert time.monotonic() < deadline, f"run {run_id} is {run.info.status}, not {status}"
        time.sleep(0.5)
    return run


def test_a_job_is_tracked_with_its_params_every_steps_metrics_and_its_adapter(mlflow_url, tmp_path):
    from mlflow.tracking import MlflowClient

    tracking = MlflowClient(tracking_uri=mlflow_url)
    service = Service(tmp_path / "data", extra_args=["--mlflow-tracking-uri", mlflow_url])
    try:
        client = OpenAI(base_url=f"{service.url}/v1", api_key=service.api_key, max_retries=0)
        train = upload(client, TRAIN[:96], "train.jsonl")
        valid = upload(client, VALID[:16], "valid.jsonl")
        job = client.fine_tuning.jobs.create(
            model=DEMO_MODEL, training_file=train, validation_file=valid, suffix="tracked",
            seed=3, hyperparameters={"n_epochs": 2, "batch_size": 8},
            integrations=[{"type": "mlflow", "mlflow": {"experiment_name": "support-bot",
                                                         "tags": {"team": "search"}}}])
        shown = raw_job(service, job.id)["integrations"]
        assert [i["type"] for i in shown] == ["mlflow"]
        run_id = shown[0]["mlflow"]["run_id"]
        assert shown[0]["mlflow"]["experiment_name"] == "default/support-bot"
        assert shown[0]["mlflow"]["run_name"] == "tracked"

        done = wait_for(client, job.id, terminal)
        assert done.status == "succeeded", done.error
        run = ended(tracking, run_id, "FINISHED")
        assert tracking.get_experiment(run.info.experiment_id).name == "default/support-bot"
        assert run.info.run_name == "tracked"
        params = run.data.params
        assert (params["model"], params["training_file"], params["validation_file"]) == (
            DEMO_MODEL, train, valid)
        assert (params["n_epochs"], params["batch_size"], params["seed"]) == ("2", "8", "3")
        assert params["method"] == "supervised" and params["lora_r"] == "8"
        assert run.data.tags["team"] == "search" and run.data.tags["tuneq.job_id"] == job.id
        assert run.data.tags["tuneq.fine_tuned_model"] == done.fine_tuned_model

        # Every step's training figures; the validations' at the steps they ran.
        losses = tracking.get_metric_history(run_id, "train_loss")
        assert sorted(m.step for m in losses) == list(range(1, 25))
        assert all(m.value > 0 for m in losses)
        accuracy = tracking.get_metric_history(run_id, "train_mean_token_accuracy")
        assert len(accuracy) == 24 and all(0 <= m.value <= 1 for m in accuracy)
        validated = tracking.get_metric_history(run_id, "valid_loss")
        assert validated and max(m.step for m in validated) == 24
        assert len(tracking.get_metric_history(run_id, "learning_rate")) == 24

        # The adapter, as the run's artifacts, is the one the job serves.
        names = sorted(Path(a.path).name for a in tracking.list_artifacts(run_id, "adapter"))
        assert names == ["adapter_config.json", "adapter_model.safetensors"]
        downloaded = Path(tracking.download_artifacts(run_id, "adapter", str(tmp_path)))
        archive = http_get(service, f"/v1/fine_tuning/jobs/{job.id}/adapter")
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            for name in names:
                served = tar.extractfile(name)
                assert served is not None and served.read() == (downloaded / name).read_bytes()

        # A cancelled job's run ends KILLED.
        cancelled = client.fine_tuning.jobs.create(
            model=DEMO_MODEL, training_file=train, hyperparameters={"n_epochs": 20},
            integrations=[{"type": "mlflow"}])
        killed_id = raw_job(service, cancelled.id)["integrations"][0]["mlflow"]["run_id"]
        client.fine_tuning.jobs.cancel(cancelled.id)
        assert wait_for(client, cancelled.id, terminal, timeout=120).status == "cancelled"
        killed = ended(tracking, killed_id, "KILLED")
        assert tracking.get_experiment(killed.info.experiment_id).name == "default/fine-tunes"
        assert killed.info.run_name == cancelled.id, "an unnamed run is named after its job"

        # Out-of-bounds requests are refused naming the field, and open no run.
        runs_before = len(tracking.search_runs([run.info.experiment_id]))
        reserved = [{"type": "mlflow", "mlflow": {"experiment_name": "support-bot",
                                                  "tags": {"mlflow.user": "x"}}}]
        assert refusal(lambda: client.fine_tuning.jobs.create(
            model=DEMO_MODEL, training_file=train, integrations=reserved)) == (
            "unsupported_integration", "integrations[0].mlflow.tags.mlflow.user")
        wandb = [{"type": "wandb", "wandb": {"project": "my-project"}}]
        assert refusal(lambda: client.fine_tuning.jobs.create(
            model=DEMO_MODEL, training_file=train, integrations=wandb)) == (
            "unsupported_integration", "integrations[0].type")
        assert len(tracking.search_runs([run.info.experiment_id])) == runs_before
    finally:
        service.stop()


def test_tracking_is_refused_where_no_tracking_server_is_configured_or_it_is_down(client, tmp_path):
    train = upload(client, TRAIN[:16], "train.jsonl")
    asked = [{"type": "mlflow", "mlflow": {"experiment_name": "x"}}]
    assert refusal(lambda: client.fine_tuning.jobs.create(
        model=DEMO_MODEL, training_file=train, integrations=asked)) == (
        "unsupported_integration", "integrations[0].type")

    down = f"http://127.0.0.1:{free_port()}"
    service = Service(tmp_path / "data", extra_args=["--mlflow-tracking-uri", down])
    try:
        other = OpenAI(base_url=f"{service.url}/v1", api_key=service.api_key, max_retries=0)
        train = upload(other, TRAIN[:16], "train.jsonl")
        with pytest.raises(openai.InternalServerError) as caught:
            other.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train, integrations=asked)
        assert caught.value.status_code == 503 and caught.value.code == "integration_unavailable"
        assert not list(other.fine_tuning.jobs.list()), "a refused create leaves no job"
    finally:
        service.stop()
