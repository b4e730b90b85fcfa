"""Our own lint for Kubernetes manifests: what the official JSON schemas (kubernetes-validate)
let through but the API server, the Job controller or a GPU node would reject or get wrong
(test-only: tests/unit/infra/test_k8s_manifests.py runs it over k8s/ and the rendered
attempts):

    python -m tests.support.k8s_lint k8s/    # files or directories of YAML; exit 1 on findings

Rules (ids in RULES): a Job's pods restart Never/OnFailure, and Never with a
podFailurePolicy; podFailurePolicy actions, rule shape and onExitCodes operators are ones the
API knows; GPU quantities are positive integers, in limits (requests, if any, equal); GPU
pods tolerate the GPU taint and have a memory-backed /dev/shm; containers run as non-root
without privilege escalation; images are pinned (no `:latest`, no missing tag).

It looks into the pod templates of Pods, Jobs, CronJobs, JobSets and the apps/v1 workloads.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

RULES: dict[str, str] = {
    "job-restart-policy": "a Job's pod template has restartPolicy Never or OnFailure",
    "pfp-restart-policy": "a Job with a podFailurePolicy has restartPolicy Never",
    "pfp-action": "podFailurePolicy actions are FailJob, Ignore, Count or FailIndex "
    "(FailIndex only with backoffLimitPerIndex)",
    "pfp-rule": "each podFailurePolicy rule has exactly one of onExitCodes and onPodConditions",
    "exit-codes": "onExitCodes: operator In or NotIn, distinct integer values (no 0 with In), "
    "containerName one of the pod's containers",
    "gpu-quantity": "GPU quantities are positive integers",
    "gpu-limits": "GPUs are in limits; requests, if present, equal limits",
    "gpu-toleration": "pods asking for GPUs tolerate the GPU taint",
    "shm": "/dev/shm is an emptyDir with medium Memory, and GPU pods mount one",
    "non-root": "containers run as non-root (runAsNonRoot true, runAsUser not 0)",
    "privilege-escalation": "containers set allowPrivilegeEscalation: false",
    "image-tag": "images carry a tag other than latest (or a digest)",
}

PFP_ACTIONS = ("FailJob", "Ignore", "Count", "FailIndex")
EXIT_CODE_OPERATORS = ("In", "NotIn")
_POSITIVE_INT = re.compile(r"^[1-9][0-9]*$")
_APPS_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "ReplicationController")


@dataclass(frozen=True)
class Finding:
    rule: str  # a key of RULES
    where: str  # "Kind/name: path.in.object"
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message} [{self.rule}]"


@dataclass(frozen=True)
class _Workload:
    where: str  # "Kind/name: path" of the pod template's spec
    job: Mapping[str, Any] | None  # the Job spec around the pod, if any
    pod: Mapping[str, Any]
    job_where: str = ""  # "Kind/name: path" of that Job spec


def is_gpu_resource(name: str) -> bool:
    """nvidia.com/gpu, amd.com/gpu, ... and NVIDIA's MIG slices (nvidia.com/mig-1g.10gb)."""
    return name.rsplit("/", 1)[-1] == "gpu" or name.startswith("nvidia.com/mig-")


def _gpu_taint_key(resource: str) -> str:
    # The device plugins taint with the vendor's `<vendor>/gpu` (MIG nodes too).
    return resource.rsplit("/", 1)[0] + "/gpu" if "/" in resource else resource


def _name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    name = meta.get("name") or meta.get("generateName") or "?"
    return f"{obj.get('kind', '?')}/{name}"


def _dict(x: Any) -> Mapping[str, Any]:
    return x if isinstance(x, Mapping) else {}


