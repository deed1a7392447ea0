"""A stand-in Kubernetes API server for the local-process test: it answers every list
with an empty list and records each request as (verb, group, resource, namespace), so
the test can check that the dispatcher, started with the chart's command line, asks for
nothing its Role does not grant. It proves nothing about Kubernetes itself."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


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


class KubeStub:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str, str, str | None]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _answer(self) -> None:
                request = parse(self.command, self.path)
                stub.requests.append(request)
                verb, _, resource, _, name = request
                if verb in ("list",):
                    kind = resource.capitalize().rstrip("s") + "List"
                    body = {"kind": kind, "apiVersion": "v1",
                            "metadata": {"resourceVersion": "1"}, "items": []}
                    code = 200
                elif verb == "watch":
                    body, code = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                  "reason": "Expired", "code": 410}, 410
                else:
                    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                            "reason": "NotFound", "code": 404,
                            "message": f"{resource} {name!r} not found"}
                    code = 404
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

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
