"""schemathesis fuzzes every operation of the committed `openapi/openapi.json` against a
real `tuneq up`: no 5xx, every response (status, content type, headers, body) as the
document declares, schema-violating requests refused with 4xx, unknown methods 405.

The service is seeded first, so the `{id}` routes see real ids and not only 404s: two
uploaded files (one of them only for `DELETE`), a job that trained to `succeeded` (its
adapter, checkpoints and events exist), a second one whose model is the one `DELETE
/v1/models/{model}` is given, a cancelled one, and a tenant with API keys for
the admin routes, which run with the admin key. The seeds are offered for path `id`s
(`[dictionaries]` in the config the test writes), besides the ids schemathesis takes
from the answers it gets. After the run, its HAR report must show a 2xx from every
`{id}` route family (bar those listed in `NEVER_2XX`, with the reason), so a seeding
that stopped reaching them fails the test.

Two known defects are excluded narrowly, each marked KNOWN DEFECT in `config`.

`ignored_auth` sends each operation it sees answer 2xx one request with a wrong key,
and every wrong key spends one of the client address's failed authentications (30, see
api/src/throttle.rs): past them, every answer is a 429. So it probes the `/v1/` routes
and not their native twins (`/files/…` is `/v1/files/…`'s handler, see `twin`), which
keeps the run's wrong keys under the budget however fast they come.

`positive_data_acceptance` is left out on purpose: a request can match the schema and
still be refused for what it means (an unknown model, a file that does not exist), and
that refusal is the documented 400."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

from conftest import REPO_ROOT, Service
from test_openai_fine_tuning import DEMO_MODEL, TRAIN

DOCUMENT = REPO_ROOT / "openapi/openapi.json"

# Failed authentications one address may have at once (`BURST` in api/src/throttle.rs).
FAILED_AUTH_BURST = 30
# The native twins of the `/v1/` routes, which `ignored_auth` leaves to their twins.
NATIVE_TWINS = r"^/(files|finetunes|models)(/|$)"

# `{id}` operations a seeded id cannot make succeed, and why.
NEVER_2XX = {
    # The service's objects are on local disk, which has no presigned URLs (400).
    ("GET", "/v1/fine_tuning/jobs/{id}/adapter/urls"),
    ("GET", "/finetunes/{id}/adapter/urls"),
    # Only finished jobs are seeded (a waiting one would train during the run), and
    # cancelling, pausing or resuming a finished job is the documented 400
    # `job_already_finished`.
    ("POST", "/v1/fine_tuning/jobs/{id}/cancel"),
    ("POST", "/finetunes/{id}/cancel"),
    ("POST", "/v1/fine_tuning/jobs/{id}/pause"),
    ("POST", "/finetunes/{id}/pause"),
    ("POST", "/v1/fine_tuning/jobs/{id}/resume"),
    ("POST", "/finetunes/{id}/resume"),
    # schemathesis 4.32 fills its two path parameters from what it has seen, not from
    # the seeds (neither a dictionary nor a fixed value in the config took effect).
    ("DELETE", "/admin/tenants/{id}/keys/{key_id}"),
}


def twin(path: str) -> str:
    """The route family of `path`: `/v1/files/…` and `/files/…` are one handler (and
    so are `/v1/fine_tuning/jobs/…` and `/finetunes/…`); a 2xx on either counts."""
    return (path.replace("/v1/fine_tuning/jobs", "/finetunes").replace("/v1/files", "/files")
            .replace("/v1/models", "/models"))


def call(service: Service, method: str, path: str, key: str, body=None, raw: bytes | None = None,
         content_type: str = "application/json"):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(
        service.url + path, method=method, data=data,
        headers={"Authorization": f"Bearer {key}", "Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read() or b"null")


def seed(service: Service) -> dict[str, list[str]]:
    """Files, jobs, a tenant and its keys, made through the API; their ids by kind."""
    key = service.api_key
    data = ("\n".join(TRAIN[:16]) + "\n").encode()
    files = [call(service, "POST", f"/v1/files?filename=seed-{i}.jsonl", key, raw=data,
                  content_type="application/octet-stream")["id"] for i in range(4)]
    trained, spare = (call(service, "POST", "/v1/fine_tuning/jobs", key, {
        "model": DEMO_MODEL, "training_file": files[0],
        "hyperparameters": {"n_epochs": 1, "batch_size": 4}})["id"] for _ in range(2))
    cancelled = call(service, "POST", "/v1/fine_tuning/jobs", key, {
        "model": DEMO_MODEL, "training_file": files[0]})["id"]
    call(service, "POST", f"/v1/fine_tuning/jobs/{cancelled}/cancel", key)
    deadline = time.monotonic() + 120
    models = []
    for job in (trained, spare):
        while (done := call(service, "GET", f"/v1/fine_tuning/jobs/{job}", key))["status"] \
                != "succeeded":
            status = done["status"]
            assert status not in ("failed", "cancelled"), f"the seed job ended {status}"
            assert time.monotonic() < deadline, f"the seed job is still {status} after 120 s"
            time.sleep(0.5)
        models.append(done["fine_tuned_model"])
    # A paused job that continues the trained job's model keeps that model from being
    # deleted (400 `model_in_use`): schemathesis' stateful phase ignores the operations'
    # dictionaries and deletes whatever fine-tuned model it learnt from a listing, after
    # which the adapter routes could only answer 410.
    keeper = call(service, "POST", "/v1/fine_tuning/jobs", key, {
        "model": models[0], "training_file": files[0]})["id"]
    call(service, "POST", f"/v1/fine_tuning/jobs/{keeper}/pause", key)
    while (kept := call(service, "GET", f"/v1/fine_tuning/jobs/{keeper}", key))["status"] \
            != "paused":
        assert kept["status"] in ("queued", "running"), f"the keeper job is {kept['status']}"
        assert time.monotonic() < deadline, "the keeper job did not pause"
        time.sleep(0.5)
    # Base models only `DELETE /admin/models/{id}` draws (the demo model stays: the
    # paused keeper job trains on it, so removing it is refused anyway): the demo model's
    # folder under other ids (registration checks a folder; removing one leaves it).
    spare_bases = [f"spare-base-{i}" for i in range(3)]
    demo_folder = str(service.data_dir / "models" / DEMO_MODEL)
    for base in spare_bases:
        service.admin("POST", "/admin/models", {"id": base, "location": demo_folder})
    tenant = "fuzzed-tenant"
    service.admin("POST", "/admin/tenants", {"id": tenant})
    for _ in range(3):
        service.admin("POST", f"/admin/tenants/{tenant}/keys")
    return {"files": files[:2], "spare_v1": files[2:3], "spare_native": files[3:],
            "jobs": [trained, cancelled], "trained": [trained], "tenants": [tenant],
            # Not the trained job's model: schemathesis also draws `DELETE`'s model from
            # here, and deleting it would answer the adapter routes 410.
            "models": [DEMO_MODEL], "spare_models": models[1:], "spare_bases": spare_bases}


def config(service: Service, ids: dict[str, list[str]]) -> str:
    """schemathesis.toml: the tenant key on every route, the admin key on admin routes,
    and the seeded ids as what `{id}` is drawn from."""
    lines = [f'headers = {{ Authorization = "Bearer {service.api_key}" }}', "",
             # Every check but `positive_data_acceptance` (see the module's doc).
             "[checks]", "positive_data_acceptance = { enabled = false }", ""]
    for name, values in ids.items():
        lines += [f"[dictionaries.{name}]", f"values = {json.dumps(values)}", ""]

    def operation(regex: str, method: str | None, bindings: dict[str, str],
                  admin: bool = False, off: tuple[str, ...] = (), always: bool = False) -> None:
        nonlocal lines
        # One filter on the operation's name ("METHOD /path"): schemathesis ORs the
        # `include-*` keys of an entry, so `include-path-regex` with `include-method` would
        # also give this entry's settings (the admin key, dictionaries) to every operation
        # of that method, and the admin key sent to the tenant routes spent the address's
        # failed-authentication budget.
        name = f"^{method or '[A-Z]+'} {regex.removeprefix('^')}"
        lines += ["[[operations]]", f"include-name-regex = {json.dumps(name)}"]
        if admin:
            lines.append(f'headers = {{ Authorization = "Bearer {service.admin_key}" }}')
        probability = 1.0 if always else 0.8
        params = ", ".join(f'"path.{p}" = {{ dictionary = "{d}", probability = {probability} }}'
                           for p, d in bindings.items())
        if params:
            lines.append(f"parameters = {{ {params} }}")
        if off:
            checks = ", ".join(f"{check} = {{ enabled = false }}" for check in off)
            lines.append(f"checks = {{ {checks} }}")
        lines.append("")

    # `DELETE` takes only a spare file of its own, so the others stay readable all along.
    operation(r"^/(v1/)?files/\{id\}", "GET", {"id": "files"})
    # `DELETE` a model takes the spare job's only, every time (a name it learnt from an
    # answer, such as the trained job's `fine_tuned_model`, would delete the adapter the
    # adapter routes must answer 2xx with).
    operation(r"^/(v1/)?models/\{model\}$", "GET", {"model": "models"})
    operation(r"^/(v1/)?models/\{model\}$", "DELETE", {"model": "spare_models"}, always=True)
    operation(r"^/v1/files/\{id\}$", "DELETE", {"id": "spare_v1"})
    operation(r"^/files/\{id\}$", "DELETE", {"id": "spare_native"})
    # KNOWN DEFECT, left to the API's owners (issue 14): with a real job the event
    # stream (`?stream=true`) is reached, and its `text/event-stream` answer is documented
    # as one string, not as events. Remove this exclusion once the document says so.
    operation(r"^/(v1/fine_tuning/jobs|finetunes)/\{id\}/events$", None, {"id": "jobs"},
              off=("response_schema_conformance",))
    # Only the trained job has an adapter: drawn every time, the download routes answer
    # 2xx in every run (drawn from `jobs` four times in five, a run of a few examples
    # could miss it and never reach them with a real id).
    operation(r"^/(v1/fine_tuning/jobs|finetunes)/\{id\}/adapter$", "GET", {"id": "trained"},
              always=True)
    operation(r"^/(v1/fine_tuning/jobs|finetunes)/\{id\}", None, {"id": "jobs"})
    operation(r"^/admin/tenants/\{id\}/keys/", None, {}, admin=True)
    operation(r"^/admin/tenants/\{id\}/keys$", None, {"id": "tenants"}, admin=True)
    # KNOWN DEFECTS, left to the API's owners (issue 14): a JSON array (`[]`) is accepted
    # as the limits object and read as "no limits", and `max_queued`/`max_running` are
    # documented as int32 but take values past 2^31. Remove this exclusion once fixed.
    operation(r"^/admin/tenants/\{id\}/limits$", None, {"id": "tenants"}, admin=True,
              off=("negative_data_rejection",))
    operation(r"^/admin/tenants$", None, {}, admin=True)
    operation(r"^/admin/models$", None, {}, admin=True)
    operation(r"^/admin/models/\{id\}$", "DELETE", {"id": "spare_bases"}, admin=True, always=True)
    # A wrong key for one handler is enough (see the module's doc).
    operation(NATIVE_TWINS, None, {}, off=("ignored_auth",))
    return "\n".join(lines)


def answered(har: Path) -> dict[tuple[str, str], set[int]]:
    """The statuses each documented operation answered, from schemathesis's HAR report."""
    document = json.loads(DOCUMENT.read_text())
    templates = [(re.compile("^" + re.sub(r"\\\{[a-z_]+\\\}", "[^/]+", re.escape(p)) + "$"), p)
                 for p in document["paths"]]
    seen: dict[tuple[str, str], set[int]] = {}
    for entry in json.loads(har.read_text())["log"]["entries"]:
        path = urllib.parse.urlsplit(entry["request"]["url"]).path
        for pattern, template in templates:
            if pattern.match(path):
                key = (entry["request"]["method"].upper(), template)
                seen.setdefault(key, set()).add(entry["response"]["status"])
                break
    return seen


