"""Webhooks through real clients: a job's `webhook_url` gets a Standard Webhooks event
that the official `openai` SDK's `client.webhooks.unwrap()` verifies, a failed try is
retried with the same event id, and targets that would reach inside the network are
refused when the job is created."""

from __future__ import annotations

import http.server
import json
import threading
import time

import openai
import pytest

from conftest import Service
from test_openai_fine_tuning import DEMO_MODEL, TRAIN, http_get, terminal, upload, wait_for


class Receiver:
    """An HTTP endpoint on loopback that answers `statuses` in turn (then 200) and keeps
    every request it got."""

    def __init__(self, statuses: list[int]):
        self.statuses = list(statuses)
        self.requests: list[tuple[dict[str, str], bytes]] = []
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (the stdlib's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.requests.append(({k.lower(): v for k, v in self.headers.items()}, body))
                status = receiver.statuses.pop(0) if receiver.statuses else 200
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/tuneq?token=abc"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.requests) < count:
            if time.monotonic() > deadline:
                pytest.fail(f"{len(self.requests)} webhook requests after {timeout} s, "
                            f"expected {count}")
            time.sleep(0.2)

    def close(self) -> None:
        self.server.shutdown()


def test_targets_inside_the_network_are_refused_at_create(client):
    train = upload(client, TRAIN[:16], "small.jsonl")
    before = len(list(client.fine_tuning.jobs.list()))
    for url in ["http://hooks.example.com/x", "https://127.0.0.1:8443/x",
                "https://169.254.169.254/latest/meta-data/", "https://[::1]/x",
                "https://metadata.google.internal/", "ftp://hooks.example.com/",
                "https://user:secret@hooks.example.com/"]:
        with pytest.raises(openai.BadRequestError) as err:
            client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train,
                                           extra_body={"webhook_url": url})
        assert err.value.param == "webhook_url", (url, err.value.body)
        assert err.value.code == "invalid_webhook_url", (url, err.value.body)
    assert len(list(client.fine_tuning.jobs.list())) == before, "nothing was created"


def test_a_finished_job_sends_a_signed_event_and_retries_a_failed_try(tmp_path):
    receiver = Receiver(statuses=[503])
    service = Service(tmp_path / "tuneq", extra_args=["--webhook-allow-private"])
    try:
        from openai import OpenAI

        client = OpenAI(base_url=f"{service.url}/v1", api_key=service.api_key, max_retries=0)
        train = upload(client, TRAIN[:16], "small.jsonl")
        job = client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train,
                                             extra_body={"webhook_url": receiver.url})
        assert job.model_extra["webhook"] == {
            "url": receiver.url, "status": "waiting", "attempts": 0,
            "delivered_at": None, "last_error": None}
        client.fine_tuning.jobs.cancel(job.id)
        assert wait_for(client, job.id, terminal, timeout=120).status == "cancelled"

        # The first try is answered 503; the retry, 5 s later, is taken.
        receiver.wait(2, timeout=60)
        (first_headers, first_body), (headers, body) = receiver.requests[:2]
        assert first_headers["webhook-id"] == headers["webhook-id"], "one event id for all tries"
        assert first_body == body
        assert int(headers["webhook-timestamp"]) >= int(first_headers["webhook-timestamp"])

        secret = json.loads(http_get(service, "/webhooks/secret"))["secret"]
        assert secret.startswith("whsec_")
        event = client.webhooks.unwrap(body, headers, secret=secret)
        assert event.type == "fine_tuning.job.cancelled"
        assert event.data.id == job.id
        assert event.id == headers["webhook-id"]
        with pytest.raises(openai.InvalidWebhookSignatureError):
            client.webhooks.unwrap(body.replace(b"cancelled", b"succeeded"), headers,
                                   secret=secret)

        deadline = time.monotonic() + 30
        while True:
            webhook = client.fine_tuning.jobs.retrieve(job.id).model_extra["webhook"]
            if webhook["status"] == "delivered" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert webhook["status"] == "delivered", webhook
        assert webhook["attempts"] == 2
        assert webhook["delivered_at"] is not None
        # A rotation: for a day, events carry a signature by each secret, so a receiver
        # still on the old one, or already on the new one, verifies them.
        rotated = json.loads(_request(service, "POST", "/webhooks/secret/rotate"))
        assert rotated["secret"].startswith("whsec_") and rotated["secret"] != secret
        assert rotated["previous_expires_at"] > time.time() + 23 * 3600
        assert json.loads(http_get(service, "/webhooks/secret"))["secret"] == rotated["secret"]
        second = client.fine_tuning.jobs.create(model=DEMO_MODEL, training_file=train,
                                                extra_body={"webhook_url": receiver.url})
        client.fine_tuning.jobs.cancel(second.id)
        receiver.wait(3, timeout=60)
        headers, body = receiver.requests[2]
        assert len(headers["webhook-signature"].split(" ")) == 2
        for key in (secret, rotated["secret"]):
            assert client.webhooks.unwrap(body, headers, secret=key).data.id == second.id

        log = "".join(service.output)
        assert secret not in log and rotated["secret"] not in log, "secrets are never logged"
        assert "token=abc" not in log, "nor the webhook URL, which may carry a token"
    finally:
        service.stop()
        receiver.close()


def _request(service: Service, method: str, path: str) -> bytes:
    import urllib.request

    request = urllib.request.Request(service.url + path, method=method,
                                     headers=service.headers())
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read()
