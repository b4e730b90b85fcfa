"""The supervisor driving the real KubernetesBackend (the real `kubernetes` client over
HTTP) against a loopback API that answers with recorded Job and pod objects: each attempt
the supervisor creates is "played" by one recorded ending, so the restart decisions run on
the objects a cluster would return. (No cluster can run here; tests/e2e/test_supervisor.py
runs the same supervisor for real with the local backend.)"""

from __future__ import annotations

import json
from typing import Any

from infra.jobs import JobHandle, JobSpec
from infra.k8s_backend import KubernetesBackend
from infra.k8s_manifests import KubeOptions
from infra.supervisor import RestartPolicy, supervise
from tests.support.kube import FakeKubeAPI, api_client, load

POLICY = RestartPolicy(max_restarts=3, max_node_losses=2, max_recoveries=1, poll_s=0, backoff_s=0)


def retarget(doc: dict[str, Any], handle: JobHandle) -> dict[str, Any]:
    """A recorded fixture renamed to the attempt the supervisor just submitted."""
    old_name = doc["job"]["metadata"]["name"]
    old_attempt = doc["job"]["metadata"]["labels"]["ballast.dev/attempt"]
    text = json.dumps(doc).replace(old_name, handle.name)
    text = text.replace(
        f'"ballast.dev/attempt": "{old_attempt}"',
        f'"ballast.dev/attempt": "{handle.data["attempt"]}"',
    )
    text = text.replace(
        '"ballast.dev/run": "gpt-small"', f'"ballast.dev/run": "{handle.data["run"]}"'
    )
    return json.loads(text)


class Scripted(KubernetesBackend):
    """After each submit (a real POST to the API), the API's objects become the next
    recorded fixture, with the trainer's log lines for that pod."""

    def __init__(self, kube: FakeKubeAPI, script: list[tuple[str, str]], **kw: Any) -> None:
        super().__init__(KubeOptions(), api_client(kube.host), backoff_s=0.0, **kw)
        self.kube, self.script = kube, list(script)

    def submit(self, spec: JobSpec) -> JobHandle:
        handle = super().submit(spec)
        fixture, log = self.script.pop(0)
        doc = retarget(load(fixture), handle)
        self.kube.load_fixture(doc)
        for pod in doc["pods"]:
            self.kube.logs[pod["metadata"]["name"]] = log
        return handle


def test_node_loss_divergence_oom_then_done(kube: FakeKubeAPI) -> None:
    ev = "BALLAST_EVENT "
    script = [
        (
            "job-node-shutdown-backoff-exceeded",
            ev + '{"event": "start", "step": 0}\n' + ev + '{"event": "checkpoint", "step": 500}\n',
        ),
        (
            "job-diverged-exit3",
            ev + '{"event": "resume", "step": 500, "checkpoint": '
            '"step-00000500"}\n' + ev + '{"event": "diverged", "step": 812,'
            ' "start_step": 791, "rollback_to": 790, "samples_seen": 390000}\n',
        ),
        (
            "job-oom-backoff-exceeded",
            ev + '{"event": "resume", "step": 800, "checkpoint": '
            '"step-00000800"}\n' + ev + '{"event": "recovered", '
            '"step": 800, "to_step": 750, "lr_scale": 0.5}\n',
        ),
        (
            "job-complete",
            ev + '{"event": "resume", "step": 750, "checkpoint": '
            '"step-00000750"}\n' + ev + '{"event": "done", "step": 2000}\n',
        ),
    ]
    backend = Scripted(kube, script)
    out = supervise(
        backend, JobSpec("gpt-small", "/etc/ballast/train.yaml"), POLICY, log=lambda _: None
    )
    assert out.ok, out.message
    rows = [a.row() for a in out.attempts]
    assert [r["ending"] for r in rows] == ["node_lost", "diverged", "oom", "done"]
    assert [r["exit code"] for r in rows] == [137, 3, 137, 0]
    assert [r["resumed from"] for r in rows] == [
        "fresh",
        "step-00000500",
        "step-00000800",
        "step-00000750",
    ]
    assert rows[-1]["step reached"] == 2000
    # The restart after the divergence carries the rollback settings, from the trainer's
    # own event: back before step 791, past sample 390000, half the LR.
    assert out.attempts[2].args == [
        "--recover",
        "--lr-scale=0.5",
        "--rollback-to=790",
        "--skip-to-sample=390000",
    ]
    # Every attempt was a new Job with its own name, created through the API.
    posted = [r.body["metadata"]["name"] for r in kube.made("POST", "/jobs")]
    assert posted == [f"gpt-small-a{i}" for i in range(4)]


def test_bad_input_stops_and_budgets_hold(kube: FakeKubeAPI) -> None:
    out = supervise(
        Scripted(kube, [("job-bad-input-exit1", "")]),
        JobSpec("gpt-small", "/etc/ballast/train.yaml"),
        POLICY,
        log=lambda _: None,
    )
    assert (out.ok, out.ending, len(out.attempts)) == (False, "bad_input", 1)

    kube2 = FakeKubeAPI()
    try:
        script = [("job-node-shutdown-backoff-exceeded", "")] * 3
        out = supervise(
            Scripted(kube2, script), JobSpec("gpt-small", "/x.yaml"), POLICY, log=lambda _: None
        )
    finally:
        kube2.close()
    # max_node_losses=2: the third loss ends the run.
    assert (out.ok, out.ending, len(out.attempts)) == (False, "node_lost", 3)


def test_an_attempt_that_never_starts_is_given_up(kube: FakeKubeAPI) -> None:
    policy = RestartPolicy(max_restarts=0, poll_s=0.01, pending_timeout_s=0.05)
    out = supervise(
        Scripted(kube, [("job-pending-unschedulable", "")]),
        JobSpec("gpt-small", "/x.yaml"),
        policy,
        log=lambda _: None,
    )
    assert (out.ok, out.ending) == (False, "crashed")
    assert "never started" in out.attempts[0].detail
    assert "Insufficient nvidia.com/gpu" in out.attempts[0].detail
    assert kube.made("DELETE", "/jobs/gpt-small-a0")  # cancelled, not left holding a slot
