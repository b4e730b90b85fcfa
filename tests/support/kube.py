"""A Kubernetes API server on loopback (`FakeKubeAPI`): serves the REST paths the kubernetes
backend uses from objects kept in memory (the recorded ones under tests/fixtures/k8s/, loaded
by `load`), records every request and injects error answers. conftest's `kube` fixture
starts one per test."""

from __future__ import annotations

import copy
import itertools
import json
import re
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kubernetes import client

from infra.jobs import JobHandle

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "k8s"


def load(name: str) -> dict[str, Any]:
    """A recorded object (tests/fixtures/k8s/<name>.json): {"job", "pods", "child_jobs"?}."""
    return json.loads((FIXTURES / f"{name}.json").read_text())


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    body: Any


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    status: int
    times: int
    headers: dict[str, str] = field(default_factory=dict)
    message: str = ""


COLLECTIONS = {
    "jobs": (r"/apis/batch/v1/namespaces/(?P<ns>[^/]+)/jobs", "batch/v1", "JobList"),
    "jobsets": (
        r"/apis/jobset\.x-k8s\.io/v1alpha2/namespaces/(?P<ns>[^/]+)/jobsets",
        "jobset.x-k8s.io/v1alpha2",
        "JobSetList",
    ),
    "configmaps": (r"/api/v1/namespaces/(?P<ns>[^/]+)/configmaps", "v1", "ConfigMapList"),
    "pods": (r"/api/v1/namespaces/(?P<ns>[^/]+)/pods", "v1", "PodList"),
}
_GROUP = {"jobs": "batch", "jobsets": "jobset.x-k8s.io", "configmaps": "", "pods": ""}