def _workloads(obj: Mapping[str, Any]) -> Iterator[_Workload]:
    kind, name, spec = obj.get("kind"), _name(obj), _dict(obj.get("spec"))
    if kind == "Pod":
        yield _Workload(f"{name}: spec", None, spec)
    elif kind == "Job":
        yield _Workload(
            f"{name}: spec.template.spec",
            spec,
            _dict(_dict(spec.get("template")).get("spec")),
            f"{name}: spec",
        )
    elif kind == "CronJob":
        job = _dict(_dict(spec.get("jobTemplate")).get("spec"))
        yield _Workload(
            f"{name}: spec.jobTemplate.spec.template.spec",
            job,
            _dict(_dict(job.get("template")).get("spec")),
            f"{name}: spec.jobTemplate.spec",
        )
    elif kind == "JobSet":
        for i, rj in enumerate(spec.get("replicatedJobs") or []):
            job = _dict(_dict(_dict(rj).get("template")).get("spec"))
            jw = f"{name}: spec.replicatedJobs[{i}].template.spec"
            yield _Workload(
                f"{jw}.template.spec", job, _dict(_dict(job.get("template")).get("spec")), jw
            )
    elif kind in _APPS_KINDS:
        yield _Workload(
            f"{name}: spec.template.spec", None, _dict(_dict(spec.get("template")).get("spec"))
        )


def _containers(pod: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        for i, c in enumerate(pod.get(field) or []):
            yield f"{field}[{i}]", _dict(c)


def _check_job(w: _Workload) -> Iterator[Finding]:
    assert w.job is not None
    restart = w.pod.get("restartPolicy")
    if restart not in ("Never", "OnFailure"):
        yield Finding(
            "job-restart-policy",
            f"{w.where}.restartPolicy",
            f"restartPolicy {restart!r} in a Job: must be Never or OnFailure",
        )
    pfp = w.job.get("podFailurePolicy")
    if pfp is None:
        return
    if restart != "Never":
        yield Finding(
            "pfp-restart-policy",
            f"{w.where}.restartPolicy",
            f"podFailurePolicy needs restartPolicy Never, not {restart!r}",
        )
    names = {c.get("name") for _, c in _containers(w.pod)}
    for i, rule in enumerate(_dict(pfp).get("rules") or []):
        rule = _dict(rule)
        where = f"{w.job_where}.podFailurePolicy.rules[{i}]"
        action = rule.get("action")
        if action not in PFP_ACTIONS:
            yield Finding(
                "pfp-action",
                f"{where}.action",
                f"action {action!r} is not one of {', '.join(PFP_ACTIONS)}",
            )
        elif action == "FailIndex" and w.job.get("backoffLimitPerIndex") is None:
            yield Finding(
                "pfp-action", f"{where}.action", "FailIndex needs backoffLimitPerIndex on the Job"
            )
        has_codes, has_conds = "onExitCodes" in rule, "onPodConditions" in rule
        if has_codes == has_conds:
            yield Finding(
                "pfp-rule", where, "a rule needs exactly one of onExitCodes and onPodConditions"
            )
        if has_codes:
            yield from _check_exit_codes(_dict(rule["onExitCodes"]), f"{where}.onExitCodes", names)


def _check_exit_codes(
    req: Mapping[str, Any], where: str, containers: set[Any]
) -> Iterator[Finding]:
    op = req.get("operator")
    if op not in EXIT_CODE_OPERATORS:
        yield Finding("exit-codes", f"{where}.operator", f"operator {op!r} is not In or NotIn")
    values = req.get("values")
    if (
        not isinstance(values, list)
        or not values
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)
    ):
        yield Finding(
            "exit-codes", f"{where}.values", f"values {values!r}: a non-empty list of integers"
        )
    else:
        if len(set(values)) != len(values):
            yield Finding("exit-codes", f"{where}.values", f"values {values} repeat")
        if op == "In" and 0 in values:
            yield Finding(
                "exit-codes", f"{where}.values", "exit code 0 is success and cannot match In"
            )
    name = req.get("containerName")
    if name is not None and name not in containers:
        yield Finding(
            "exit-codes",
            f"{where}.containerName",
            f"containerName {name!r} is not a container of the pod",
        )


