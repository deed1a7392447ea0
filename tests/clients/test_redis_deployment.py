"""The production shape on one machine: `tuneq api` and `tuneq dispatcher` as separate
processes sharing a real redis-server (started here) and an object store folder; the
official `openai` SDK runs a fine-tune through them, and a restart of the dispatcher
in the middle of the job loses nothing. Then `tuneq serve`, the deployment that answers
chat requests, serves the fine-tuned model from the same Redis and store, while the API
replicas refuse chat requests with a pointer to it."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT, Process, free_port, tuneq_bin

TRAIN = (REPO_ROOT / "examples/data/tiny-task-train.jsonl").read_text().splitlines()


@pytest.fixture
def redis_url(tmp_path: Path):
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server; "
                    "scripts/setup-test-deps installs it)", pytrace=False)
    port = free_port()
    proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("redis-server did not start", pytrace=False)
            time.sleep(0.1)
    yield f"redis://127.0.0.1:{port}"
    proc.kill()
    proc.wait()


def test_api_and_dispatcher_on_redis_run_a_job_across_a_dispatcher_restart(tmp_path, redis_url):
    import json
    import urllib.request

    from openai import OpenAI

    binary = str(tuneq_bin())
    model = tmp_path / "models" / "tiny"
    subprocess.run([binary, "model", "init", "--preset", "tiny", "--seed", "0",
                    "--out", str(model)], check=True, capture_output=True)
    secret = secrets.token_hex(32)
    admin = "tq_admin_" + secrets.token_hex(16)
    api = Process([binary, "api", "--redis", redis_url, "--port", "0", "--host", "127.0.0.1",
                   "--store", (tmp_path / "objects").as_uri(), "--pool", "cpu-pool=cpu",
                   "--model", f"tiny={model}", "--attempt-secret", secret,
                   "--admin-key", admin, "--spool-dir", str(tmp_path / "spool")],
                  ready="tuneq api is up at ")
    url = api.line.removeprefix("tuneq api is up at ").strip()
    dispatcher_args = [binary, "dispatcher", "--redis", redis_url, "--api-url", url,
                       "--attempt-secret", secret, "--pool", "cpu-pool",
                       "--work-dir", str(tmp_path / "work")]
    dispatcher = Process(dispatcher_args, ready="tuneq dispatcher serves")
    try:
        def admin_post(path: str, body: dict | None = None) -> dict:
            request = urllib.request.Request(
                url + path, method="POST", data=json.dumps(body or {}).encode(),
                headers={"Authorization": f"Bearer {admin}", "Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                return json.loads(response.read())

        admin_post("/admin/tenants", {"id": "acme"})
        key = admin_post("/admin/tenants/acme/keys")["api_key"]
        client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny"]
        data = ("\n".join(TRAIN) + "\n").encode()
        train = client.files.create(file=("train.jsonl", data), purpose="fine-tune").id
        job = client.fine_tuning.jobs.create(model="tiny", training_file=train,
                                             hyperparameters={"n_epochs": 2})

        def progress() -> tuple[str, int]:
            j = client.fine_tuning.jobs.retrieve(job.id)
            return j.status, int(((j.model_extra or {}).get("progress") or {}).get("step") or 0)

        deadline = time.monotonic() + 300
        while progress()[1] < 20:
            assert time.monotonic() < deadline, "no training progress"
            time.sleep(0.5)
        dispatcher.stop()  # checkpoints, and the job goes back in line
        dispatcher = Process(dispatcher_args, ready="tuneq dispatcher serves")
        while True:
            status, _ = progress()
            if status in ("succeeded", "failed", "cancelled"):
                break
            assert time.monotonic() < deadline + 300, f"still {status}"
            time.sleep(0.5)
        done = client.fine_tuning.jobs.retrieve(job.id)
        assert done.status == "succeeded", done.error
        assert done.model_extra["preemptions"] == 1
        assert done.fine_tuned_model in [m.id for m in client.models.list()]
        messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100)]
        assert any(m.startswith("Resumed from the checkpoint") for m in messages), messages
        answered_by_serve(binary, redis_url, tmp_path, secret, key, url, done.fine_tuned_model)
    finally:
        dispatcher.stop()
        api.stop()


def answered_by_serve(binary: str, redis_url: str, tmp_path: Path, secret: str, key: str,
                      api_url: str, model: str) -> None:
    """`tuneq serve` on the API's Redis and store answers with `model`; the API does not."""
    import openai
    from openai import OpenAI

    serve = Process([binary, "serve", "--redis", redis_url, "--port", "0", "--host", "127.0.0.1",
                     "--store", (tmp_path / "objects").as_uri(), "--attempt-secret", secret,
                     "--spool-dir", str(tmp_path / "spool-serve"),
                     "--cache-dir", str(tmp_path / "serve-cache"), "--max-generations", "2"],
                    ready="tuneq serve is up at ")
    try:
        url = serve.line.removeprefix("tuneq serve is up at ").strip()
        client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Repeat: tree star"}],
            max_tokens=4, temperature=0)
        assert answer.model == model and answer.usage.completion_tokens >= 1
        with pytest.raises(openai.InternalServerError) as refused:
            OpenAI(base_url=f"{api_url}/v1", api_key=key, max_retries=0).chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert refused.value.status_code == 503
        assert refused.value.code == "inference_unavailable"
    finally:
        serve.stop()
