"""The kubernetes JobBackend: runs a training attempt as a batch/v1 Job (one node) or a JobSet
(a multi-node gang) made by infra.k8s_manifests.render, and tells the supervisor how it ended.

How an attempt's API objects become a JobStatus is `infra.k8s_status.classify`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from core.retry import retry
from infra.jobs import JobHandle, JobSpec, JobStatus
from infra.k8s_manifests import LABEL_ATTEMPT, LABEL_RUN, KubeOptions
from infra.k8s_status import (
    JOBSET_GROUP,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    TRAINER_CONTAINER,
    _generation,
    _is_rank0,
    _parse_ts,
    _trainer_status,
    _true_conditions,
    _ts_key,
    classify,
)

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 60.0  # between retries of one API call (the defaults never get near it)


T = TypeVar("T")


class KubernetesBackendError(RuntimeError):
    """A Kubernetes API problem the caller cannot fix by retrying: permissions, an unreachable
    API server, a missing configuration, an object the API refuses."""


class KubernetesBackend:
    """JobBackend on a Kubernetes cluster through the official `kubernetes` client.

    `api_client` is a configured kubernetes.client.ApiClient; without one the in-cluster
    service account is tried, then the kubeconfig. Transient answers (429, 5xx) and dropped
    connections are retried `retries` times with exponential backoff from `backoff_s`.
    """

    name = "kubernetes"

    def __init__(
        self, opts: KubeOptions, api_client: Any = None, *, retries: int = 4, backoff_s: float = 0.5
    ) -> None:
        from kubernetes import client

        self.opts = opts
        self.api = api_client if api_client is not None else _load_api_client()
        self.retries = retries
        self.backoff_s = backoff_s
        self._batch = client.BatchV1Api(self.api)
        self._core = client.CoreV1Api(self.api)
        self._custom = client.CustomObjectsApi(self.api)

    @property
    def host(self) -> str:
        return str(getattr(self.api.configuration, "host", "?"))

    # -- JobBackend --------------------------------------------------------------------------

    def submit(self, spec: JobSpec) -> JobHandle:
        from infra.k8s_manifests import render  # another module owns the manifests

        objs = render(spec, self.opts)
        mains = [o for o in objs if o.get("kind") in ("Job", "JobSet")]
        if len(mains) != 1:
            raise KubernetesBackendError(
                f"render() must return exactly one Job or JobSet, got kinds "
                f"{[o.get('kind') for o in objs]}"
            )
        main = mains[0]
        namespace = str(main.get("metadata", {}).get("namespace") or self.opts.namespace)
        for obj in objs:
            self._create(obj, spec, is_main=obj is main)
        return JobHandle(
            self.name,
            str(main["metadata"]["name"]),
            namespace,
            {"kind": main["kind"], "run": spec.name, "attempt": spec.attempt},
        )

    def status(self, handle: JobHandle) -> JobStatus:
        from kubernetes.client import ApiException

        ns, kind = self._ns(handle), self._kind(handle)
        try:
            job = self._read(kind, ns, handle.name)
        except ApiException as e:
            if e.status == 404:
                return JobStatus(
                    "finished",
                    "crashed",
                    None,
                    f"job deleted: {kind} {ns}/{handle.name} no longer exists",
                )
            raise self._api_error("get", _resource(kind), ns, e) from e
        pods = self._pods(handle, job)
        children: list[dict[str, Any]] = []
        if kind == "JobSet" and "Failed" in _true_conditions(job):
            # Only the child Jobs' messages name the pod and exit code that failed the gang.
            children = self._list(
                "jobs",
                ns,
                self._selector(handle, job),
                lambda sel: self._batch.list_namespaced_job(
                    ns, label_selector=sel, _preload_content=False
                ),
            )
        return classify(job, pods, children)

    def logs(self, handle: JobHandle, tail: int | None = None) -> str:
        """The trainer's log from the newest pod that has started; rank 0 first in a gang."""
        from kubernetes.client import ApiException

        ns = self._ns(handle)
        pods = sorted(
            self._pods(handle),
            reverse=True,
            key=lambda p: (
                _generation(p),
                _is_rank0(p),
                _ts_key(_parse_ts((p.get("metadata") or {}).get("creationTimestamp"))),
            ),
        )
        for pod in pods:
            if not _trainer_started(pod):
                continue
            name = str(pod["metadata"]["name"])
            kwargs: dict[str, Any] = {"container": TRAINER_CONTAINER, "_preload_content": False}
            if tail is not None:
                kwargs["tail_lines"] = tail
            try:
                resp = self._call(
                    "get",
                    "pods/log",
                    ns,
                    lambda n=name, k=kwargs: self._core.read_namespaced_pod_log(n, ns, **k),
                )
            except ApiException as e:
                if e.status in (400, 404):  # not started after all, or deleted meanwhile
                    continue
                raise self._api_error("get", "pods/log", ns, e) from e
            return bytes(resp.data).decode("utf-8", errors="replace")
        return ""

    def cancel(self, handle: JobHandle) -> None:
        from kubernetes.client import ApiException

        ns, kind = self._ns(handle), self._kind(handle)
        # Foreground: the Job/JobSet disappears only after its pods, so GPUs are free when it is
        # gone.
        try:
            if kind == "JobSet":
                self._call(
                    "delete",
                    "jobsets",
                    ns,
                    lambda: self._custom.delete_namespaced_custom_object(
                        JOBSET_GROUP,
                        JOBSET_VERSION,
                        ns,
                        JOBSET_PLURAL,
                        handle.name,
                        propagation_policy="Foreground",
                        _preload_content=False,
                    ),
                )
            else:
                self._call(
                    "delete",
                    "jobs",
                    ns,
                    lambda: self._batch.delete_namespaced_job(
                        handle.name, ns, propagation_policy="Foreground", _preload_content=False
                    ),
                )
        except ApiException as e:
            if e.status != 404:  # already gone is what we wanted
                raise self._api_error("delete", _resource(kind), ns, e) from e

    # -- API plumbing ------------------------------------------------------------------------

    def _create(self, obj: Mapping[str, Any], spec: JobSpec, *, is_main: bool) -> None:
        from kubernetes.client import ApiException
        from pydantic import ValidationError

        kind = str(obj.get("kind"))
        # kubernetes>=35 validates bodies against its pydantic models, which take resource
        # quantities only as strings; the API server (and kubectl) also take numbers.
        obj = _quantities_as_strings(obj)
        md = obj.get("metadata") or {}
        ns = str(md.get("namespace") or self.opts.namespace)
        name = str(md.get("name"))
        creators: dict[str, Callable[[], Any]] = {
            "Job": lambda: self._batch.create_namespaced_job(ns, body=obj, _preload_content=False),
            "JobSet": lambda: self._custom.create_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, ns, JOBSET_PLURAL, body=obj, _preload_content=False
            ),
            "ConfigMap": lambda: self._core.create_namespaced_config_map(
                ns, body=obj, _preload_content=False
            ),
            "Service": lambda: self._core.create_namespaced_service(
                ns, body=obj, _preload_content=False
            ),
        }
        if kind not in creators:
            raise KubernetesBackendError(
                f"render() returned a {kind}, which this backend does not know how to create"
            )
        resource = _resource(kind)
        try:
            self._call("create", resource, ns, creators[kind])
        except ValidationError as e:
            # kubernetes>=35 validates bodies against its models before sending them.
            raise KubernetesBackendError(
                f"the {kind} {ns}/{name} from render() does not fit the Kubernetes API schema "
                f"(the client refused it before sending): {e}"
            ) from e
        except ApiException as e:
            if e.status != 409:
                raise self._api_error("create", resource, ns, e) from e
            # Already there: a supervisor restarted after submitting. Adopt our own attempt,
            # refuse someone else's object of the same name.
            if is_main:
                existing = self._read(kind, ns, name)
                labels = (existing.get("metadata") or {}).get("labels") or {}
                if labels.get(LABEL_RUN) != spec.name or labels.get(LABEL_ATTEMPT) != str(
                    spec.attempt
                ):
                    raise KubernetesBackendError(
                        f"{kind} {ns}/{name} already exists but is not attempt {spec.attempt} "
                        f"of run {spec.name} (labels {LABEL_RUN}={labels.get(LABEL_RUN)!r}, "
                        f"{LABEL_ATTEMPT}={labels.get(LABEL_ATTEMPT)!r}); delete it or pick "
                        "another run name"
                    ) from e
            log.info("%s %s/%s already exists; adopting it", kind, ns, name)

    def _read(self, kind: str, ns: str, name: str) -> dict[str, Any]:
        if kind == "JobSet":
            resp = self._call(
                "get",
                "jobsets",
                ns,
                lambda: self._custom.get_namespaced_custom_object(
                    JOBSET_GROUP, JOBSET_VERSION, ns, JOBSET_PLURAL, name, _preload_content=False
                ),
            )
        else:
            resp = self._call(
                "get",
                "jobs",
                ns,
                lambda: self._batch.read_namespaced_job(name, ns, _preload_content=False),
            )
        return dict(json.loads(resp.data))

    def _pods(
        self, handle: JobHandle, job: Mapping[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        """Every pod of the attempt, all restarts and gang ranks, failed ones included."""
        ns = self._ns(handle)
        return self._list(
            "pods",
            ns,
            self._selector(handle, job),
            lambda sel: self._core.list_namespaced_pod(
                ns, label_selector=sel, _preload_content=False
            ),
        )

    def _selector(self, handle: JobHandle, job: Mapping[str, Any] | None) -> str:
        run, attempt = handle.data.get("run"), handle.data.get("attempt")
        if run is None or attempt is None:  # a handle written by hand: use the Job's labels
            job = job or self._read(self._kind(handle), self._ns(handle), handle.name)
            labels = (job.get("metadata") or {}).get("labels") or {}
            run, attempt = labels.get(LABEL_RUN), labels.get(LABEL_ATTEMPT)
        return f"{LABEL_RUN}={run},{LABEL_ATTEMPT}={attempt}"

    def _list(
        self, resource: str, ns: str, selector: str, fn: Callable[[str], Any]
    ) -> list[dict[str, Any]]:
        from kubernetes.client import ApiException

        try:
            resp = self._call("list", resource, ns, lambda: fn(selector))
        except ApiException as e:
            raise self._api_error("list", resource, ns, e) from e
        return list(json.loads(resp.data).get("items") or [])

    def _call(self, verb: str, resource: str, ns: str, fn: Callable[[], T]) -> T:
        """fn() with retries on transient failures. Permission and connection problems become
        KubernetesBackendError; other ApiExceptions (404, 409, ...) go to the caller."""
        import urllib3
        from kubernetes.client import ApiException

        def transient(e: BaseException) -> bool:
            if not isinstance(e, ApiException):
                return True  # a dropped connection
            status = int(e.status or 0)
            # 0: the client gave up before an answer (TLS trouble): as good as unreachable
            return status == 429 or status >= 500 or status == 0

        retry_after: list[float | None] = [None]

        def on_retry(_attempt: int, _delay: float, e: BaseException) -> None:
            if isinstance(e, ApiException):
                status = int(e.status or 0)
                retry_after[0] = _retry_after(e) if status == 429 else None
                log.warning("Kubernetes API %s %s answered %s; retrying", verb, resource, status)
            else:
                retry_after[0] = None
                log.warning("Kubernetes API server %s unreachable (%s); retrying", self.host, e)

        def sleep(delay: float) -> None:
            time.sleep(retry_after[0] if retry_after[0] is not None else delay)

        try:
            return retry(
                fn,
                attempts=self.retries + 1,
                base_s=self.backoff_s,
                max_s=_MAX_BACKOFF_S,
                retry_on=(ApiException, urllib3.exceptions.HTTPError, OSError),
                fatal=lambda e: not transient(e),
                on_retry=on_retry,
                sleep=sleep,
            )
        except ApiException as e:
            if int(e.status or 0) in (401, 403) or transient(e):
                raise self._api_error(verb, resource, ns, e) from e
            raise  # 404, 409, ...: the caller's to handle
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise KubernetesBackendError(
                f"cannot reach the Kubernetes API server at {self.host} to {verb} "
                f"{resource} in namespace {ns}: {e}"
            ) from e

    def _api_error(self, verb: str, resource: str, ns: str, e: Any) -> KubernetesBackendError:
        status = int(getattr(e, "status", 0) or 0)
        said = _status_message(e)
        if status == 401:
            return KubernetesBackendError(
                f"the Kubernetes API server at {self.host} rejected our credentials (401) when "
                f"trying to {verb} {resource} in namespace {ns}: {said}. Check the kubeconfig "
                "user or the pod's service-account token."
            )
        if status == 403:
            return KubernetesBackendError(
                f"not allowed to {verb} {resource} in namespace {ns} (403 Forbidden: {said}). "
                "Check the RBAC Role and RoleBinding of the identity ballast runs as: the Role "
                "in k8s/base grants get/list/watch/create/delete on jobs (batch), jobsets "
                "(jobset.x-k8s.io) and pods, and get on pods/log; it must be bound to that "
                f"service account in namespace {ns}."
            )
        if status == 0:
            return KubernetesBackendError(
                f"cannot talk to the Kubernetes API server at {self.host} to {verb} {resource} "
                f"in namespace {ns}: {getattr(e, 'reason', e)}"
            )
        if status == 404 and resource == "jobsets":
            said += " (is the JobSet controller and its CRD installed in the cluster?)"
        return KubernetesBackendError(
            f"the Kubernetes API server at {self.host} answered {status} to {verb} {resource} "
            f"in namespace {ns}: {said}"
        )

    def _ns(self, handle: JobHandle) -> str:
        return handle.namespace or self.opts.namespace

    @staticmethod
    def _kind(handle: JobHandle) -> str:
        return str(handle.data.get("kind") or "Job")


def _resource(kind: str) -> str:
    return {
        "Job": "jobs",
        "JobSet": "jobsets",
        "ConfigMap": "configmaps",
        "Service": "services",
    }.get(kind, kind.lower() + "s")


def _quantities_as_strings(obj: Any) -> Any:
    """A copy of `obj` with numbers in resources.limits/requests written as strings ("8"),
    the form the API server stores them in anyway."""
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            if k == "resources" and isinstance(v, Mapping):
                out[k] = {
                    rk: (
                        {
                            q: str(x)
                            if isinstance(x, int | float) and not isinstance(x, bool)
                            else x
                            for q, x in rv.items()
                        }
                        if rk in ("limits", "requests") and isinstance(rv, Mapping)
                        else _quantities_as_strings(rv)
                    )
                    for rk, rv in v.items()
                }
            else:
                out[k] = _quantities_as_strings(v)
        return out
    if isinstance(obj, list):
        return [_quantities_as_strings(x) for x in obj]
    return obj


def _trainer_started(pod: Mapping[str, Any]) -> bool:
    cs = _trainer_status(pod)
    if cs is None:
        return False
    return bool(
        (cs.get("state") or {}).get("running")
        or (cs.get("state") or {}).get("terminated")
        or (cs.get("lastState") or {}).get("terminated")
    )


def _status_message(e: Any) -> str:
    """The message of the API's Status body, or the HTTP reason."""
    body = getattr(e, "body", None)
    if body:
        try:
            msg = json.loads(body).get("message")
            if msg:
                return str(msg)
        except (ValueError, AttributeError):
            pass
    return str(getattr(e, "reason", "") or "no message")


def _retry_after(e: Any) -> float | None:
    headers = getattr(e, "headers", None) or {}
    try:
        return float(headers.get("Retry-After"))
    except (TypeError, ValueError):
        return None


def _load_api_client() -> Any:
    """An ApiClient from the pod's service account, else from the kubeconfig."""
    from kubernetes import client, config

    tried = []
    cfg = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=cfg)
        return client.ApiClient(cfg)
    except config.ConfigException as e:
        tried.append(f"in-cluster service account: {e}")
    cfg = client.Configuration()
    try:
        # The library reads KUBECONFIG once, at import; read it now (a list of paths is fine).
        config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG") or None, client_configuration=cfg
        )
        return client.ApiClient(cfg)
    except (config.ConfigException, OSError) as e:
        tried.append(f"kubeconfig: {e}")
    raise KubernetesBackendError(
        "no Kubernetes configuration found (" + "; ".join(tried) + "). Run inside a pod with a "
        "service account, or point KUBECONFIG (default ~/.kube/config) at the cluster."
    )