def status_body(code: int, reason: str, message: str, **details: Any) -> dict[str, Any]:
    """A metav1.Status as the API server sends it with an error."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
    }
    if details:
        body["details"] = details
    body["code"] = code
    return body


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The client closing a kept-alive connection (ApiClient.close) is not a server error.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class FakeKubeAPI:
    """Serves the REST paths the backend uses from objects kept in memory, and records every
    request: POST/GET/DELETE on jobs and jobsets, GET/list on pods (labelSelector honoured),
    GET pods/{name}/log (container, tailLines honoured). `fail` injects error answers."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.logs: dict[str, str] = {}
        self.requests: list[Request] = []
        self.faults: list[Fault] = []
        self._lock = threading.Lock()
        self._uid = itertools.count(1)
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                url = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                req = Request(self.command, url.path, parse_qs(url.query), body)
                with api._lock:
                    api.requests.append(req)
                    status, payload, headers = api.answer(req)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                ctype = "text/plain" if isinstance(payload, bytes) else "application/json"
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = _handle

        self._server = _Server(("127.0.0.1", 0), Handler)
        # A short poll interval: shutdown() waits for the serving loop to notice.
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.01,), daemon=True
        )
        self._thread.start()

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- test set-up -------------------------------------------------------------------------

    def put(self, resource: str, obj: dict[str, Any]) -> None:
        md = obj["metadata"]
        self.objects[(resource, md.get("namespace", "ballast"), md["name"])] = obj

    def load_fixture(self, doc: dict[str, Any]) -> JobHandle:
        job = doc["job"]
        kind = job["kind"]
        self.put("jobsets" if kind == "JobSet" else "jobs", job)
        for child in doc.get("child_jobs", []):
            self.put("jobs", child)
        for pod in doc["pods"]:
            self.put("pods", pod)
        labels = job["metadata"]["labels"]
        return JobHandle(
            "kubernetes",
            job["metadata"]["name"],
            job["metadata"]["namespace"],
            {
                "kind": kind,
                "run": labels["ballast.dev/run"],
                "attempt": int(labels["ballast.dev/attempt"]),
            },
        )

    def fail(
        self,
        method: str,
        path: str,
        status: int,
        times: int = 1,
        headers: dict[str, str] | None = None,
        message: str = "",
    ) -> None:
        self.faults.append(Fault(method, re.compile(path), status, times, headers or {}, message))

    def made(self, method: str, path_part: str = "") -> list[Request]:
        return [r for r in self.requests if r.method == method and path_part in r.path]

    # -- the API -----------------------------------------------------------------------------

    def answer(self, req: Request) -> tuple[int, Any, dict[str, str]]:
        for f in self.faults:
            if f.times > 0 and f.method == req.method and f.path.search(req.path):
                f.times -= 1
                reason = {
                    401: "Unauthorized",
                    403: "Forbidden",
                    404: "NotFound",
                    429: "TooManyRequests",
                    500: "InternalError",
                    503: "ServiceUnavailable",
                }.get(f.status, "Unknown")
                return f.status, status_body(f.status, reason, f.message or reason), f.headers
        for resource, (base, api_version, list_kind) in COLLECTIONS.items():
            m = re.fullmatch(base + r"(?:/(?P<name>[^/]+))?(?P<log>/log)?", req.path)
            if m:
                return self._route(
                    req, resource, m["ns"], m["name"], bool(m["log"]), api_version, list_kind
                )
        return (
            404,
            status_body(404, "NotFound", "the server could not find the requested resource"),
            {},
        )

    def _route(
        self,
        req: Request,
        resource: str,
        ns: str,
        name: str | None,
        log: bool,
        api_version: str,
        list_kind: str,
    ) -> tuple[int, Any, dict[str, str]]:
        key = (resource, ns, name or "")
        kind_word = f"{resource}.{_GROUP[resource]}".rstrip(".")
        if log:
            pod = self.objects.get(("pods", ns, name or ""))
            if pod is None:
                return 404, status_body(404, "NotFound", f'pods "{name}" not found'), {}
            if name not in self.logs:
                return (
                    400,
                    status_body(
                        400,
                        "BadRequest",
                        f'container "trainer" in pod '
                        f'"{name}" is waiting to start: ContainerCreating',
                    ),
                    {},
                )
            lines = self.logs[name].splitlines(keepends=True)
            tail = req.query.get("tailLines")
            if tail:
                lines = lines[-int(tail[0]) :]
            return 200, "".join(lines).encode(), {}
        if req.method == "POST" and name is None:
            obj = copy.deepcopy(req.body)
            obj_name = obj["metadata"]["name"]
            if (resource, ns, obj_name) in self.objects:
                return (
                    409,
                    status_body(
                        409,
                        "AlreadyExists",
                        f'{kind_word} "{obj_name}" already exists',
                        name=obj_name,
                        group=_GROUP[resource],
                        kind=resource,
                    ),
                    {},
                )
            obj["metadata"].update(
                namespace=ns,
                uid=f"00000000-0000-4000-8000-{next(self._uid):012d}",
                resourceVersion="1",
                creationTimestamp="2026-11-18T09:00:00Z",
            )
            self.objects[(resource, ns, obj_name)] = obj
            return 201, obj, {}
        if req.method == "GET" and name is None:
            selector = dict(
                kv.split("=", 1)
                for kv in (req.query.get("labelSelector", [""])[0].split(","))
                if kv
            )
            items = [
                o
                for (r, n, _), o in self.objects.items()
                if r == resource
                and n == ns
                and all(o["metadata"].get("labels", {}).get(k) == v for k, v in selector.items())
            ]
            return (
                200,
                {
                    "kind": list_kind,
                    "apiVersion": api_version,
                    "metadata": {"resourceVersion": "12345"},
                    "items": items,
                },
                {},
            )
        if key not in self.objects:
            return (
                404,
                status_body(
                    404,
                    "NotFound",
                    f'{kind_word} "{name}" not found',
                    name=name,
                    group=_GROUP[resource],
                    kind=resource,
                ),
                {},
            )
        if req.method == "GET":
            return 200, self.objects[key], {}
        if req.method == "DELETE":
            return 200, self.objects.pop(key), {}
        return 405, status_body(405, "MethodNotAllowed", "method not allowed"), {}


def api_client(host: str) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = host
    return client.ApiClient(cfg)
