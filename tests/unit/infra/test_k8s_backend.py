"""The kubernetes backend: `classify` over recorded API objects (tests/fixtures/k8s/*.json, each
naming the real example it follows), the precedence between endings, and the backend itself
through the real `kubernetes` client against a small Kubernetes-speaking HTTP server on
loopback (no cluster can run here)."""

from __future__ import annotations

import copy
import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from infra.jobs import ENDINGS, JobHandle, JobSpec, JobStatus
from infra.k8s_backend import (
    KubernetesBackend,
    KubernetesBackendError,
    _quantities_as_strings,
    classify,
)
from infra.k8s_manifests import KubeOptions, render
from tests.support.kube import COLLECTIONS, FIXTURES, FakeKubeAPI, api_client, load

FIXTURE_FILES = sorted(FIXTURES.glob("*.json"))


def classify_fixture(doc: dict[str, Any]) -> JobStatus:
    return classify(doc["job"], doc["pods"], doc.get("child_jobs", ()))


# ------------------------------------------------------------------------------------------
# The recorded objects


def test_there_are_fixtures_for_every_ending_and_phase() -> None:
    docs = [json.loads(f.read_text()) for f in FIXTURE_FILES]
    endings = {d["expect"]["ending"] for d in docs}
    assert set(ENDINGS) - {"cancelled"} <= endings | {"bad_input"}
    assert {"bad_input", "diverged", "oom", "node_lost", "crashed", "done"} <= endings
    assert {d["expect"]["phase"] for d in docs} == {"pending", "running", "finished"}
    assert {d["job"]["kind"] for d in docs} == {"Job", "JobSet"}


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.stem)
def test_fixture_classifies_as_recorded(path: Path) -> None:
    doc = json.loads(path.read_text())
    got = classify_fixture(doc)
    want = doc["expect"]
    assert (got.phase, got.ending, got.exit_code) == (
        want["phase"],
        want["ending"],
        want["exit_code"],
    ), got.detail
    for text in want.get("detail_contains", []):
        assert text in got.detail


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.stem)
def test_fixture_has_the_shape_of_api_responses(path: Path) -> None:
    doc = json.loads(path.read_text())
    assert len(doc["source"]) > 80  # says which real example it follows
    job = doc["job"]
    assert (job["apiVersion"], job["kind"]) in (
        ("batch/v1", "Job"),
        ("jobset.x-k8s.io/v1alpha2", "JobSet"),
    )
    md = job["metadata"]
    assert re.fullmatch(r"[0-9a-f-]{36}", md["uid"])
    assert md["creationTimestamp"].endswith("Z")
    run, attempt = md["labels"]["ballast.dev/run"], md["labels"]["ballast.dev/attempt"]
    types = [c["type"] for c in job.get("status", {}).get("conditions", [])]
    if "Failed" in types and job["kind"] == "Job":
        assert types.index("FailureTarget") < types.index("Failed")  # as 1.31+ writes them
    for child in doc.get("child_jobs", []):
        assert child["metadata"]["ownerReferences"][0]["kind"] == "JobSet"
    for pod in doc["pods"]:
        assert (pod["apiVersion"], pod["kind"]) == ("v1", "Pod")
        labels = pod["metadata"]["labels"]
        assert labels["ballast.dev/run"] == run and labels["ballast.dev/attempt"] == attempt
        assert (
            labels["batch.kubernetes.io/job-name"] == pod["metadata"]["ownerReferences"][0]["name"]
        )
        assert (
            labels["batch.kubernetes.io/job-completion-index"]
            == pod["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"]
        )
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "Job"
        assert pod["spec"]["containers"][0]["name"] == "trainer"
        assert pod["status"]["phase"] in ("Pending", "Running", "Succeeded", "Failed")
        for cs in pod["status"].get("containerStatuses", []):
            term = cs["state"].get("terminated")
            if term:
                assert {"exitCode", "reason", "startedAt", "finishedAt"} <= set(term)


def test_fixture_specs_are_what_render_makes() -> None:
    """The recorded Job is render()'s Job as the API server stores it: defaults added,
    quantities as strings, nothing of ours changed."""
    job = load("job-running")["job"]
    ours = render(JobSpec("gpt-small", "/etc/ballast/train.yaml", attempt=1), KubeOptions())[0]
    ours = _quantities_as_strings(ours)
    for key in (
        "backoffLimit",
        "completionMode",
        "completions",
        "parallelism",
        "podFailurePolicy",
        "ttlSecondsAfterFinished",
    ):
        assert job["spec"][key] == ours["spec"][key]
    assert (
        job["spec"]["template"]["spec"]["containers"][0]["resources"]
        == ours["spec"]["template"]["spec"]["containers"][0]["resources"]
    )


