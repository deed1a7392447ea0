"""`tuneq up` as a process, the way a new user meets it: the base models it is given,
the API key it prints (once) and retires, the admin key it refuses, and the trainer it
takes down with it when it is killed."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from conftest import REPO_ROOT, Process, Service, tuneq_bin

TRAIN = (REPO_ROOT / "examples/data/tiny-task-train.jsonl").read_text()


def call(url: str, key: str, method: str = "GET", body: bytes | None = None,
         content_type: str = "application/json") -> tuple[int, dict]:
    request = urllib.request.Request(url, method=method, data=body, headers={
        "Authorization": f"Bearer {key}", "Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_models_given_with_model_are_registered_beside_the_demo(tmp_path):
    model = tmp_path / "mine"
    subprocess.run([str(tuneq_bin()), "model", "init", "--out", str(model)], check=True,
                   capture_output=True, timeout=120)
    service = Service(tmp_path / "data", extra_args=["--model", f"my-llama={model}"])
    try:
        status, models = call(f"{service.url}/v1/models", service.api_key)
        assert status == 200
        ids = {m["id"] for m in models["data"]}
        assert {"tuneq-tiny-demo", "my-llama"} <= ids, ids
        status, file = call(f"{service.url}/v1/files?filename=t.jsonl", service.api_key,
                            "POST", TRAIN.encode(), "application/octet-stream")
        assert status == 200, file
        status, job = call(f"{service.url}/v1/fine_tuning/jobs", service.api_key, "POST",
                           json.dumps({"model": "my-llama", "training_file": file["id"]}).encode())
        assert status == 200, job
    finally:
        service.stop()
    # A folder that is not a model is refused at start, naming it.
    bad = subprocess.run([str(tuneq_bin()), "up", "--port", "0", "--data-dir", str(tmp_path / "d2"),
                          "--model", f"nope={tmp_path}"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2, bad.stderr
    assert "config.json" in bad.stderr


def banner(process: Process) -> str:
    """The start-up banner, once it is all out (its "API key file" line comes after the
    key's)."""
    deadline = time.monotonic() + 30
    while not any("API key file" in line for line in process.output):
        assert time.monotonic() < deadline, "".join(process.output)
        time.sleep(0.05)
    return "".join(process.output)


def test_the_key_is_printed_once_and_a_replaced_key_stops_working(tmp_path):
    data = tmp_path / "data"
    first = Process([str(tuneq_bin()), "up", "--port", "0", "--data-dir", str(data)],
                    ready="tuneq is up at ", timeout=30)
    printed = banner(first)
    first.stop()
    generated = (data / "api-key").read_text().strip()
    assert generated in printed, "a new key is printed"
    assert oct((data / "api-key").stat().st_mode & 0o777) == "0o600"

    again = Process([str(tuneq_bin()), "up", "--port", "0", "--data-dir", str(data)],
                    ready="tuneq is up at ", timeout=30)
    url = again.line.removeprefix("tuneq is up at ").strip()
    try:
        assert generated not in banner(again), "a kept key is not printed"
        assert call(f"{url}/v1/models", generated)[0] == 200
    finally:
        again.stop()

    replacement = Service(data, api_key="tq_" + secrets.token_hex(20))
    try:
        assert call(f"{replacement.url}/v1/models", replacement.api_key)[0] == 200
        status, body = call(f"{replacement.url}/v1/models", generated)
        assert status == 401, body
        assert replacement.api_key not in banner(replacement), "a given key is not printed"
    finally:
        replacement.stop()


def test_a_short_admin_key_is_refused_at_start(tmp_path):
    result = subprocess.run([str(tuneq_bin()), "up", "--port", "0", "--data-dir", str(tmp_path),
                             "--admin-key", "admin"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "at least 32 characters" in result.stderr


def refused_start(data: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Starts `tuneq up` expecting it to refuse (exit 2); its stderr."""
    result = subprocess.run([str(tuneq_bin()), "up", "--port", "0", "--data-dir", str(data),
                             *args], capture_output=True, text=True, timeout=60,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 2, result.stdout + result.stderr
    return result.stderr


def test_long_but_guessable_keys_are_refused_at_start(tmp_path):
    for weak in ["a" * 32, "ab" * 16, "passwordpassword" * 2]:
        stderr = refused_start(tmp_path / "data", "--admin-key", weak)
        assert "too easy to guess" in stderr, stderr
        assert weak not in stderr, "the key is never printed"
    stderr = refused_start(tmp_path / "data", "--api-key", "b" * 40)
    assert "too easy to guess" in stderr, stderr
    assert not (tmp_path / "data" / "api-key").exists(), "a refused key is not kept"


def revoke_every_key(service: Service) -> None:
    keys = service.admin("GET", "/admin/tenants/default/keys")["data"]
    assert keys, "the default tenant has its key"
    for key in keys:
        service.admin("DELETE", f"/admin/tenants/default/keys/{key['id']}")


def test_a_revoked_key_stays_revoked_across_restarts(tmp_path):
    # A key given with --api-key (as a systemd unit or a container passes it every
    # time), revoked through the admin API, is not brought back by the next start.
    given = Service(tmp_path / "given")
    try:
        revoke_every_key(given)
        assert call(f"{given.url}/v1/models", given.api_key)[0] == 401
    finally:
        given.stop()
    stderr = refused_start(tmp_path / "given", "--api-key", given.api_key)
    assert "was revoked" in stderr and "--api-key" in stderr, stderr
    assert given.api_key not in stderr, "the key is never printed"
    # A new key starts it again, and the revoked one still does not work.
    fresh = Service(tmp_path / "given", api_key="tq_" + secrets.token_hex(20))
    try:
        assert call(f"{fresh.url}/v1/models", fresh.api_key)[0] == 200
        assert call(f"{fresh.url}/v1/models", given.api_key)[0] == 401
    finally:
        fresh.stop()

    # The key `tuneq up` made and keeps in <data-dir>/api-key, revoked: a plain restart
    # is refused, naming the file, which is left as it is.
    data = tmp_path / "kept"
    admin_key = "tq_admin_" + secrets.token_hex(20)
    env = {"TUNEQ_ADMIN_KEY": admin_key}
    first = Process([str(tuneq_bin()), "up", "--port", "0", "--data-dir", str(data)],
                    ready="tuneq is up at ", timeout=30, env={**os.environ, **env})
    url = first.line.removeprefix("tuneq is up at ").strip()
    kept = (data / "api-key").read_text().strip()
    try:
        status, keys = call(f"{url}/admin/tenants/default/keys", admin_key)
        assert status == 200, keys
        for key in keys["data"]:
            assert call(f"{url}/admin/tenants/default/keys/{key['id']}", admin_key,
                        "DELETE")[0] == 200
        assert call(f"{url}/v1/models", kept)[0] == 401
    finally:
        first.stop()
    stderr = refused_start(data, env=env)
    assert "was revoked" in stderr and str(data / "api-key") in stderr, stderr
    assert (data / "api-key").read_text().strip() == kept
    # Removing the file, as the message says, makes a new key.
    (data / "api-key").unlink()
    again = Process([str(tuneq_bin()), "up", "--port", "0", "--data-dir", str(data)],
                    ready="tuneq is up at ", timeout=30, env={**os.environ, **env})
    url = again.line.removeprefix("tuneq is up at ").strip()
    try:
        made = (data / "api-key").read_text().strip()
        assert made != kept
        assert call(f"{url}/v1/models", made)[0] == 200
        assert call(f"{url}/v1/models", kept)[0] == 401
    finally:
        again.stop()


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The fields after the command's closing parenthesis: state, then ppid.
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_a_killed_up_takes_its_trainer_with_it(tmp_path):
    service = Service(tmp_path / "data")
    try:
        status, file = call(f"{service.url}/v1/files?filename=t.jsonl", service.api_key,
                            "POST", TRAIN.encode(), "application/octet-stream")
        assert status == 200, file
        status, job = call(f"{service.url}/v1/fine_tuning/jobs", service.api_key, "POST",
                           json.dumps({"model": "tuneq-tiny-demo", "training_file": file["id"],
                                       "hyperparameters": {"n_epochs": 20}}).encode())
        assert status == 200, job
        deadline = time.monotonic() + 120
        trainers: list[int] = []
        while not trainers:
            assert time.monotonic() < deadline, "no trainer started"
            time.sleep(0.2)
            trainers = children(service.proc.pid)
        # Well into training (its signal handlers are in place, it reports progress).
        while (call(f"{service.url}/v1/fine_tuning/jobs/{job['id']}", service.api_key)[1]
               .get("progress") or {}).get("step", 0) < 2:
            assert time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.2)
    finally:
        service.crash()  # SIGKILL: no chance to stop anything itself
    # It checkpoints and exits: within seconds, not after the minute its last report
    # would wait for an API that died with it.
    deadline = time.monotonic() + 30
    while any(os.path.exists(f"/proc/{pid}") and "Z" != _state(pid) for pid in trainers):
        assert time.monotonic() < deadline, f"trainer {trainers} outlived its tuneq up"
        time.sleep(0.2)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_file_with_nothing_to_learn_at_the_jobs_length_is_refused_at_create(tmp_path):
    service = Service(tmp_path / "data")
    try:
        # Every answer comes after a prompt longer than 512 tokens: cut away at 512.
        line = json.dumps({"messages": [
            {"role": "user", "content": " ".join(f"word{i}" for i in range(3000))},
            {"role": "assistant", "content": "ok"}]})
        status, file = call(f"{service.url}/v1/files?filename=long.jsonl", service.api_key,
                            "POST", ("\n".join([line] * 4) + "\n").encode(),
                            "application/octet-stream")
        assert status == 200, file
        assert file["validation"]["tokens"]["trained_tokens"] == 0, file
        status, body = call(f"{service.url}/v1/fine_tuning/jobs", service.api_key, "POST",
                            json.dumps({"model": "tuneq-tiny-demo",
                                        "training_file": file["id"]}).encode())
        assert status == 400, body
        assert body["error"]["param"] == "training_file"
        assert body["error"]["code"] == "no_trainable_tokens"
    finally:
        service.stop()