def test_every_operation_conforms_to_the_document(tmp_path: Path):
    # `ignored_auth`'s wrong keys, one per operation at most, fit the address's budget.
    document = json.loads(DOCUMENT.read_text())
    probed = [(method, path) for path, item in document["paths"].items()
              for method, op in item.items() if method in ("get", "post", "put", "delete", "patch")
              and any(op.get("security", document.get("security", [])))  # `[{}]`: no key
              and not re.match(NATIVE_TWINS, path)]
    assert len(probed) <= FAILED_AUTH_BURST, (
        f"ignored_auth may send {len(probed)} wrong keys, past the {FAILED_AUTH_BURST} failed "
        "authentications an address has: leave it to fewer operations")
    # Answers of a few tokens: the chat routes' examples must not spend the time budget
    # that every other operation needs (an answer to a learnt model name would otherwise
    # run to the end of the demo model's context).
    service = Service(tmp_path / "data", extra_args=["--max-answer-tokens", "8"])
    try:
        ids = seed(service)
        config_file = tmp_path / "schemathesis.toml"
        config_file.write_text(config(service, ids))
        cli = Path(sys.executable).with_name("schemathesis")
        report = tmp_path / "report"
        result = subprocess.run(
            [str(cli), "--config-file", str(config_file), "run", str(DOCUMENT),
             "--url", service.url,
             "--max-examples", os.environ.get("TUNEQ_SCHEMATHESIS_EXAMPLES", "20"),
             "--max-time", os.environ.get("TUNEQ_SCHEMATHESIS_SECONDS", "90"),
             "--seed", "1", "--report", "har", "--report-dir", str(report)],
            capture_output=True, text=True, timeout=600,
        )
        assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
        assert "passed" in result.stdout

        # The seeding reached the `{id}` routes: each answered a 2xx at least once.
        seen = answered(next(report.glob("har-*.json")))
        with_ids = {(method.upper(), path) for path, item in document["paths"].items()
                    if "{" in path for method in item
                    if method in ("get", "post", "put", "delete", "patch")}
        # The adapter downloads may also answer 410: the trained job is real, but the
        # stateful phase can cancel the keeper job (ids it learnt from a listing) and
        # then delete the model, whose adapter is then gone; 410 still shows the id
        # reached the route (an unknown id is 404).
        gone_is_reached = {("GET", "/v1/fine_tuning/jobs/{id}/adapter"),
                           ("GET", "/finetunes/{id}/adapter")}
        ok = {(method, twin(path)) for (method, path), statuses in seen.items()
              if any(200 <= s < 300 or (s == 410 and (method, path) in gone_is_reached)
                     for s in statuses)}
        missed = sorted(op for op in with_ids - NEVER_2XX if (op[0], twin(op[1])) not in ok)
        assert not missed, f"never answered 2xx, so never reached with a real id: {missed}"
    finally:
        service.stop()
