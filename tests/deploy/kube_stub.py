"""A stand-in Kubernetes API server for the local-process test. It keeps the objects it
is sent (create, get, list with equality label selectors, delete) and records each
request as (verb, group, resource, namespace, name), so the test can check that the
dispatcher, started with the chart's command line, asks for nothing its Role does not
grant, and can validate the attempt Jobs and Secrets it creates. Watches are answered
410 Gone (a client relists). It runs no controller: a Job stays as created. It proves
nothing about Kubernetes itself."""

from __future__ import annotations

import itertools
import json
import threading
import uuid
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

KINDS = {"jobs": ("batch/v1", "Job"), "pods": ("v1", "Pod"), "secrets": ("v1", "Secret"),
         "nodes": ("v1", "Node")}


def parse(method: str, url: str) -> tuple[str, str, str, str, str | None]:
    """(verb, group, resource, namespace, name) of a request, as RBAC names them."""
    parsed = urlparse(url)
    parts = [p for p in parsed.path.split("/") if p]
    if parts[:1] == ["api"]:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"]:
        group, rest = parts[1], parts[3:]
    else:
        return ("nonresource", "", parsed.path, "", None)
    namespace = ""
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource = rest[0] if rest else ""
    name = rest[1] if len(rest) > 1 else None
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
    query = parse_qs(parsed.query)
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}.get(method)
    if method == "DELETE":
        verb = "delete" if name else "deletecollection"
    if method == "GET":
        if query.get("watch", ["false"])[0] in ("true", "1"):
            verb = "watch"
        else:
            verb = "get" if name else "list"
    return (verb or method.lower(), group, resource, namespace, name)


def selected(obj: dict, selector: str) -> bool:
    labels = obj.get("metadata", {}).get("labels") or {}
    for term in filter(None, selector.split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


class KubeStub:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str, str, str | None]] = []
        self.objects: dict[tuple[str, str, str], dict] = {}   # (resource, namespace, name)
        self.created: list[dict] = []
        self.lock = threading.Lock()
        versions = itertools.count(1)
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def status(self, code: int, reason: str, message: str) -> None:
                self.reply(code, {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                  "status": "Failure", "reason": reason, "message": message,
                                  "code": code})

            def _answer(self) -> None:
                body = None
                if self.headers.get("Content-Length"):
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
                request = parse(self.command, self.path)
                verb, _, resource, namespace, name = request
                with stub.lock:
                    stub.requests.append(request)
                    api_version, kind = KINDS.get(resource, ("v1", resource.capitalize()))
                    if verb == "list":
                        selector = parse_qs(urlparse(self.path).query).get("labelSelector", [""])[0]
                        items = [o for (r, ns, _), o in stub.objects.items()
                                 if r == resource and ns == namespace and selected(o, selector)]
                        self.reply(200, {"kind": kind + "List", "apiVersion": api_version,
                                         "metadata": {"resourceVersion": str(next(versions))},
                                         "items": items})
                    elif verb == "watch":
                        self.status(410, "Expired", "watches are not served here")
                    elif verb == "create":
                        meta = body.setdefault("metadata", {})
                        key = (resource, namespace, meta.get("name"))
                        if key in stub.objects:
                            self.status(409, "AlreadyExists", f"{resource} {key[2]!r} already exists")
                            return
                        meta.update(uid=str(uuid.uuid4()), resourceVersion=str(next(versions)),
                                    namespace=namespace,
                                    creationTimestamp=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"))
                        stub.objects[key] = body
                        stub.created.append(body)
                        self.reply(201, body)
                    elif verb == "get" and (resource, namespace, name) in stub.objects:
                        self.reply(200, stub.objects[(resource, namespace, name)])
                    elif verb == "delete" and (resource, namespace, name) in stub.objects:
                        self.reply(200, stub.objects.pop((resource, namespace, name)))
                    else:
                        self.status(404, "NotFound", f"{resource} {name!r} not found")

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kubeconfig(self, namespace: str) -> str:
        return (
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: stub, cluster: {{server: \"{self.url}\"}}}}]\n"
            "users: [{name: stub, user: {token: stub}}]\n"
            f"contexts: [{{name: stub, context: {{cluster: stub, user: stub, namespace: {namespace}}}}}]\n"
            "current-context: stub\n")

    def close(self) -> None:
        self.server.shutdown()