# ------------------------------------------------------------------------------------------
# Precedence

_ORDER = ("diverged", "bad_input", "oom", "node_lost", "crashed")


def _make_end(pod: dict[str, Any], ending: str) -> None:
    """Rewrite a failed pod's status into one ending."""
    term = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    code, reason = {
        "diverged": (3, "Error"),
        "bad_input": (1, "Error"),
        "oom": (137, "OOMKilled"),
        "node_lost": (137, "Error"),
        "crashed": (2, "Error"),
    }[ending]
    term.update(exitCode=code, reason=reason)
    pod["status"]["conditions"] = [
        c for c in pod["status"]["conditions"] if c["type"] != "DisruptionTarget"
    ]
    if ending == "node_lost":
        pod["status"]["conditions"].append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "lastProbeTime": None,
                "lastTransitionTime": term["finishedAt"],
                "reason": "EvictionByEvictionAPI",
                "message": "Eviction API: evicting",
            }
        )


@pytest.mark.parametrize(
    ("first", "second"),
    [*itertools.combinations(_ORDER, 2), *((b, a) for a, b in itertools.combinations(_ORDER, 2))],
)
def test_gang_precedence(first: str, second: str) -> None:
    """Two ranks fail in the same gang generation; the more informative ending wins whichever
    rank it is on and whichever pod failed last."""
    doc = load("jobset-failed-oom")
    rank0, rank1 = doc["pods"]  # rank 0 terminated last
    _make_end(rank0, first)
    _make_end(rank1, second)
    got = classify_fixture(doc)
    winner = min(first, second, key=_ORDER.index)
    assert got.ending == winner
    loser_pod = rank0 if winner == second else rank1
    assert loser_pod["metadata"]["name"] not in got.detail.split(";")[0]


def test_signals_inside_one_pod_follow_the_same_order() -> None:
    doc = load("job-node-shutdown-backoff-exceeded")
    pod = doc["pods"][0]
    # The trainer had decided it diverged before the node went down: its code is the news.
    pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] = 3
    assert classify_fixture(doc).ending == "diverged"
    pod["status"]["containerStatuses"][0]["state"]["terminated"].update(
        exitCode=137, reason="OOMKilled"
    )
    assert classify_fixture(doc).ending == "oom"


def test_in_a_plain_job_the_newest_failed_pod_decides() -> None:
    doc = load("job-oom-backoff-exceeded")
    newest = doc["pods"][-1]
    newest["status"]["containerStatuses"][0]["state"]["terminated"].update(
        exitCode=139, reason="Error"
    )
    got = classify_fixture(doc)
    assert (got.ending, got.exit_code) == ("crashed", 139)  # not the older OOMs
    assert newest["metadata"]["name"] in got.detail


def test_older_gang_generations_do_not_count() -> None:
    doc = load("jobset-failed-oom")
    ghost = copy.deepcopy(doc["pods"][0])
    ghost["metadata"]["name"] += "-old"
    ghost["metadata"]["labels"]["jobset.sigs.k8s.io/restart-attempt"] = "2"
    _make_end(ghost, "diverged")
    doc["pods"].append(ghost)
    assert classify_fixture(doc).ending == "oom"


def test_the_pod_a_failjob_message_names_decides() -> None:
    doc = load("job-diverged-exit3")
    later = copy.deepcopy(doc["pods"][0])
    later["metadata"]["name"] = "gpt-small-a4-0-zzzzz"
    term = later["status"]["containerStatuses"][0]["state"]["terminated"]
    term.update(exitCode=2, finishedAt="2026-11-18T10:00:00Z")
    doc["pods"].append(later)
    got = classify_fixture(doc)
    assert (got.ending, got.exit_code) == ("diverged", 3)


def test_a_failjob_message_still_decides_when_its_pod_is_gone() -> None:
    doc = load("job-diverged-exit3")
    doc["pods"] = []
    got = classify_fixture(doc)
    assert (got.phase, got.ending, got.exit_code) == ("finished", "diverged", 3)
    assert "no longer listed" in got.detail


def test_a_jobset_lost_node_is_known_from_its_child_job_when_the_pod_is_gone() -> None:
    doc = load("jobset-failed-node-lost")
    doc["pods"] = []
    got = classify_fixture(doc)
    assert (got.ending, got.exit_code) == ("node_lost", None)
    assert "no longer listed" in got.detail


