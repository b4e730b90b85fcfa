"""How a training attempt on Kubernetes ended, from its raw API objects.

`classify` is the heart of it: a pure function from the raw API objects (the Job or JobSet and
the attempt's pods, as the API server returns them in JSON) to a JobStatus. It is kept apart from
the HTTP side so recorded objects (tests/fixtures/k8s/) can exercise every ending.

How an ending is decided
------------------------
* Only a terminal condition finishes an attempt: Job `Complete`/`Failed`, JobSet
  `Completed`/`Failed`. `FailureTarget`/`SuccessCriteriaMet` alone mean the controller is
  still terminating pods: the attempt is reported running, with the verdict in `detail`, so the
  supervisor never starts the next attempt while the old pods hold the GPUs.
* A Job failed by its podFailurePolicy names the pod and the exit code (or the
  DisruptionTarget condition) in its message; that pod decides, even when it is no longer
  listed (evicted and PodGC'd pods are deleted). A JobSet's own message names only the first
  failed child Job, so its child Jobs' messages are read instead. Otherwise the deciding pods
  are the failures of the newest gang generation (the JobSet `restart-attempt` label; a plain
  Job has one), keeping the newest failed pod of each rank (child Job + completion index). In
  a plain one-pod Job that is simply the newest failed pod: the one whose failure ended it.
* Among those pods, and among the signals inside one pod, the most informative wins:

      diverged (exit 3) > bad_input (exit 1) > oom > node_lost > crashed

  Why this order: in a gang one root cause brings the other ranks down, and the ranks that
  merely lost a peer always look like crashes (NCCL/rendezvous errors carry no trainer code, so
  training.entrypoint reports 2; a lost node's peers die the same way). Exit 3 and 1 are codes
  the trainer chose deliberately (all ranks agree on divergence; config/data errors happen at
  start-up), so they are the most specific. An OOM comes next: it will happen again on any node,
  so it must not hide behind a node loss that happened at the same time. A node loss beats a
  crash because the crash is usually its consequence. Ties go to the pod that failed first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from infra.jobs import Ending, JobStatus, ending_from_exit_code

TRAINER_CONTAINER = "trainer"  # the container podFailurePolicy rules and logs() look at

JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"

# Labels the Job and JobSet controllers put on pods.
_JOB_NAME = "batch.kubernetes.io/job-name"
_COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
_JS_RESTART = "jobset.sigs.k8s.io/restart-attempt"
_JS_GLOBAL_INDEX = "jobset.sigs.k8s.io/job-global-index"
_JS_JOB_INDEX = "jobset.sigs.k8s.io/job-index"

# status.reason values the kubelet writes when the node, not the workload, ended the pod:
# node-pressure eviction, graceful node shutdown (Terminated), admission refused during
# shutdown (NodeShutdown), and the legacy node-controller NodeLost.
_NODE_LOSS_POD_REASONS = frozenset(
    {"Evicted", "Terminated", "NodeShutdown", "Shutdown", "NodeLost"}
)

# Most informative first (see the module docstring).
_RANK: dict[str, int] = {"diverged": 0, "bad_input": 1, "oom": 2, "node_lost": 3, "crashed": 4}

_PFP_EXIT = re.compile(
    r"for pod (?P<ns>[^/\s]+)/(?P<pod>\S+) failed with exit code "
    r"(?P<code>-?\d+)"
)
_PFP_CONDITION = re.compile(r"Pod (?P<ns>[^/\s]+)/(?P<pod>\S+) has condition (?P<cond>\w+)")


# ------------------------------------------------------------------------------------------
# classify: raw API objects -> JobStatus


@dataclass(frozen=True)
class _PodEnd:
    """How one pod ended, as far as its status (or a Job's failure message) tells."""

    pod: Mapping[str, Any] | None  # None: known only from a Job's message
    ending: Ending
    exit_code: int | None
    why: str
    at: datetime | None  # when it failed (container finish, else the disruption)
    ref: str = ""  # ns/name when `pod` is None

    def describe(self) -> str:
        if self.pod is None:
            return f"pod {self.ref} (no longer listed): {self.why}"
        return f"pod {_pod_ref(self.pod)} on node {_node(self.pod)}: {self.why}"


def classify(
    job: Mapping[str, Any],
    pods: Iterable[Mapping[str, Any]],
    child_jobs: Iterable[Mapping[str, Any]] = (),
) -> JobStatus:
    """The state of one attempt from its Job or JobSet and all of its pods (every restart,
    failed ones included), as plain dicts in the API's JSON shape. For a JobSet, `child_jobs`
    (the batch/v1 Jobs it made) sharpen the verdict when the deciding pod is gone."""
    pods = list(pods)
    is_jobset = job.get("kind") == "JobSet" or str(job.get("apiVersion", "")).startswith(
        JOBSET_GROUP
    )
    conds = _true_conditions(job)
    status = job.get("status") or {}
    restarts = int(status.get("restarts") or 0) if is_jobset else 0

    done_type, failed_type = ("Completed", "Failed") if is_jobset else ("Complete", "Failed")
    if done_type in conds:
        return _finished_done(conds[done_type], pods)
    if failed_type in conds:
        verdict_from = list(child_jobs) if is_jobset else [job]
        return _finished_failed(conds[failed_type], pods, verdict_from, is_jobset, restarts)
    return _in_progress(job, conds, pods, is_jobset, restarts)


def _finished_done(cond: Mapping[str, Any], pods: list[Mapping[str, Any]]) -> JobStatus:
    succeeded = [p for p in pods if _phase(p) == "Succeeded"]
    code = 0
    for p in succeeded:
        term = _trainer_terminated(p)
        if term is not None and term.get("exitCode") is not None:
            code = int(term["exitCode"])
            break
    n = len(succeeded)
    detail = f"completed ({_cond_text(cond)}): {n} pod{'s' if n != 1 else ''} succeeded"
    if succeeded:
        names = ", ".join(f"{_pod_ref(p)} on {_node(p)}" for p in succeeded[:4])
        detail += f" ({names})"
    return JobStatus("finished", "done", code, detail)


def _finished_failed(
    cond: Mapping[str, Any],
    pods: list[Mapping[str, Any]],
    verdict_from: list[Mapping[str, Any]],
    is_jobset: bool,
    restarts: int,
) -> JobStatus:
    reason = str(cond.get("reason") or "")
    message = str(cond.get("message") or "")
    owner = f"JobSet failed after {restarts} gang restarts" if is_jobset else "Job failed"
    failure = f"{owner}: {reason}: {message}" if message else f"{owner}: {reason}"
    ends = [e for e in (_pod_end(p) for p in pods) if e is not None]
    seen = f"{len(ends)} failed pods listed" if len(ends) != 1 else "1 failed pod listed"

    if reason == "DeadlineExceeded":
        # The deadline, not any pod, ended the attempt; killed pods say nothing about why.
        return JobStatus("finished", "crashed", None, f"{failure} ({seen})")

    named = _policy_verdicts(verdict_from, pods)
    # A Job's own verdict on its pods stands; in a gang, the child Jobs' verdicts are weighed
    # against what the pods of the other ranks show.
    decider = named[0] if named and not is_jobset else _decide(ends, extra=named)
    if decider is None:
        return JobStatus(
            "finished",
            "crashed",
            None,
            f"{failure}; no failed pod is listed any more (deleted?), so the cause is unknown",
        )
    return JobStatus(
        "finished",
        decider.ending,
        decider.exit_code,
        f"{decider.ending}: {decider.describe()}; {failure} ({seen})",
    )


def _in_progress(
    job: Mapping[str, Any],
    conds: Mapping[str, Mapping[str, Any]],
    pods: list[Mapping[str, Any]],
    is_jobset: bool,
    restarts: int,
) -> JobStatus:
    notes: list[str] = []
    if "Suspended" in conds:
        notes.append(f"suspended ({_cond_text(conds['Suspended'])})")
    for c in ("FailureTarget", "SuccessCriteriaMet"):
        if c in conds:
            # The verdict is in, the pods are still terminating.
            notes.append(f"finishing: {c} {_cond_text(conds[c])}; waiting for pods to terminate")
    if is_jobset and restarts:
        notes.append(f"gang restarts: {restarts}")

    active = [
        p for p in pods if _phase(p) in ("Pending", "Running", "Unknown") and not _disrupted(p)
    ]
    running = [p for p in active if _phase(p) == "Running"]
    waiting = [p for p in active if _phase(p) != "Running"]
    for p in running:
        notes.append(f"pod {_pod_ref(p)} running on node {_node(p)}")
    for p in waiting:
        notes.append(f"pod {_pod_ref(p)} pending: {_pending_reason(p)}")

    ends = sorted(
        (e for e in (_pod_end(p) for p in pods) if e is not None), key=lambda e: _ts_key(e.at)
    )
    if ends:
        count = "1 pod failed so far" if len(ends) == 1 else f"{len(ends)} pods failed so far"
        counted = (job.get("status") or {}).get("failed")
        if not is_jobset and counted is not None:
            count += f" ({counted} counted toward backoffLimit)"
        notes.append(f"{count}; last: {ends[-1].ending}: {ends[-1].describe()}")

    # A gang trains only when every rank runs, so any rank still waiting keeps it pending.
    phase: Literal["pending", "running"] = "running" if running and not waiting else "pending"
    if "FailureTarget" in conds or "SuccessCriteriaMet" in conds:
        phase = "running"
    if not pods:
        notes.append("no pod created yet")
    return JobStatus(phase, None, None, "; ".join(notes))


def _policy_verdicts(jobs: list[Mapping[str, Any]], pods: list[Mapping[str, Any]]) -> list[_PodEnd]:
    """The pods that failed Jobs by a podFailurePolicy FailJob rule, as the Jobs' messages
    name them; for JobSet child Jobs only those of the newest gang generation."""
    failed = [
        (j, c)
        for j in jobs
        if (c := _true_conditions(j).get("Failed") or _true_conditions(j).get("FailureTarget"))
        is not None
        and c.get("reason") == "PodFailurePolicy"
    ]
    if not failed:
        return []
    newest = max(_generation(j) for j, _ in failed)
    by_name = {(p.get("metadata") or {}).get("name"): p for p in pods}
    out: list[_PodEnd] = []
    for j, c in failed:
        if _generation(j) != newest:
            continue
        message = str(c.get("message") or "")
        at = _parse_ts(c.get("lastTransitionTime"))
        m_exit, m_cond = _PFP_EXIT.search(message), _PFP_CONDITION.search(message)
        m = m_exit or m_cond
        if m is None:
            continue
        pod = by_name.get(m["pod"])
        seen = _pod_end(pod) if pod is not None else None
        if seen is not None:
            out.append(seen)
        elif m_exit is not None:
            code = int(m_exit["code"])
            out.append(
                _PodEnd(
                    None,
                    ending_from_exit_code(code),
                    code,
                    f"trainer exit {code}",
                    at,
                    f"{m['ns']}/{m['pod']}",
                )
            )
        elif m_cond is not None and m_cond["cond"] == "DisruptionTarget":
            out.append(
                _PodEnd(
                    None,
                    "node_lost",
                    None,
                    "node lost: DisruptionTarget",
                    at,
                    f"{m['ns']}/{m['pod']}",
                )
            )
    return sorted(out, key=lambda e: (_RANK[e.ending], _ts_key(e.at)))


def _decide(ends: list[_PodEnd], extra: Iterable[_PodEnd] = ()) -> _PodEnd | None:
    """The pod whose failure decides the attempt: newest gang generation, newest failure of
    each rank, then the most informative ending, the first to fail on a tie. `extra` are
    verdicts from Job messages, already of the newest generation."""
    candidates = list(extra)
    listed = [e for e in ends if e.pod is not None]
    if listed:
        newest_gen = max(_generation(e.pod) for e in listed if e.pod is not None)
        latest_per_rank: dict[tuple[str, str], _PodEnd] = {}
        for e in listed:
            assert e.pod is not None
            if _generation(e.pod) != newest_gen:
                continue
            key = _rank_key(e.pod)
            cur = latest_per_rank.get(key)
            if cur is None or _ts_key(e.at) > _ts_key(cur.at):
                latest_per_rank[key] = e
        candidates += latest_per_rank.values()
    if not candidates:
        return None
    return min(candidates, key=lambda e: (_RANK[e.ending], _ts_key(e.at)))


def _pod_end(pod: Mapping[str, Any]) -> _PodEnd | None:
    """How a pod failed, or None when it has not. A pod counts as failed when its phase is
    Failed, or when it carries a DisruptionTarget condition: a pod on an unreachable node stays
    'Running' (terminating) forever, since no kubelet is left to say otherwise."""
    phase = _phase(pod)
    disruption = _disruption(pod)
    if phase != "Failed" and not (disruption and phase != "Succeeded"):
        return None
    term = _trainer_terminated(pod)
    code = _int_or_none(term.get("exitCode")) if term else None
    at = _parse_ts(term.get("finishedAt")) if term else None

    signals: list[tuple[Ending, int | None, str]] = []
    if code == 3:
        signals.append(("diverged", 3, "trainer exit 3 (diverged beyond the rollback budget)"))
    elif code == 1:
        signals.append(("bad_input", 1, "trainer exit 1 (bad config or data)"))
    oom = _oom_container(pod)
    if oom is not None:
        name, oom_code = oom
        signals.append(("oom", oom_code, f"container {name} OOMKilled (exit {oom_code})"))
    if disruption:
        where, since = disruption
        signals.append(
            (
                "node_lost",
                code,
                f"node lost: {where}" + (f" (trainer exit {code})" if code is not None else ""),
            )
        )
        at = at or since
    if code is not None and code not in (1, 3):
        reason = term.get("reason") if term else None
        signals.append(("crashed", code, f"trainer exit {code}" + (f" {reason}" if reason else "")))
    if not signals:
        status = pod.get("status") or {}
        why = ": ".join(str(s) for s in (status.get("reason"), status.get("message")) if s)
        signals.append(
            (
                "crashed",
                code,
                f"pod failed without a trainer exit code ({why or 'no reason given'})",
            )
        )
    ending, exit_code, why = min(signals, key=lambda s: _RANK[s[0]])
    if at is None:
        at = (
            _parse_ts((pod.get("metadata") or {}).get("deletionTimestamp"))
            or _parse_ts((pod.get("status") or {}).get("startTime"))
            or _parse_ts((pod.get("metadata") or {}).get("creationTimestamp"))
        )
    return _PodEnd(pod, ending, exit_code, why, at)


def _disruption(pod: Mapping[str, Any]) -> tuple[str, datetime | None] | None:
    """Evidence that the node went away or pushed the pod out, with its time."""
    status = pod.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True":
            text = f"DisruptionTarget {c.get('reason', '')}: {c.get('message', '')}".rstrip(": ")
            if status.get("reason") in _NODE_LOSS_POD_REASONS:
                text = f"{status['reason']}, {text}"
            return text.strip(), _parse_ts(c.get("lastTransitionTime"))
    if status.get("reason") in _NODE_LOSS_POD_REASONS:
        return f"{status['reason']}: {status.get('message', '')}".strip().rstrip(":"), None
    return None


def _disrupted(pod: Mapping[str, Any]) -> bool:
    return _disruption(pod) is not None


def _oom_container(pod: Mapping[str, Any]) -> tuple[str, int] | None:
    status = pod.get("status") or {}
    for cs in (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or []):
        for state in ("state", "lastState"):
            term = (cs.get(state) or {}).get("terminated") or {}
            if term.get("reason") == "OOMKilled":
                return str(cs.get("name")), int(term.get("exitCode", 137))
    return None


def _trainer_status(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    for cs in statuses:
        if cs.get("name") == TRAINER_CONTAINER:
            return cs
    return statuses[0] if statuses else None


def _trainer_terminated(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    cs = _trainer_status(pod)
    if cs is None:
        return None
    # restartPolicy Never: `state` holds the one run; `lastState` only matters under OnFailure.
    return (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get(
        "terminated"
    )


def _pending_reason(pod: Mapping[str, Any]) -> str:
    status = pod.get("status") or {}
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            return f"{c.get('reason', 'not scheduled')}: {c.get('message', '')}".rstrip(": ")
    for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting:
            text = f"container {cs.get('name')} waiting: {waiting.get('reason', '')}"
            return f"{text}: {waiting['message']}" if waiting.get("message") else text
    return status.get("reason") or f"phase {_phase(pod)}"


def _true_conditions(obj: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {
        str(c.get("type")): c
        for c in (obj.get("status") or {}).get("conditions") or []
        if c.get("status") == "True"
    }


def _cond_text(c: Mapping[str, Any]) -> str:
    return ": ".join(str(x) for x in (c.get("reason"), c.get("message")) if x)


def _phase(pod: Mapping[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


def _labels(pod: Mapping[str, Any]) -> Mapping[str, str]:
    return (pod.get("metadata") or {}).get("labels") or {}


def _generation(obj: Mapping[str, Any]) -> int:
    """The JobSet gang restart a pod or child Job belongs to (0 outside a JobSet)."""
    return _int_or_none(_labels(obj).get(_JS_RESTART)) or 0


def _rank_key(pod: Mapping[str, Any]) -> tuple[str, str]:
    labels = _labels(pod)
    ann = (pod.get("metadata") or {}).get("annotations") or {}
    job = labels.get(_JOB_NAME) or labels.get("job-name") or ""
    index = labels.get(_COMPLETION_INDEX) or ann.get(_COMPLETION_INDEX) or ""
    return job, index


def _is_rank0(pod: Mapping[str, Any]) -> bool:
    labels = _labels(pod)
    return all(
        labels.get(k, "0") == "0" for k in (_JS_GLOBAL_INDEX, _JS_JOB_INDEX, _COMPLETION_INDEX)
    )


def _pod_ref(pod: Mapping[str, Any]) -> str:
    md = pod.get("metadata") or {}
    return f"{md.get('namespace', '?')}/{md.get('name', '?')}"


def _node(pod: Mapping[str, Any]) -> str:
    return str((pod.get("spec") or {}).get("nodeName") or "(none)")


def _int_or_none(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _parse_ts(v: Any) -> datetime | None:
    if not v:
        return None
    try:
        return datetime.fromisoformat(str(v).replace("Z", "+00:00"))
    except ValueError:
        return None


def _ts_key(t: datetime | None) -> float:
    return t.timestamp() if t is not None else float("-inf")


# ------------------------------------------------------------------------------------------
# The backend
