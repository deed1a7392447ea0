"""A real `tuneq up` per test session, in a temp data dir on a free port, for the
client suite: the official `openai` SDK (and, later, generated OpenAPI clients) talk to
it exactly as they would to a deployment."""

from __future__ import annotations

import importlib
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tuneq_bin() -> Path:
    raw = os.environ.get("TUNEQ_BIN", "target/debug/tuneq")
    path = Path(raw) if os.path.isabs(raw) else REPO_ROOT / raw
    if not os.access(path, os.X_OK):
        pytest.fail(f"tuneq binary not found at {path} (TUNEQ_BIN={raw!r}); build it with `cargo build`.",
                    pytrace=False)
    return path


def real_model() -> Path:
    """SmolLM2-135M-Instruct as scripts/fetch-real-model writes it (scripts/test runs it
    and exports TUNEQ_REAL_MODEL): a real model for the tests that need answers a random
    one cannot give. Missing, the test fails with the command that makes it."""
    raw = os.environ.get("TUNEQ_REAL_MODEL", "target/models/smollm2-135m-instruct-q4_1")
    path = Path(raw) if os.path.isabs(raw) else REPO_ROOT / raw
    if not (path / "model.safetensors").is_file():
        pytest.fail(f"the real model is missing at {path} (TUNEQ_REAL_MODEL={raw!r}); fetch and "
                    f"convert it with `scripts/fetch-real-model` (scripts/test does).",
                    pytrace=False)
    return path


def generated_package(command: list[str], out: Path, package: str):
    """Runs the client generator `command`, which writes the Python package `package`
    into `out`, and yields that package imported; after, `out` leaves the import path
    and the package leaves `sys.modules`, so another generated client can take its place."""
    result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    sys.path.insert(0, str(out))
    yield importlib.import_module(package)
    sys.path.remove(str(out))
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        del sys.modules[name]


class Process:
    """A child process whose output is kept, started once it prints a line beginning
    with `ready` (that line is `self.line`)."""

    def __init__(self, args: list[str], ready: str, env: dict[str, str] | None = None,
                 timeout: float = 60):
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)
        self.output: list[str] = []
        lines: queue.Queue[str] = queue.Queue()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line)
                lines.put(line)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout
        self.line = ""
        while not self.line.startswith(ready):
            try:
                self.line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                self.stop()
                pytest.fail(f"{Path(args[0]).name} {args[1]} did not print {ready!r} within "
                            f"{timeout:.0f} s:\n" + "".join(self.output), pytrace=False)

    def stop(self) -> None:
        """Stops it as an operator would (SIGTERM: running attempts checkpoint first)."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def crash(self) -> None:
        """Kills it without warning (SIGKILL): its trainers are left running."""
        self.proc.kill()
        self.proc.wait()


class Service(Process):
    """A running `tuneq up`."""

    def __init__(self, data_dir: Path, api_key: str | None = None,
                 extra_args: list[str] | None = None):
        self.api_key = api_key or "tq_" + secrets.token_hex(20)
        self.admin_key = "tq_admin_" + secrets.token_hex(20)
        self.data_dir = data_dir
        super().__init__(
            [str(tuneq_bin()), "up", "--port", "0", "--data-dir", str(data_dir),
             "--api-key", self.api_key, *(extra_args or [])],
            ready="tuneq is up at ", timeout=30,
            env={**os.environ, "TUNEQ_ADMIN_KEY": self.admin_key})
        self.url = self.line.removeprefix("tuneq is up at ").strip()

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def admin(self, method: str, path: str, body: dict | None = None) -> dict:
        """Calls an admin route with the admin key."""
        import json
        import urllib.request

        request = urllib.request.Request(
            self.url + path, method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {self.admin_key}",
                     "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory):
    svc = Service(tmp_path_factory.mktemp("tuneq-up"))
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def client(service: Service):
    from openai import OpenAI

    return OpenAI(base_url=f"{service.url}/v1", api_key=service.api_key, max_retries=0)