def _gpu_quantity_ok(q: Any) -> bool:
    if isinstance(q, bool):
        return False
    if isinstance(q, int):
        return q > 0
    return isinstance(q, str) and bool(_POSITIVE_INT.match(q))


def _tolerates(pod: Mapping[str, Any], taint_key: str) -> bool:
    for t in pod.get("tolerations") or []:
        t = _dict(t)
        if t.get("effect") not in (None, "", "NoSchedule"):
            continue
        key, op = t.get("key"), t.get("operator", "Equal")
        if not key and op == "Exists":  # tolerates every taint
            return True
        if key == taint_key:
            return True
    return False


def _check_gpus(w: _Workload) -> Iterator[Finding]:
    gpu_resources: set[str] = set()
    for cpath, c in _containers(w.pod):
        res = _dict(c.get("resources"))
        limits, requests = _dict(res.get("limits")), _dict(res.get("requests"))
        where = f"{w.where}.{cpath}.resources"
        for section, quantities in (("limits", limits), ("requests", requests)):
            for key, q in quantities.items():
                if is_gpu_resource(key):
                    gpu_resources.add(key)
                    if not _gpu_quantity_ok(q):
                        yield Finding(
                            "gpu-quantity",
                            f"{where}.{section}.{key}",
                            f"GPU quantity {q!r} is not a positive integer",
                        )
        for key, q in requests.items():
            if not is_gpu_resource(key):
                continue
            if key not in limits:
                yield Finding(
                    "gpu-limits", f"{where}.requests.{key}", f"{key} in requests but not in limits"
                )
            elif str(limits[key]) != str(q):
                yield Finding(
                    "gpu-limits",
                    f"{where}.requests.{key}",
                    f"{key} request {q!r} differs from its limit {limits[key]!r}",
                )
    for key in sorted(gpu_resources):
        if not _tolerates(w.pod, _gpu_taint_key(key)):
            yield Finding(
                "gpu-toleration",
                f"{w.where}.tolerations",
                f"asks for {key} but does not tolerate the {_gpu_taint_key(key)} NoSchedule taint",
            )
    if gpu_resources and not any(
        _dict(m).get("mountPath") == "/dev/shm"
        for _, c in _containers(w.pod)
        for m in c.get("volumeMounts") or []
    ):
        yield Finding(
            "shm",
            f"{w.where}.volumes",
            "a GPU pod without a memory-backed /dev/shm gets 64 MiB (NCCL and "
            "DataLoader workers need more)",
        )


def _check_shm(w: _Workload) -> Iterator[Finding]:
    volumes = {(_dict(v)).get("name"): _dict(v) for v in w.pod.get("volumes") or []}
    for cpath, c in _containers(w.pod):
        for i, m in enumerate(c.get("volumeMounts") or []):
            m = _dict(m)
            if m.get("mountPath") != "/dev/shm":
                continue
            vol = volumes.get(m.get("name"), {})
            if _dict(vol.get("emptyDir")).get("medium") != "Memory":
                yield Finding(
                    "shm",
                    f"{w.where}.{cpath}.volumeMounts[{i}]",
                    f"/dev/shm is volume {m.get('name')!r}, not an emptyDir with medium Memory",
                )


def _check_security(w: _Workload) -> Iterator[Finding]:
    pod_sc = _dict(w.pod.get("securityContext"))
    for cpath, c in _containers(w.pod):
        sc = _dict(c.get("securityContext"))
        where = f"{w.where}.{cpath}.securityContext"
        non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
        user = sc.get("runAsUser", pod_sc.get("runAsUser"))
        if non_root is not True:
            yield Finding(
                "non-root",
                f"{where}.runAsNonRoot",
                f"container {c.get('name')!r} may run as root "
                "(runAsNonRoot is not true in the pod or the container)",
            )
        if user == 0:
            yield Finding(
                "non-root", f"{where}.runAsUser", f"container {c.get('name')!r} runs as uid 0"
            )
        if sc.get("allowPrivilegeEscalation") is not False:
            yield Finding(
                "privilege-escalation",
                f"{where}.allowPrivilegeEscalation",
                f"container {c.get('name')!r}: allowPrivilegeEscalation is not false",
            )


