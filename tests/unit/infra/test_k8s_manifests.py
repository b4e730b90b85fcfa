"""The Kubernetes manifests: infra/k8s_manifests.py render(), the generated k8s/ files, the
kustomize output, our lint (tests/support/k8s_lint.py), the official schemas (kubernetes-validate,
strict), the JobSet CRD's top level (a schema vendored under tests/fixtures/jobset/), the
Prefect work pool template, the Dockerfile and, where checkov is installed, the scan."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate.utils as kv
import pytest
import yaml

from infra.jobs import JobSpec
from infra.k8s_manifests import (
    COMMAND,
    CONFIG_KEY,
    CONTAINER,
    GENERATED_NOTE,
    LABEL_APP,
    LABEL_ATTEMPT,
    LABEL_MESH,
    LABEL_RUN,
    WORKDIR,
    KubeOptions,
    copy_note,
    render,
)
from infra.k8s_overlays import (
    OVERLAYS,
    canonical_spec,
    generated_files,
    main,
    overlay_spec,
    stale,
)
from infra.k8s_work_pool import work_pool_template
from infra.mesh import MESH_ENV, fit_launch, mesh_name
from tests.support import k8s_lint
from tests.support.helpers import ROOT
from training.config import parse_train_config

K8S = ROOT / "k8s"
JOBSET_SCHEMA = ROOT / "tests/fixtures/jobset/jobset-v1alpha2.schema.json"
# The oldest Kubernetes we support (podFailurePolicy is stable from 1.31) and the newest
# kubernetes-validate ships schemas for.
K8S_VERSIONS = ("1.31", kv.major_minor(kv.latest_version()))
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")

# Job failure messages as the Job controller writes them (kubernetes
# pkg/controller/job/pod_failure_policy.go), which the JobSet rules match.
MSG_EXIT = (
    "Container trainer for pod ballast/ballast-train-a0-trainer-0-1-x7k2p failed with "
    "exit code {code} matching FailJob rule at index 1"
)
MSG_DISRUPTION = (
    "Pod ballast/ballast-train-a0-trainer-0-1-x7k2p has condition DisruptionTarget "
    "matching FailJob rule at index 0"
)


def spec(**kw: Any) -> JobSpec:
    base: dict[str, Any] = {"name": "run", "config": "/etc/ballast/train.yaml", "nproc_per_node": 8}
    return JobSpec(**{**base, **kw})


def one(objs: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(objs) == 1
    return objs[0]


def job_spec_of(obj: dict[str, Any]) -> dict[str, Any]:
    if obj["kind"] == "Job":
        return obj["spec"]
    return obj["spec"]["replicatedJobs"][0]["template"]["spec"]


def pod_of(obj: dict[str, Any]) -> dict[str, Any]:
    return job_spec_of(obj)["template"]["spec"]


def container_of(obj: dict[str, Any]) -> dict[str, Any]:
    return pod_of(obj)["containers"][0]


def walk(x: Any) -> Iterator[Any]:
    yield x
    if isinstance(x, dict):
        for v in x.values():
            yield from walk(v)
    elif isinstance(x, list):
        for v in x:
            yield from walk(v)


def k8s_yaml_docs() -> list[tuple[Path, dict[str, Any]]]:
    """Every API object in k8s/ (kustomization.yaml is kustomize's input; base/train.yaml is
    the training config; both are checked on their own)."""
    return [(f, d) for f, d in k8s_lint.load_yaml_files([K8S]) if f.name != CONFIG_KEY]


def kustomize(overlay: str) -> list[dict[str, Any]]:
    assert KUBECTL is not None
    out = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def validate_strict(obj: dict[str, Any]) -> None:
    """kubernetes-validate --strict against every version in K8S_VERSIONS. A JobSet (a CRD
    it has no schema for) is checked against the vendored top-level schema, and its Job
    template, wrapped into the batch/v1 Job its controller creates, against the official
    Job schema."""
    if obj.get("kind") == "JobSet":
        jsonschema.validate(obj, json.loads(JOBSET_SCHEMA.read_text()))
        for job in k8s_lint.jobset_child_jobs(obj):
            validate_strict(job)
        return
    for version in K8S_VERSIONS:
        kv.validate(obj, version, strict=True)


# --- render(): kind, failure policies, rendezvous, GPUs, labels, names -------------------------


def test_kind_follows_nnodes() -> None:
    opts = KubeOptions()
    job = one(render(spec(nnodes=1), opts))
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    js = one(render(spec(nnodes=2), opts))
    assert (js["apiVersion"], js["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    forced = one(render(spec(nnodes=1), KubeOptions(kind="jobset")))
    assert forced["kind"] == "JobSet"
    assert job_spec_of(forced)["completions"] == 1
    assert one(render(spec(nnodes=1), KubeOptions(kind="job")))["kind"] == "Job"
    with pytest.raises(ValueError, match="JobSet"):
        render(spec(nnodes=2), KubeOptions(kind="job"))


@pytest.mark.parametrize("nnodes", [1, 3])
def test_indexed_job_shape(nnodes: int) -> None:
    obj = one(render(spec(nnodes=nnodes, attempt=2), KubeOptions()))
    assert obj["metadata"]["name"] == "run-a2"
    assert obj["metadata"]["namespace"] == "ballast"
    js = job_spec_of(obj)
    assert js["completionMode"] == "Indexed"
    assert js["completions"] == js["parallelism"] == nnodes
    assert pod_of(obj)["restartPolicy"] == "Never"
    assert "activeDeadlineSeconds" not in js


def test_job_pod_failure_policy() -> None:
    obj = one(render(spec(), KubeOptions(backoff_limit=5)))
    assert obj["spec"]["backoffLimit"] == 5
    assert obj["spec"]["ttlSecondsAfterFinished"] == 7 * 24 * 3600
    assert obj["spec"]["podFailurePolicy"] == {
        "rules": [
            {
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [1, 3]},
            },
        ]
    }
    assert container_of(obj)["name"] == CONTAINER == "trainer"


def test_jobset_failure_policy_and_network() -> None:
    obj = one(render(spec(nnodes=2), KubeOptions(jobset_max_restarts=7)))
    s = obj["spec"]
    assert s["network"]["enableDNSHostnames"] is True
    assert s["ttlSecondsAfterFinished"] == 7 * 24 * 3600
    [rj] = s["replicatedJobs"]
    assert (rj["name"], rj["replicas"]) == ("trainer", 1)
    inner = rj["template"]["spec"]
    # Any pod failure ends the Job, so the JobSet restarts the whole gang.
    assert inner["backoffLimit"] == 0
    assert inner["podFailurePolicy"]["rules"] == [
        {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {
            "action": "FailJob",
            "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [1, 3]},
        },
    ]
    fp = s["failurePolicy"]
    assert fp["maxRestarts"] == 7
    assert [(r["name"], r["action"], r["onJobFailureReasons"]) for r in fp["rules"]] == [
        ("finalExitCode", "FailJobSet", ["PodFailurePolicy"]),
        ("nodeDisruption", "RestartJobSetAndIgnoreMaxRestarts", ["PodFailurePolicy"]),
    ]


def _first_rule(obj: dict[str, Any], reason: str, message: str) -> str:
    """The action JobSet takes for a failed child Job (first matching rule, else the default
    RestartJobSet). Python's re agrees with RE2 on these patterns."""
    for rule in obj["spec"]["failurePolicy"]["rules"]:
        reasons = rule.get("onJobFailureReasons") or []
        patterns = rule.get("onJobFailureMessagePatterns") or []
        if (not reasons or reason in reasons) and (
            not patterns or any(re.search(p, message) for p in patterns)
        ):
            return str(rule["action"])
    return "RestartJobSet"