def test_a_failed_job_without_any_evidence_is_a_crash_of_unknown_cause() -> None:
    doc = load("jobset-failed-node-lost")
    got = classify(doc["job"], [], [])
    assert (got.phase, got.ending, got.exit_code) == ("finished", "crashed", None)
    assert "unknown" in got.detail


def test_failure_target_alone_is_not_finished_yet() -> None:
    """The job controller has decided but pods still terminate (and hold the GPUs)."""
    doc = load("job-diverged-exit3")
    doc["job"]["status"]["conditions"] = doc["job"]["status"]["conditions"][:1]
    got = classify_fixture(doc)
    assert (got.phase, got.ending) == ("running", None)
    assert "FailureTarget" in got.detail


def test_deadline_exceeded_is_a_crash() -> None:
    doc = load("job-running")
    at = "2026-11-18T12:00:00Z"
    doc["job"]["status"]["conditions"] = [
        {
            "type": t,
            "status": "True",
            "lastProbeTime": at,
            "lastTransitionTime": at,
            "reason": "DeadlineExceeded",
            "message": "Job was active longer than specified deadline",
        }
        for t in ("FailureTarget", "Failed")
    ]
    got = classify_fixture(doc)
    assert (got.phase, got.ending, got.exit_code) == ("finished", "crashed", None)
    assert "DeadlineExceeded" in got.detail


def test_suspended_and_podless_jobs_are_pending() -> None:
    doc = load("job-running")
    doc["job"]["status"] = {
        "conditions": [
            {
                "type": "Suspended",
                "status": "True",
                "lastProbeTime": None,
                "lastTransitionTime": "2026-11-18T09:00:00Z",
                "reason": "JobSuspended",
                "message": "Job suspended",
            }
        ]
    }
    got = classify(doc["job"], [])
    assert got.phase == "pending" and "suspended" in got.detail
    assert "no pod created yet" in classify(load("job-running")["job"], []).detail


def test_a_gang_with_one_rank_still_waiting_is_pending() -> None:
    doc = load("jobset-running-after-restart")
    waiting = doc["pods"][1]
    waiting["status"]["phase"] = "Pending"
    waiting["status"]["containerStatuses"][0]["state"] = {
        "waiting": {
            "reason": "ImagePullBackOff",
            "message": 'Back-off pulling image "ghcr.io/ballast-lm/ballast:0.1.0"',
        }
    }
    got = classify_fixture(doc)
    assert got.phase == "pending"
    assert "ImagePullBackOff" in got.detail


def test_running_detail_counts_failures_so_far() -> None:
    doc = load("job-drain-ignored-running")
    doc["job"]["status"]["failed"] = 2
    extra = copy.deepcopy(doc["pods"][0])
    extra["metadata"]["name"] = "gpt-small-a1-0-older"
    doc["pods"].insert(0, extra)
    got = classify_fixture(doc)
    assert got.phase == "running"
    assert "2 pods failed so far (2 counted toward backoffLimit)" in got.detail


# ------------------------------------------------------------------------------------------
# The backend's client on the loopback API (tests/support/kube.py)


@pytest.fixture
def backend(kube: FakeKubeAPI) -> Iterator[KubernetesBackend]:
    api = api_client(kube.host)
    try:
        yield KubernetesBackend(KubeOptions(), api, backoff_s=0.0)
    finally:
        api.close()


# ------------------------------------------------------------------------------------------
# The backend over HTTP