def _check_images(w: _Workload) -> Iterator[Finding]:
    for cpath, c in _containers(w.pod):
        image = c.get("image")
        if not isinstance(image, str):
            continue
        if "@" in image:  # a digest pins it whatever the tag says
            continue
        last = image.rsplit("/", 1)[-1]
        tag = last.split(":", 1)[1] if ":" in last else None
        if tag in (None, "latest"):
            yield Finding(
                "image-tag",
                f"{w.where}.{cpath}.image",
                f"image {image!r} is not pinned: "
                + ("no tag means latest" if tag is None else ":latest"),
            )


def lint(obj: Mapping[str, Any]) -> list[Finding]:
    """Findings for one API object (any kind; kinds without pods have none)."""
    out: list[Finding] = []
    for w in _workloads(obj):
        if w.job is not None:
            out += _check_job(w)
        out += _check_gpus(w)
        out += _check_shm(w)
        out += _check_security(w)
        out += _check_images(w)
    return out


def lint_all(objs: Iterable[Mapping[str, Any]]) -> list[Finding]:
    return [f for obj in objs if isinstance(obj, Mapping) for f in lint(obj)]


def jobset_child_jobs(jobset: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The JobSet's Job templates as the batch/v1 Jobs its controller creates (the first
    replica of each replicatedJob, named `<jobset>-<replicatedJob>-0`), so tools that do not
    know the JobSet CRD (kubernetes-validate, checkov) can check them. The JobSet's
    annotations are carried over, so checkov's skip annotations still apply."""
    meta = _dict(jobset.get("metadata"))
    out: list[dict[str, Any]] = []
    for rj in _dict(jobset.get("spec")).get("replicatedJobs") or []:
        rj = _dict(rj)
        template = _dict(rj.get("template"))
        child_meta: dict[str, Any] = {"name": f"{meta.get('name')}-{rj.get('name')}-0"}
        if "namespace" in meta:
            child_meta["namespace"] = meta["namespace"]
        for key in ("labels", "annotations"):
            merged = {**_dict(meta.get(key)), **_dict(_dict(template.get("metadata")).get(key))}
            if merged:
                child_meta[key] = merged
        out.append(
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": child_meta,
                "spec": dict(_dict(template.get("spec"))),
            }
        )
    return out


def load_yaml_files(paths: Iterable[Path]) -> list[tuple[Path, dict[str, Any]]]:
    """(file, object) for every YAML document under `paths` (files or directories).
    kustomization.yaml files are skipped: they are kustomize's input, not API objects."""
    out: list[tuple[Path, dict[str, Any]]] = []
    for p in paths:
        files = sorted([*p.rglob("*.yaml"), *p.rglob("*.yml")]) if p.is_dir() else [p]
        for f in files:
            if f.name in ("kustomization.yaml", "kustomization.yml"):
                continue
            for doc in yaml.safe_load_all(f.read_text(encoding="utf-8")):
                if isinstance(doc, dict) and "kind" in doc:
                    out.append((f, doc))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tests.support.k8s_lint",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("paths", nargs="+", type=Path, help="YAML files or directories")
    args = ap.parse_args(argv)
    n = 0
    for f, obj in load_yaml_files(args.paths):
        for finding in lint(obj):
            print(f"{f}: {finding}")
            n += 1
    print(f"{n} finding(s)", file=sys.stderr)
    return 1 if n else 0


if __name__ == "__main__":
    sys.exit(main())