def test_jobset_rules_tell_exit_codes_from_disruption() -> None:
    obj = one(render(spec(nnodes=2), KubeOptions()))
    assert _first_rule(obj, "PodFailurePolicy", MSG_EXIT.format(code=3)) == "FailJobSet"
    assert _first_rule(obj, "PodFailurePolicy", MSG_EXIT.format(code=1)) == "FailJobSet"
    assert (
        _first_rule(obj, "PodFailurePolicy", MSG_DISRUPTION) == "RestartJobSetAndIgnoreMaxRestarts"
    )
    # A crash fails the backoffLimit-0 Job: a counted gang restart.
    assert (
        _first_rule(obj, "BackoffLimitExceeded", "Job has reached the specified backoff limit")
        == "RestartJobSet"
    )
    # On a JobSet too old to know the message patterns they are dropped: exit 1/3 must
    # still be final (FailJobSet first), never restart forever.
    stripped = copy.deepcopy(obj)
    for rule in stripped["spec"]["failurePolicy"]["rules"]:
        rule.pop("onJobFailureMessagePatterns")
    assert _first_rule(stripped, "PodFailurePolicy", MSG_EXIT.format(code=3)) == "FailJobSet"


def test_multi_node_rendezvous_args() -> None:
    s = spec(
        name="gpt",
        nnodes=4,
        attempt=3,
        nproc_per_node=8,
        torchrun_max_restarts=1,
        args=("--steps", "10"),
    )
    c = container_of(one(render(s, KubeOptions(rdzv_port=29400))))
    assert c["command"] == ["python", "-m", "training.entrypoint"]
    assert c["args"] == [
        "--nproc-per-node=8",
        "--max-restarts=1",
        "--nnodes=4",
        "--node-rank=$(JOB_COMPLETION_INDEX)",
        "--rdzv-backend=c10d",
        # JobSet pod hostname <jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain>
        "--rdzv-endpoint=gpt-a3-trainer-0-0.gpt-a3:29400",
        "--rdzv-id=gpt-a3",
        "--",
        "--config",
        "/etc/ballast/train.yaml",
        "--steps",
        "10",
    ]
    index = c["env"][0]
    assert index == {
        "name": "JOB_COMPLETION_INDEX",
        "valueFrom": {
            "fieldRef": {
                "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
            }
        },
    }


def test_the_mesh_label_and_env() -> None:
    """A job whose environment names its mesh (the train flow sets it) carries it as a
    label on the object, the Job template and the pods, where `kubectl get -L` shows it."""
    for nnodes in (1, 2):
        obj = one(render(spec(nnodes=nnodes, env={MESH_ENV: "pp2-dp1x2-tp4"}), KubeOptions()))
        for meta in (obj["metadata"], job_spec_of(obj)["template"]["metadata"]):
            assert meta["labels"][LABEL_MESH] == "pp2-dp1x2-tp4"
        if obj["kind"] == "JobSet":
            template = obj["spec"]["replicatedJobs"][0]["template"]
            assert template["metadata"]["labels"][LABEL_MESH] == "pp2-dp1x2-tp4"
        env = {e["name"]: e.get("value") for e in container_of(obj)["env"]}
        assert env[MESH_ENV] == "pp2-dp1x2-tp4"
        validate_strict(obj)
    # Without it, no label (the backend finds pods by run and attempt alone).
    assert LABEL_MESH not in one(render(spec(), KubeOptions()))["metadata"]["labels"]
    with pytest.raises(ValueError, match="is not a label value"):
        render(spec(env={MESH_ENV: "pp 2 / tp 4"}), KubeOptions())


def test_the_3d_overlay_carries_what_torchrun_needs() -> None:
    """k8s/overlays/multi-node-3d: 2 pods of 8 processes, the node rank from the Job's
    completion index, c10d rendezvous at pod 0; the mesh as label and env."""
    on_disk = list(yaml.safe_load_all((K8S / "overlays/multi-node-3d/jobset.yaml").read_text()))
    js = one(on_disk)
    assert js["kind"] == "JobSet"
    assert js["metadata"]["labels"][LABEL_MESH] == "pp2-dp1x2-tp4"
    job = job_spec_of(js)
    assert (job["completionMode"], job["completions"], job["parallelism"]) == ("Indexed", 2, 2)
    c = container_of(js)
    assert c["args"][:7] == [
        "--nproc-per-node=8",
        "--max-restarts=0",
        "--nnodes=2",
        "--node-rank=$(JOB_COMPLETION_INDEX)",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=ballast-train-a0-trainer-0-0.ballast-train-a0:29500",
        "--rdzv-id=ballast-train-a0",
    ]
    # One GPU per process: a pipeline stage (a node) is 8 GPUs, 2 TP groups of 4.
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env[MESH_ENV] == "pp2-dp1x2-tp4"
    assert k8s_lint.lint_all(on_disk) == []


def test_single_node_lets_the_entrypoint_go_standalone() -> None:
    s = spec()
    c = container_of(one(render(s, KubeOptions())))
    assert c["args"] == s.entrypoint_argv(())
    assert not any(a.startswith(("--rdzv", "--nnodes", "--node-rank")) for a in c["args"])