def test_submit_posts_what_render_makes(kube: FakeKubeAPI, backend: KubernetesBackend) -> None:
    spec = JobSpec("gpt-small", "/etc/ballast/train.yaml", attempt=2)
    handle = backend.submit(spec)
    assert handle == JobHandle(
        "kubernetes", "gpt-small-a2", "ballast", {"kind": "Job", "run": "gpt-small", "attempt": 2}
    )
    (post,) = kube.made("POST")
    assert post.path == "/apis/batch/v1/namespaces/ballast/jobs"
    rendered = render(spec, KubeOptions())[0]
    # Exactly render()'s Job; numeric quantities go as strings, which the client requires.
    assert post.body == _quantities_as_strings(rendered)
    limits = post.body["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "8"


def test_submit_a_gang_creates_a_jobset(kube: FakeKubeAPI, backend: KubernetesBackend) -> None:
    spec = JobSpec("gpt-large", "/etc/ballast/train.yaml", attempt=0, nnodes=2, nproc_per_node=8)
    handle = backend.submit(spec)
    assert handle.data == {"kind": "JobSet", "run": "gpt-large", "attempt": 0}
    (post,) = kube.made("POST")
    assert post.path == "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ballast/jobsets"
    assert post.body == _quantities_as_strings(render(spec, KubeOptions())[0])


def test_resubmitting_an_attempt_adopts_it(kube: FakeKubeAPI, backend: KubernetesBackend) -> None:
    spec = JobSpec("gpt-small", "/etc/ballast/train.yaml", attempt=1)
    first = backend.submit(spec)
    again = backend.submit(spec)  # a restarted supervisor submitting the same attempt
    assert again == first
    assert [r.method for r in kube.requests] == ["POST", "POST", "GET"]
    assert len([k for k in kube.objects if k[0] == "jobs"]) == 1


def test_a_foreign_object_with_our_name_is_not_adopted(
    kube: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    kube.put(
        "jobs",
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {
                "name": "gpt-small-a0",
                "namespace": "ballast",
                "labels": {"ballast.dev/run": "someone-else", "ballast.dev/attempt": "0"},
            },
        },
    )
    with pytest.raises(KubernetesBackendError, match="already exists but is not attempt 0"):
        backend.submit(JobSpec("gpt-small", "/etc/ballast/train.yaml"))


def test_a_body_the_client_rejects_is_a_clear_error(
    kube: FakeKubeAPI, backend: KubernetesBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "gpt-small-a0"},
        "spec": {"backoffLimit": "three", "template": {"spec": {"containers": []}}},
    }
    monkeypatch.setattr("infra.k8s_manifests.render", lambda spec, opts: [bad])
    with pytest.raises(KubernetesBackendError, match="does not fit the Kubernetes API schema"):
        backend.submit(JobSpec("gpt-small", "/etc/ballast/train.yaml"))
    assert kube.requests == []  # refused before anything was sent


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.stem)
def test_status_reads_the_job_and_its_pods(
    path: Path, kube: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    doc = json.loads(path.read_text())
    handle = kube.load_fixture(doc)
    got = backend.status(handle)
    assert got == classify_fixture(doc)
    assert (got.phase, got.ending, got.exit_code) == (
        doc["expect"]["phase"],
        doc["expect"]["ending"],
        doc["expect"]["exit_code"],
    )
    (pods,) = kube.made("GET", "/pods")
    selector = f"ballast.dev/run={handle.data['run']},ballast.dev/attempt={handle.data['attempt']}"
    assert pods.query["labelSelector"] == [selector]
    resource = "jobsets" if handle.data["kind"] == "JobSet" else "jobs"
    assert kube.requests[0].path == f"{_path(resource)}/{handle.name}"


def _path(resource: str) -> str:
    return COLLECTIONS[resource][0].replace("(?P<ns>[^/]+)", "ballast").replace("\\", "")


def test_status_of_a_deleted_job(backend: KubernetesBackend) -> None:
    got = backend.status(
        JobHandle(
            "kubernetes",
            "gpt-small-a7",
            "ballast",
            {"kind": "Job", "run": "gpt-small", "attempt": 7},
        )
    )
    assert (got.phase, got.ending, got.exit_code) == ("finished", "crashed", None)
    assert "job deleted" in got.detail


def test_logs_of_the_newest_started_pod(kube: FakeKubeAPI, backend: KubernetesBackend) -> None:
    doc = load("job-drain-ignored-running")
    handle = kube.load_fixture(doc)
    old, new = (p["metadata"]["name"] for p in doc["pods"])
    kube.logs[old] = "step 1\nstep 2\nevicted\n"
    kube.logs[new] = "".join(f"step {i}\n" for i in range(100, 110))
    assert backend.logs(handle, tail=3) == "step 107\nstep 108\nstep 109\n"
    (req,) = kube.made("GET", "/log")
    assert req.path.endswith(f"/pods/{new}/log")
    assert req.query["container"] == ["trainer"] and req.query["tailLines"] == ["3"]


def test_logs_of_a_gang_come_from_rank_0(kube: FakeKubeAPI, backend: KubernetesBackend) -> None:
    doc = load("jobset-running-after-restart")
    handle = kube.load_fixture(doc)
    for pod in doc["pods"]:
        idx = pod["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"]
        kube.logs[pod["metadata"]["name"]] = f"rank {idx}\n"
    assert backend.logs(handle) == "rank 0\n"


def test_no_logs_before_the_trainer_starts(kube: FakeKubeAPI, backend: KubernetesBackend) -> None:
    assert (
        backend.logs(
            JobHandle(
                "kubernetes",
                "gpt-small-a0",
                "ballast",
                {"kind": "Job", "run": "gpt-small", "attempt": 0},
            )
        )
        == ""
    )
    handle = kube.load_fixture(load("job-pending-container-creating"))
    assert backend.logs(handle) == ""
    assert kube.made("GET", "/log") == []  # not even asked


def test_cancel_deletes_in_the_foreground(kube: FakeKubeAPI, backend: KubernetesBackend) -> None:
    handle = kube.load_fixture(load("job-running"))
    backend.cancel(handle)
    (req,) = kube.made("DELETE")
    assert req.path == f"{_path('jobs')}/{handle.name}"
    assert "Foreground" in json.dumps(req.query) + json.dumps(req.body)
    backend.cancel(handle)  # already gone: fine
    js = kube.load_fixture(load("jobset-running-after-restart"))
    backend.cancel(js)
    assert kube.made("DELETE")[-1].path == f"{_path('jobsets')}/{js.name}"


def test_forbidden_names_the_verb_resource_and_rbac(
    kube: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    kube.fail(
        "POST",
        "/jobs$",
        403,
        message='jobs.batch is forbidden: User "system:'
        'serviceaccount:ballast:default" cannot create resource "jobs" in API group '
        '"batch" in the namespace "ballast"',
    )
    with pytest.raises(KubernetesBackendError) as err:
        backend.submit(JobSpec("gpt-small", "/etc/ballast/train.yaml"))
    text = str(err.value)
    for part in (
        "create jobs",
        "namespace ballast",
        "403",
        "RBAC",
        "Role",
        'cannot create resource "jobs"',
    ):
        assert part in text
    assert len(kube.made("POST")) == 1  # not retried


def test_unauthorized_points_at_the_credentials(
    kube: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    kube.fail("GET", "/pods$", 401)
    handle = kube.load_fixture(load("job-running"))
    with pytest.raises(KubernetesBackendError, match=r"rejected our credentials.*list pods"):
        backend.status(handle)


def test_transient_errors_are_retried(kube: FakeKubeAPI, backend: KubernetesBackend) -> None:
    handle = kube.load_fixture(load("job-running"))
    kube.fail("GET", "/jobs/", 503, times=2)
    kube.fail("GET", "/pods$", 429, headers={"Retry-After": "0"})
    assert backend.status(handle).phase == "running"
    assert len(kube.made("GET", "/jobs/")) == 3 and len(kube.made("GET", "/pods")) == 2


def test_a_server_that_stays_down_is_an_error(
    kube: FakeKubeAPI, backend: KubernetesBackend
) -> None:
    kube.fail("POST", "/jobs$", 500, times=99, message="etcdserver: request timed out")
    with pytest.raises(KubernetesBackendError, match=r"answered 500 to create jobs.*etcdserver"):
        backend.submit(JobSpec("gpt-small", "/etc/ballast/train.yaml"))
    assert len(kube.made("POST")) == backend.retries + 1


def test_a_missing_jobset_crd_is_explained(kube: FakeKubeAPI, backend: KubernetesBackend) -> None:
    kube.fail("POST", "/jobsets$", 404, message="the server could not find the requested resource")
    with pytest.raises(KubernetesBackendError, match="JobSet controller and its CRD"):
        backend.submit(JobSpec("gpt-large", "/etc/ballast/train.yaml", nnodes=2, nproc_per_node=8))


def test_an_unreachable_server_is_named() -> None:
    dead = FakeKubeAPI()
    host = dead.host
    dead.close()  # nothing listens there any more
    api = api_client(host)
    try:
        b = KubernetesBackend(KubeOptions(), api, retries=1, backoff_s=0.0)
        with pytest.raises(KubernetesBackendError, match=re.escape(host)):
            b.status(
                JobHandle(
                    "kubernetes", "x-a0", "ballast", {"kind": "Job", "run": "x", "attempt": 0}
                )
            )
    finally:
        api.close()


def test_configuration_comes_from_the_kubeconfig(
    kube: FakeKubeAPI, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(KubernetesBackendError, match="no Kubernetes configuration found"):
        KubernetesBackend(KubeOptions())

    cfg = tmp_path / "config"
    cfg.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "test",
                "clusters": [{"name": "fake", "cluster": {"server": kube.host}}],
                "users": [{"name": "me", "user": {"token": "not-a-real-token"}}],
                "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "me"}}],
            }
        )
    )
    monkeypatch.setenv("KUBECONFIG", str(cfg))
    b = KubernetesBackend(KubeOptions())
    try:
        handle = kube.load_fixture(load("job-complete"))
        assert b.status(handle).ending == "done"
    finally:
        b.api.close()