def test_pod_template() -> None:
    opts = KubeOptions(
        image="reg.example/ballast:1.2",
        shm_size="8Gi",
        cpu="16",
        memory="128Gi",
        gpus_per_node=4,
        run_as_user=4242,
    )
    obj = one(render(spec(nproc_per_node=4, env={"B": "2", "A": "1"}), opts))
    pod = pod_of(obj)
    assert pod["serviceAccountName"] == "ballast-trainer"
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == {
        "runAsNonRoot": True,
        "runAsUser": 4242,
        "runAsGroup": 4242,
        "fsGroup": 4242,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    c = pod["containers"][0]
    assert (c["image"], c["imagePullPolicy"], c["workingDir"]) == (
        "reg.example/ballast:1.2",
        "IfNotPresent",
        "/work",
    )
    assert c["resources"] == {
        "requests": {"cpu": "16", "memory": "128Gi"},
        "limits": {"cpu": "16", "memory": "128Gi", "nvidia.com/gpu": "4"},
    }
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    vols = {v["name"]: v for v in pod["volumes"]}
    assert set(mounts) == {"/dev/shm", "/etc/ballast", "/work", "/tmp"}
    assert vols[mounts["/dev/shm"]["name"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert mounts["/etc/ballast"]["readOnly"] is True
    assert vols[mounts["/etc/ballast"]["name"]]["configMap"] == {"name": "ballast-train-config"}
    assert "emptyDir" in vols[mounts["/work"]["name"]]
    assert "emptyDir" in vols[mounts["/tmp"]["name"]]
    env = {e["name"]: e for e in c["env"]}
    assert [e["name"] for e in c["env"]][2:4] == ["A", "B"]  # sorted, after the fixed ones
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[key]["valueFrom"]["secretKeyRef"] == {"name": "ballast-s3", "key": key}
    assert env["AWS_ENDPOINT_URL_S3"]["valueFrom"]["secretKeyRef"]["optional"] is True


def test_no_gpu_fields_without_gpus() -> None:
    for n in (1, 2):
        obj = one(render(spec(nnodes=n, nproc_per_node=2), KubeOptions(gpus_per_node=0)))
        pod = pod_of(obj)
        assert "nodeSelector" not in pod and "tolerations" not in pod
        assert not any("gpu" in k for k in pod["containers"][0]["resources"]["limits"])
        assert k8s_lint.lint(obj) == []


def test_labels_on_object_job_template_and_pods() -> None:
    want = {LABEL_APP: "ballast", LABEL_RUN: "gpt", LABEL_ATTEMPT: "5"}
    for n in (1, 2):
        obj = one(render(spec(name="gpt", attempt=5, nnodes=n), KubeOptions()))
        assert obj["metadata"]["labels"] == want
        assert job_spec_of(obj)["template"]["metadata"]["labels"] == want
        if obj["kind"] == "JobSet":
            assert obj["spec"]["replicatedJobs"][0]["template"]["metadata"]["labels"] == want


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: spec(name="Bad_Name"), "job name"),
        (lambda: spec(name="x" * 43), "job name"),
        (lambda: render(spec(name="x" * 42, attempt=10**9, nnodes=2), KubeOptions()), "hostname"),
        (lambda: render(spec(name="x" * 42, attempt=10**18), KubeOptions()), "hostname"),
        (lambda: render(spec(name="7b", nnodes=2), KubeOptions()), "start with a letter"),
        (lambda: render(spec(nproc_per_node=9), KubeOptions()), "share a GPU"),
        (lambda: render(spec(env={"HOME": "/x"}), KubeOptions()), "set by the pod template"),
        (lambda: render(spec(env={"1X": "y"}), KubeOptions()), "not a valid"),
        (lambda: render(spec(), KubeOptions(kind="pod")), "expected auto"),  # type: ignore[arg-type]
        (lambda: render(spec(), KubeOptions(run_as_user=0)), "non-root"),
    ],
)
def test_names_and_options_are_checked(make: Callable[[], object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_a_digit_first_name_is_fine_for_a_job() -> None:
    assert one(render(spec(name="7b"), KubeOptions()))["metadata"]["name"] == "7b-a0"


def test_deterministic_and_no_none() -> None:
    opts = KubeOptions()
    for n in (1, 2):
        a = render(spec(nnodes=n, env={"X": "1", "Y": "2"}), opts)
        b = render(spec(nnodes=n, env={"Y": "2", "X": "1"}), KubeOptions())
        assert a == b
        assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
        assert not any(v is None for v in walk(a))
        # Independent copies: mutating one result cannot leak into the next.
        a[0]["metadata"]["labels"]["x"] = "y"
        assert "x" not in render(spec(nnodes=n), opts)[0]["metadata"]["labels"]
    assert not any(v is None for v in walk(work_pool_template(opts)))


# --- k8s/: generated files, kustomize, schemas ----------------------------------------------


def test_generated_files_are_up_to_date_and_marked() -> None:
    assert stale(K8S) == [], "run: python -m infra.k8s_manifests write"
    for rel in generated_files():
        text = (K8S / rel).read_text()
        if rel.suffix == ".json":
            assert json.loads(text)["variables"]["description"] == GENERATED_NOTE
        elif rel.name == CONFIG_KEY:
            overlay = OVERLAYS[rel.parent.name]
            assert overlay.config is not None
            source = (ROOT / overlay.config).read_text()
            assert text == f"# {copy_note(overlay.config)}\n{source}"
        else:
            assert text.startswith(f"# {GENERATED_NOTE}\n")


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_yaml_equals_render(overlay: str) -> None:
    o = OVERLAYS[overlay]
    s = overlay_spec(overlay)
    assert s == canonical_spec(o.nnodes, mesh=o.mesh)
    assert (s.name, s.config, s.attempt) == ("ballast-train", "/etc/ballast/train.yaml", 0)
    on_disk = [d for d in yaml.safe_load_all((K8S / "overlays" / overlay / o.file).read_text())]
    assert on_disk == render(s, KubeOptions())
    kust = yaml.safe_load((K8S / "overlays" / overlay / "kustomization.yaml").read_text())
    assert kust["resources"] == ["../../base", o.file]
    # An overlay with a config of its own merges it into the ConfigMap the pods mount.
    merged = [g for g in kust.get("configMapGenerator", []) if g["name"] == "ballast-train-config"]
    if o.config is None:
        assert merged == []
    else:
        assert merged == [
            {
                "name": KubeOptions().config_map,
                "behavior": "merge",
                "files": [CONFIG_KEY],
                "options": {"disableNameSuffixHash": True},
            }
        ]


def _overlay_config(overlay: str) -> tuple[Path, dict[str, Any]]:
    o = OVERLAYS[overlay]
    path = ROOT / o.config if o.config is not None else K8S / "base" / CONFIG_KEY
    return path, yaml.safe_load(path.read_text())


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_mesh_is_its_configs(overlay: str) -> None:
    """The mesh an overlay is labelled with is the one its training config resolves to on
    the overlay's nodes, and fits them (infra/mesh.py): the label does not lie, and the
    example does not fail the train flow's check."""
    o = OVERLAYS[overlay]
    path, data = _overlay_config(overlay)
    gpus = KubeOptions().gpus_per_node
    rel = str(path.relative_to(ROOT))
    cfg = parse_train_config(data, rel)
    fit = fit_launch(cfg.parallel, o.nnodes, gpus)
    assert (fit.shape, fit.warnings) == (o.mesh, ())
    assert overlay_spec(overlay).env[MESH_ENV] == mesh_name(o.mesh)


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_kustomize_output_contains_the_launchers_objects(overlay: str) -> None:
    docs = kustomize(overlay)
    launcher = render(overlay_spec(overlay), KubeOptions())
    for obj in launcher:
        # kustomize sets the overlay's namespace; the launcher's is the same.
        assert obj in docs, f"{obj['kind']}/{obj['metadata']['name']} changed by kustomize"
    cms = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    # The Job refers to this fixed name (no kustomize hash suffix).
    text = cms[KubeOptions().config_map]["data"][CONFIG_KEY]
    path, data = _overlay_config(overlay)
    # The overlay's own config (or the base's) is the one the pods mount.
    assert yaml.safe_load(text) == data
    parse_train_config(data, str(path.relative_to(ROOT)))
    # The prep config the kubernetes work pool's flow runs read (prefect.yaml) is there too.
    from dataprep.config import parse_config

    prep = parse_config(yaml.safe_load(cms[KubeOptions().config_map]["data"]["prep.yaml"]))
    assert data["dataset"] == f"{prep.output}/dataset"
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"ballast"}


def test_every_k8s_yaml_validates_strict() -> None:
    # No YAML file is skipped by accident: each document of each file is an API object,
    # except kustomize's own files and the run configs.
    for f in sorted(K8S.rglob("*.y*ml")):
        if f.name in ("kustomization.yaml", CONFIG_KEY, "prep.yaml"):
            continue
        for d in yaml.safe_load_all(f.read_text()):
            assert isinstance(d, dict) and "kind" in d and "apiVersion" in d, f
    docs = k8s_yaml_docs()
    kinds = {d["kind"] for _, d in docs}
    assert {
        "Namespace",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "Deployment",
        "NetworkPolicy",
        "Job",
        "JobSet",
    } <= kinds
    for f, d in docs:
        try:
            validate_strict(d)
        except Exception as e:
            raise AssertionError(f"{f.relative_to(ROOT)}: {d['kind']}: {e}") from e


@needs_kubectl
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_kustomize_output_validates_strict(overlay: str) -> None:
    for d in kustomize(overlay):
        validate_strict(d)


def test_render_output_validates_strict_in_many_shapes() -> None:
    for s, opts in [
        (spec(), KubeOptions()),
        (spec(nnodes=3), KubeOptions()),
        (spec(nproc_per_node=2), KubeOptions(gpus_per_node=0)),
        (spec(), KubeOptions(kind="jobset", node_selector={}, tolerations=[])),
    ]:
        for obj in render(s, opts):
            validate_strict(obj)


def test_validation_catches_what_it_should() -> None:
    """The checks above can fail: an unknown field (strict), a JobSet field or enum value
    the vendored schema does not know."""
    job = copy.deepcopy(one(render(spec(), KubeOptions())))
    job["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    with pytest.raises(kv.ValidationError):
        validate_strict(job)
    js = one(render(spec(nnodes=2), KubeOptions()))
    for mutate in (
        lambda o: o["spec"].update(gangRestart=True),
        lambda o: o["spec"]["failurePolicy"]["rules"][0].update(action="Retry"),
        lambda o: o["spec"]["failurePolicy"]["rules"][0].pop("name"),
        lambda o: o["spec"]["failurePolicy"].update(restartStrategy="InPlaceRestart"),
    ):
        bad = copy.deepcopy(js)
        mutate(bad)
        with pytest.raises(jsonschema.ValidationError):
            validate_strict(bad)
    bad = copy.deepcopy(js)
    bad["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["bogus"] = 1
    with pytest.raises(kv.ValidationError):
        validate_strict(bad)


def test_train_config_and_rbac() -> None:
    from infra.launch import parse_launch

    data = yaml.safe_load((K8S / "base" / CONFIG_KEY).read_text())
    cfg = parse_train_config(data, "k8s/base/train.yaml")
    # Its `launch:` section (the trainer ignores it) is valid, and one trainer process per
    # GPU of the pods it asks for.
    launch = parse_launch(data.get("launch"), where="k8s/base/train.yaml")
    assert launch.nproc_per_node <= max(launch.kubernetes.gpus_per_node, 1)
    assert cfg.dataset.startswith("s3://")
    assert cfg.checkpoint.remote and cfg.checkpoint.remote.startswith("s3://")
    # checkpoint.remote is a root; the run's own prefix is where it always was.
    assert cfg.remote_checkpoint_uri() == "s3://ballast-checkpoints/ballast-train"
    assert (cfg.run_dir, cfg.parallel, cfg.precision.dtype) == ("/work/run", "ddp", "bf16")
    assert cfg.run_dir.startswith(WORKDIR + "/")
    objs = {(d["kind"], d["metadata"]["name"]): d for _, d in k8s_yaml_docs()}
    assert objs[("ServiceAccount", "ballast-trainer")]["automountServiceAccountToken"] is False
    role = objs[("Role", "ballast-supervisor")]
    allowed = {("batch", "jobs"), ("jobset.x-k8s.io", "jobsets"), ("", "pods"), ("", "pods/log")}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for res in rule["resources"]:
                assert (group, res) in allowed
                limit = (
                    {"get"} if res == "pods/log" else {"get", "list", "watch", "create", "delete"}
                )
                assert set(rule["verbs"]) <= limit, (res, rule["verbs"])
    binding = objs[("RoleBinding", "ballast-supervisor")]
    assert [s["name"] for s in binding["subjects"]] == ["ballast-supervisor"]
    assert not any(
        d["kind"] == "RoleBinding" and any(s["name"] == "ballast-trainer" for s in d["subjects"])
        for d in objs.values()
    )
    worker = objs[("Deployment", "prefect-worker")]
    pod = worker["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ballast-supervisor"
    args = " ".join(pod["containers"][0]["args"])
    assert "prefect worker start --pool ballast-k8s --type kubernetes" in args
    readme = (K8S / "README.md").read_text()
    assert "kubectl -n ballast create secret generic ballast-s3" in readme
    assert "kubectl apply -k k8s/overlays/single-node" in readme


# --- the Prefect work pool's base job template ----------------------------------------------

# prefect-kubernetes (0.8.0, worker.py _get_base_job_manifest) refuses a job manifest that
# lacks any of these paths or has other values at them.
PREFECT_REQUIRED_MANIFEST = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "metadata": {"annotations": {}, "labels": {}},
    "spec": {
        "template": {
            "spec": {
                "parallelism": 1,
                "completions": 1,
                "restartPolicy": "Never",
                "containers": [{"name": "prefect-job"}],
            }
        }
    },
}


def test_work_pool_template() -> None:
    import jsonpatch
    from prefect.server.schemas.actions import validate_base_job_template
    from prefect.utilities.templating import apply_values

    template = json.loads((K8S / "base" / "work-pool-template.json").read_text())
    validate_base_job_template(template)  # what the Prefect API checks on create/update
    jsonschema.Draft202012Validator.check_schema(template["variables"])
    # As the worker builds a flow run's configuration (BaseJobConfiguration.
    # from_template_and_values): variable defaults applied to the job_configuration.
    props = template["variables"]["properties"]
    defaults = {k: v["default"] for k, v in props.items() if v.get("default") is not None}
    jsonschema.validate(defaults, template["variables"])
    config = apply_values(template["job_configuration"], defaults)
    manifest = config["job_manifest"]
    manifest["metadata"].setdefault("annotations", {})  # the worker's validator adds these
    manifest["metadata"].setdefault("labels", {})
    bad_ops = [
        op
        for op in jsonpatch.JsonPatch.from_diff(manifest, PREFECT_REQUIRED_MANIFEST)
        if op["op"] in ("add", "replace")
    ]
    assert bad_ops == []
    pod = manifest["spec"]["template"]["spec"]
    c = pod["containers"][0]
    opts = KubeOptions()
    assert c["resources"]["limits"][opts.gpu_resource] == opts.gpus_per_node
    assert pod["tolerations"] == opts.tolerations
    assert pod["nodeSelector"] == opts.node_selector
    assert c["image"] == opts.image and pod["serviceAccountName"] == opts.service_account
    # Prefect sets args (`prefect flow-run execute`); our image's ENTRYPOINT is the trainer.
    assert c["command"] == ["/usr/bin/env"]
    assert manifest["spec"]["backoffLimit"] == 0
    # What the API server gets: the two prefect-only pod fields dropped, the worker's args.
    sent = copy.deepcopy(manifest)
    del sent["spec"]["template"]["spec"]["parallelism"]
    del sent["spec"]["template"]["spec"]["completions"]
    sent["metadata"]["generateName"] = "flow-run-"
    sent["spec"]["template"]["spec"]["containers"][0]["args"] = ["prefect", "flow-run", "execute"]
    validate_strict(sent)
    assert k8s_lint.lint(sent) == []


# --- our lint ----------------------------------------------------------------------------------


def _job() -> dict[str, Any]:
    return copy.deepcopy(one(render(overlay_spec("single-node"), KubeOptions())))


def _jobset() -> dict[str, Any]:
    return copy.deepcopy(one(render(overlay_spec("multi-node"), KubeOptions())))


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation setting `value` (or deleting, with _DELETE) at a dotted path that starts at
    the Job spec (job), the pod spec (pod) or the container (c); GPU stands for G."""

    def mutate(obj: dict[str, Any]) -> None:
        *parents, last = [G if p == "GPU" else p for p in path.split(".")]
        node: Any = {"job": job_spec_of(obj), "pod": pod_of(obj), "c": container_of(obj)}
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if value is _DELETE:
            del node[last]
        elif isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return mutate


_DELETE = object()
G = "nvidia.com/gpu"

LINT_CASES: list[tuple[str, Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]] = [
    ("job-restart-policy", _job, _set("pod.restartPolicy", "Always")),
    ("job-restart-policy", _jobset, _set("pod.restartPolicy", _DELETE)),
    ("pfp-restart-policy", _job, _set("pod.restartPolicy", "OnFailure")),
    ("pfp-action", _job, _set("job.podFailurePolicy.rules.1.action", "Retry")),
    ("pfp-action", _jobset, _set("job.podFailurePolicy.rules.1.action", "FailIndex")),
    (
        "pfp-rule",
        _job,
        _set("job.podFailurePolicy.rules.0.onExitCodes", {"operator": "In", "values": [2]}),
    ),
    ("pfp-rule", _job, _set("job.podFailurePolicy.rules.0.onPodConditions", _DELETE)),
    ("exit-codes", _job, _set("job.podFailurePolicy.rules.1.onExitCodes.operator", "Equals")),
    ("exit-codes", _job, _set("job.podFailurePolicy.rules.1.onExitCodes.values", [0, 3])),
    ("exit-codes", _job, _set("job.podFailurePolicy.rules.1.onExitCodes.values", ["1"])),
    ("exit-codes", _job, _set("job.podFailurePolicy.rules.1.onExitCodes.values", [3, 3])),
    ("exit-codes", _job, _set("job.podFailurePolicy.rules.1.onExitCodes.containerName", "main")),
    ("gpu-quantity", _job, _set("c.resources.limits.GPU", "0.5")),
    ("gpu-quantity", _job, _set("c.resources.limits.GPU", 0)),
    ("gpu-quantity", _jobset, _set("c.resources.limits.GPU", "500m")),
    ("gpu-limits", _job, _set("c.resources.requests.GPU", 4)),
    ("gpu-limits", _job, _set("c.resources", {"requests": {G: 1}})),
    ("gpu-toleration", _job, _set("pod.tolerations", _DELETE)),
    (
        "gpu-toleration",
        _jobset,
        _set(
            "pod.tolerations",
            [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoExecute"}],
        ),
    ),
    ("shm", _job, _set("pod.volumes.0.emptyDir", {})),
    ("shm", _job, _set("c.volumeMounts", [])),
    ("non-root", _job, _set("pod.securityContext.runAsNonRoot", False)),
    ("non-root", _jobset, _set("c.securityContext.runAsUser", 0)),
    ("privilege-escalation", _job, _set("c.securityContext.allowPrivilegeEscalation", True)),
    ("image-tag", _job, _set("c.image", "ghcr.io/ballast-lm/ballast:latest")),
    ("image-tag", _jobset, _set("c.image", "localhost:5000/ballast")),
]


@pytest.mark.parametrize(
    ("rule", "make", "mutate"),
    LINT_CASES,
    ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(LINT_CASES)],
)
def test_each_lint_rule_fires_on_a_broken_copy(
    rule: str, make: Callable[[], dict[str, Any]], mutate: Callable[[dict[str, Any]], None]
) -> None:
    obj = make()
    assert k8s_lint.lint(obj) == []
    mutate(obj)
    found = k8s_lint.lint(obj)
    assert rule in {f.rule for f in found}, found
    assert all(str(f) for f in found)


def test_every_lint_rule_has_a_failing_case() -> None:
    assert {rule for rule, _, _ in LINT_CASES} == set(k8s_lint.RULES)


def test_lint_accepts_good_variants() -> None:
    job = _job()
    container_of(job)["image"] = "ghcr.io/ballast-lm/ballast@sha256:" + "0" * 64
    pod_of(job)["tolerations"] = [{"operator": "Exists"}]
    container_of(job)["resources"]["requests"][G] = "8"
    assert k8s_lint.lint(job) == []


def test_k8s_and_render_outputs_are_lint_clean() -> None:
    findings = [str(f) for _, d in k8s_yaml_docs() for f in k8s_lint.lint(d)]
    assert findings == []
    for n in (1, 2, 4):
        for opts in (KubeOptions(), KubeOptions(gpus_per_node=0), KubeOptions(kind="jobset")):
            assert k8s_lint.lint_all(render(spec(nnodes=n, nproc_per_node=1), opts)) == []
    assert k8s_lint.main([str(K8S)]) == 0


# --- the Dockerfile ------------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = (ROOT / "infra" / "Dockerfile").read_text()
    out: list[tuple[str, str]] = []
    buf = ""
    for line in text.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def test_dockerfile_matches_the_manifests() -> None:
    ins = _dockerfile()
    last = {k: v for k, v in ins}
    opts = KubeOptions()
    c = container_of(_job())
    pod = pod_of(_job())
    assert json.loads(last["ENTRYPOINT"]) == list(COMMAND) == c["command"]
    assert last["WORKDIR"] == WORKDIR == c["workingDir"]
    uid = last["USER"].split(":")[0]
    assert uid.isdigit() and int(uid) == opts.run_as_user == pod["securityContext"]["runAsUser"]
    assert int(uid) != 0
    assert importlib.util.find_spec("training.entrypoint") is not None
    assert COMMAND[:2] == ("python", "-m") and COMMAND[2] == "training.entrypoint"
    # The project is installed from outside /work (an emptyDir hides /work in the pods).
    pip = [v for k, v in ins if k == "RUN" and "pip install" in v]
    assert pip and "-c constraints.txt" in pip[0]
    workdirs = [v for k, v in ins if k == "WORKDIR"]
    assert workdirs[0] != WORKDIR
    assert ins[0][0] in ("ARG", "FROM") and any(k == "FROM" for k, _ in ins)


def test_dockerfile_copies_every_package() -> None:
    """`pip install .` in the image finds packages only where the Dockerfile put them: a
    package pyproject lists but the image lacks would be missing in the pods."""
    import tomllib

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"][
        "find"
    ]
    packages = {pattern.rstrip("*").rstrip(".") for pattern in find["include"]}
    assert packages and all((ROOT / p / "__init__.py").is_file() for p in packages)
    ins = _dockerfile()
    copied = {src.strip("./") for k, v in ins if k == "COPY" for src in v.split()[:-1]}
    assert packages <= copied, sorted(packages - copied)
    # The image's import check covers the Dask entrypoint k8s/overlays/prep-dask runs.
    assert _argv(_only_container(_dask_deployment("worker")))[0] == "dask"
    check = next(v for k, v in ins if k == "RUN" and "pip install" in v)
    imported = re.search(r'python -c "import ([^;"]+)', check)
    assert imported is not None
    assert "distributed" in {m.strip() for m in imported.group(1).split(",")}


# --- the CLI -----------------------------------------------------------------------------------


def test_write_and_check_cli(tmp_path: Path) -> None:
    assert main(["check", str(tmp_path)]) == 1
    assert main(["write", str(tmp_path)]) == 0
    assert main(["check", str(tmp_path)]) == 0
    for rel, text in generated_files().items():
        assert (tmp_path / rel).read_text() == text == (K8S / rel).read_text()
    job = tmp_path / "overlays/single-node/job.yaml"
    job.write_text(job.read_text().replace("backoffLimit: 3", "backoffLimit: 4"))
    assert main(["check", str(tmp_path)]) == 1
    assert main(["check", str(K8S)]) == 0


# --- the security scan ---------------------------------------------------------------------------


def _checkov() -> str | None:
    found = shutil.which("checkov")
    venv = Path(os.environ.get("CHECKOV_VENV", "/tmp/checkov-venv")) / "bin" / "checkov"
    return found or (str(venv) if venv.exists() else None)


@pytest.mark.skipif(
    _checkov() is None,
    reason="checkov not installed (bash infra/scan.sh installs it in its own venv)",
)
def test_checkov_scan_is_clean() -> None:
    checkov = _checkov()
    assert checkov is not None
    env = {**os.environ, "CHECKOV": checkov}
    r = subprocess.run(
        ["bash", str(ROOT / "infra" / "scan.sh")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "Failed checks: 0" in r.stdout


# --- k8s/overlays/prep-dask: the Dask cluster data prep uses -------------------------------------

# Overlays written by hand; OVERLAYS are the generated ones.
HAND_WRITTEN_OVERLAYS = ("prep-dask",)
PREP_DASK = K8S / "overlays" / "prep-dask"
FLOW_RUN_LABELS = {"prefect.io/flow-run-id": "0b0e5c1e-5f55-4c1a-9c55-1e2f4d6a7b8c"}


def _dask_objects() -> dict[tuple[str, str], dict[str, Any]]:
    docs = yaml.safe_load_all((PREP_DASK / "dask.yaml").read_text())
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _dask_deployment(component: str) -> dict[str, Any]:
    return _dask_objects()[("Deployment", f"ballast-dask-{component}")]


def _only_container(deploy: dict[str, Any]) -> dict[str, Any]:
    [c] = deploy["spec"]["template"]["spec"]["containers"]
    return c


def _argv(c: dict[str, Any]) -> list[str]:
    return [*c.get("command", []), *c.get("args", [])]


def _dask_cli_params(component: str, argv: list[str]) -> dict[str, Any]:
    """`dask <component> ARGS` parsed by distributed's own command-line interface (click):
    an option it no longer knows, or a value of the wrong type, raises."""
    from distributed.cli import dask_scheduler, dask_worker

    assert argv[:2] == ["dask", component]
    cli = {"scheduler": dask_scheduler.main, "worker": dask_worker.main}[component]
    return dict(cli.make_context(f"dask {component}", list(argv[2:])).params)


def _container_port(c: dict[str, Any], port: int | str) -> int:
    """A port number, or the number of the container's port of that name."""
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == port]
    return int(number)


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector (matchLabels / matchExpressions, or a Service's plain map)."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _admits(
    policies: list[dict[str, Any]], src: dict[str, str], dst: dict[str, Any], port: int
) -> bool:
    """Whether NetworkPolicy lets a pod labelled `src` reach TCP `port` of the pod template
    `dst`, both in the policies' namespace (the Kubernetes semantics: a pod no Ingress policy
    selects takes everything; else the union of the selecting policies' rules)."""
    labels = dst["metadata"]["labels"]
    selecting = [
        p["spec"]
        for p in policies
        if "Ingress" in p["spec"].get("policyTypes", ["Ingress"])
        and _selects(p["spec"]["podSelector"], labels)
    ]
    if not selecting:
        return True
    containers = dst["spec"]["containers"]
    for spec_ in selecting:
        for rule in spec_.get("ingress") or []:
            peers = rule.get("from") or []
            assert all(set(peer) == {"podSelector"} for peer in peers), peers
            if peers and not any(_selects(peer["podSelector"], src) for peer in peers):
                continue
            for pp in rule.get("ports") or [{}]:
                if pp.get("protocol", "TCP") != "TCP":
                    continue
                if "port" not in pp:
                    return True
                numbers = {
                    _container_port(c, pp["port"])
                    for c in containers
                    if isinstance(pp["port"], int)
                    or any(p.get("name") == pp["port"] for p in c.get("ports", []))
                }
                if any(n <= port <= pp.get("endPort", n) for n in numbers):
                    return True
    return False


def test_every_overlay_is_checked() -> None:
    """A new overlay is either generated (OVERLAYS) or listed here, so the kustomize tests
    below cover it."""
    on_disk = {p.name for p in (K8S / "overlays").iterdir() if p.is_dir()}
    assert on_disk == set(OVERLAYS) | set(HAND_WRITTEN_OVERLAYS)
    assert not set(OVERLAYS) & set(HAND_WRITTEN_OVERLAYS)


@needs_kubectl
@pytest.mark.parametrize("overlay", HAND_WRITTEN_OVERLAYS)
def test_hand_written_overlay_validates_strict_and_is_lint_clean(overlay: str) -> None:
    docs = kustomize(overlay)
    for d in docs:
        validate_strict(d)
    assert [str(f) for f in k8s_lint.lint_all(docs)] == []
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"ballast"}


@needs_kubectl
def test_prep_dask_kustomize_output_wires_the_config_maps() -> None:
    docs = kustomize("prep-dask")
    cms = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    # The base's objects are all there, unchanged names included.
    base = {
        (d["kind"], d["metadata"]["name"])
        for d in kustomize("single-node")
        if d["kind"] not in ("ConfigMap", "Job")
    }
    assert base <= {(d["kind"], d["metadata"]["name"]) for d in docs}
    # Fixed name: pods and work-pool settings outside kustomize refer to it.
    kust = yaml.safe_load((PREP_DASK / "kustomization.yaml").read_text())
    [gen] = [g for g in kust["configMapGenerator"] if g["name"] in cms]
    assert "DASK_SCHEDULER_ADDRESS" in cms[gen["name"]]["data"]
    # The workers' envFrom names (kustomize rewrites the base's hashed ConfigMap name).
    [worker] = [
        d
        for d in docs
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "ballast-dask-worker"
    ]
    refs = [
        e["configMapRef"]["name"] for e in _only_container(worker)["envFrom"] if "configMapRef" in e
    ]
    assert refs and all(r in cms for r in refs)
    assert any("PREFECT_API_URL" in cms[r]["data"] for r in refs)


def test_dask_workers_reach_the_scheduler_through_the_service() -> None:
    objs = _dask_objects()
    [svc] = [o for (kind, _), o in objs.items() if kind == "Service"]
    sched, worker = _dask_deployment("scheduler"), _dask_deployment("worker")
    for dep in (sched, worker):
        assert _selects(dep["spec"]["selector"], dep["spec"]["template"]["metadata"]["labels"])
    # The Service selects the scheduler's pods and no worker's.
    assert _selects(svc["spec"]["selector"], sched["spec"]["template"]["metadata"]["labels"])
    assert not _selects(svc["spec"]["selector"], worker["spec"]["template"]["metadata"]["labels"])
    sc = _only_container(sched)
    sp = _dask_cli_params("scheduler", _argv(sc))
    comm = int(sp["port"])
    dashboard = int(sp["dashboard_address"].rsplit(":", 1)[1])
    # Service port -> the scheduler's port it reaches.
    targets = {p["port"]: _container_port(sc, p["targetPort"]) for p in svc["spec"]["ports"]}
    assert {comm, dashboard} <= set(targets.values())
    # The scheduler declares the ports it listens on; its probes use them.
    declared = {p["name"]: p["containerPort"] for p in sc["ports"]}
    assert {comm, dashboard} <= set(declared.values())
    for probe in ("readinessProbe", "livenessProbe"):
        port = next(v["port"] for k, v in sc[probe].items() if k in ("httpGet", "tcpSocket"))
        assert _container_port(sc, port) in {comm, dashboard}
    # The workers' scheduler address: the Service's name (same namespace) and its port
    # to the scheduler's comm port.
    wp = _dask_cli_params("worker", _argv(_only_container(worker)))
    addr = urlsplit(wp["scheduler"])
    assert addr.scheme == "tcp"
    assert addr.hostname == svc["metadata"]["name"]
    assert addr.port is not None and targets[addr.port] == comm


def test_dask_worker_resources_match_its_flags() -> None:
    from dask.utils import parse_bytes
    from kubernetes.utils.quantity import parse_quantity

    c = _only_container(_dask_deployment("worker"))
    wp = _dask_cli_params("worker", _argv(c))
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    # Dask's memory limit is the container's: the nanny restarts the worker process before
    # the kernel's OOM killer ends the pod.
    assert parse_bytes(wp["memory_limit"]) == int(parse_quantity(limits["memory"]))
    assert requests["memory"] == limits["memory"]
    # No more task threads than CPUs.
    assert 1 <= wp["nthreads"] <= parse_quantity(limits["cpu"])
    # The pod's name (downward API), so a worker is recognisable in the scheduler's lists.
    env = {e["name"]: e for e in c["env"]}
    var = re.fullmatch(r"\$\((\w+)\)", wp["name"])
    assert var is not None
    assert env[var.group(1)]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # Its pinned ports are the ones it declares (and the NetworkPolicy admits).
    declared = {p["containerPort"] for p in c["ports"]}
    assert {int(wp["worker_port"]), int(wp["nanny_port"])} == declared


@pytest.mark.parametrize("component", ["scheduler", "worker"])
def test_dask_pods_write_only_to_their_scratch_volume(component: str) -> None:
    dep = _dask_deployment(component)
    pod = dep["spec"]["template"]["spec"]
    c = _only_container(dep)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    vols = {v["name"]: v for v in pod["volumes"]}
    # Local disk is scratch only: every mount is a size-limited emptyDir.
    scratch = [m["mountPath"] for m in c["volumeMounts"]]
    for m in c["volumeMounts"]:
        assert vols[m["name"]]["emptyDir"]["sizeLimit"]
    writable = [
        e["value"]
        for e in c["env"]
        if e["name"] in ("HOME", "TMPDIR", "DASK_TEMPORARY_DIRECTORY", "PREFECT_HOME")
    ]
    assert {"HOME", "TMPDIR"} <= {e["name"] for e in c["env"]}
    if component == "worker":
        writable.append(_dask_cli_params(component, _argv(c))["local_directory"])
        assert len(writable) == 5
    for path in writable:
        assert any(path == s or path.startswith(s + "/") for s in scratch), path


@pytest.mark.parametrize("component", ["scheduler", "worker"])
def test_dask_pods_security(component: str) -> None:
    dep = _dask_deployment(component)
    pod = dep["spec"]["template"]["spec"]
    opts = KubeOptions()
    c = _only_container(dep)
    # The project image: client, scheduler and workers run the same distributed.
    assert c["image"] == opts.image
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == opts.run_as_user
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # An identity with no API rights: defined with no token, bound to no Role anywhere.
    sa = pod["serviceAccountName"]
    everything = [d for _, d in k8s_yaml_docs()]  # prep-dask's objects among them
    [account] = [
        d for d in everything if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == sa
    ]
    assert account["automountServiceAccountToken"] is False
    assert not any(
        s["name"] == sa
        for d in everything
        if d["kind"] in ("RoleBinding", "ClusterRoleBinding")
        for s in d.get("subjects", [])
    )
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/component"] == component
    assert labels["app.kubernetes.io/part-of"] == "ballast"


def test_dask_network_policy() -> None:
    policies = [d for _, d in k8s_yaml_docs() if d["kind"] == "NetworkPolicy"]
    sched_pod = _dask_deployment("scheduler")["spec"]["template"]
    worker_pod = _dask_deployment("worker")["spec"]["template"]
    sc, wc = (
        _only_container(_dask_deployment("scheduler")),
        _only_container(_dask_deployment("worker")),
    )
    sp = _dask_cli_params("scheduler", _argv(sc))
    wp = _dask_cli_params("worker", _argv(wc))
    scheduler_ports = [int(sp["port"]), int(sp["dashboard_address"].rsplit(":", 1)[1])]
    worker_ports = [int(wp["worker_port"]), int(wp["nanny_port"])]
    workers = worker_pod["metadata"]["labels"]
    scheduler = sched_pod["metadata"]["labels"]
    trainer = _job()["spec"]["template"]["metadata"]["labels"]  # app.kubernetes.io/name=ballast
    prefect_worker = next(
        d
        for _, d in k8s_yaml_docs()
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "prefect-worker"
    )
    stranger = prefect_worker["spec"]["template"]["metadata"]["labels"]
    for port in scheduler_ports:
        # Clients: the prep flow's pod, `ballast prep --dask` in a ballast pod; the workers.
        for src in (workers, FLOW_RUN_LABELS, trainer):
            assert _admits(policies, src, sched_pod, port), (src, port)
        assert not _admits(policies, stranger, sched_pod, port)
    for port in worker_ports:
        for src in (scheduler, workers):
            assert _admits(policies, src, worker_pod, port), (src, port)
        # Clients talk to the scheduler only.
        for src in (FLOW_RUN_LABELS, trainer, stranger):
            assert not _admits(policies, src, worker_pod, port), (src, port)
    # Nothing else of the workers is open (their dashboards' ports are random).
    assert not _admits(policies, workers, worker_pod, 40000)


def test_dask_address_config_map_names_the_service() -> None:
    import dask.config

    kust = yaml.safe_load((PREP_DASK / "kustomization.yaml").read_text())
    [gen] = [g for g in kust["configMapGenerator"] if g["name"] == "ballast-dask"]
    assert gen["options"]["disableNameSuffixHash"] is True
    env = dict(lit.split("=", 1) for lit in gen["literals"])
    # Dask reads DASK_SCHEDULER_ADDRESS as its `scheduler-address`, which Client() uses.
    with dask.config.set(dask.config.collect_env(env)):
        address = dask.config.get("scheduler-address")
    [svc] = [o for (kind, _), o in _dask_objects().items() if kind == "Service"]
    assert svc["metadata"]["namespace"] == kust["namespace"]
    addr = urlsplit(address)
    assert addr.scheme == "tcp"
    assert addr.hostname == f"{svc['metadata']['name']}.{kust['namespace']}.svc.cluster.local"
    sc = _only_container(_dask_deployment("scheduler"))
    comm = int(_dask_cli_params("scheduler", _argv(sc))["port"])
    [port] = [
        p["port"] for p in svc["spec"]["ports"] if _container_port(sc, p["targetPort"]) == comm
    ]
    assert addr.port == port
    assert kust["resources"] == ["../../base", "dask.yaml"]


def test_flow_run_pods_take_the_dask_address_from_the_overlay() -> None:
    """The ballast-k8s work pool's flow-run pods read the ConfigMap that the prep-dask
    overlay makes (optional: without the overlay they start as before), so a prep flow
    run on that pool goes to the cluster with no parameter set."""
    kust = yaml.safe_load((PREP_DASK / "kustomization.yaml").read_text())
    holding = [
        g["name"]
        for g in kust["configMapGenerator"]
        if any(lit.startswith("DASK_SCHEDULER_ADDRESS=") for lit in g["literals"])
    ]
    template = json.loads((K8S / "base" / "work-pool-template.json").read_text())
    pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    refs = [e["configMapRef"] for e in container.get("envFrom", []) if "configMapRef" in e]
    assert [r["name"] for r in refs] == holding
    assert all(r.get("optional") is True for r in refs)


@pytest.mark.parametrize("component", ["scheduler", "worker"])
def test_dask_flags_in_the_manifests_exist(component: str) -> None:
    """Every option the manifests pass is one the installed `dask <component>` lists: an
    option renamed in a newer distributed fails here, not in the cluster."""
    argv = _argv(_only_container(_dask_deployment(component)))
    dask = Path(sys.executable).parent / "dask"
    out = subprocess.run(
        [str(dask) if dask.exists() else "dask", component, "--help"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    known = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out))
    used = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    assert used and used <= known, sorted(used - known)
    _dask_cli_params(component, argv)  # the values parse too


@pytest.mark.parametrize(
    ("section", "line"),
    [
        ({"backnd": "local"}, "launch.backnd: unknown key; did you mean `backend`?"),
        # kubernetes options are a dataclass: pydantic calls it, and says "unexpected
        # keyword argument" for a misspelt key unless the message is made the same.
        (
            {"kubernetes": {"namespce": "x"}},
            "launch.kubernetes.namespce: unknown key; did you mean `namespace`?",
        ),
    ],
)
def test_launch_key_typos_get_a_suggestion(section, line):
    from core.errors import ConfigError
    from infra.launch import parse_launch

    with pytest.raises(ConfigError) as err:
        parse_launch(section, where="train.yaml")
    assert str(err.value).splitlines() == ["invalid launch config train.yaml:", f"  {line}"]
