"""The supervisor: submits a training job, watches it, classifies how each attempt ended
and decides what comes next. Plain Python over the JobBackend contract; the `train` flow
(flows/train.py) runs it and reports to Prefect.

| ending    | what happens next                                                          |
|-----------|----------------------------------------------------------------------------|
| done      | stop: success                                                              |
| node_lost | restart, resuming from the latest checkpoint (own budget, like the Job's   |
|           | podFailurePolicy `Ignore` on DisruptionTarget: not the run's fault)        |
| crashed   | restart with resume, within `max_restarts`                                 |
| oom       | restart with resume, within `max_restarts` (the message says what to lower) |
| diverged  | restart with rollback settings (back before the divergence, skip its data, |
|           | LR x `recovery_lr_scale`, fresh rollback budget), within `max_recoveries`   |
| bad_input | stop: a bad config or dataset does not get better by retrying              |
| cancelled | stop                                                                       |

The trainer resumes by itself from the newest complete checkpoint (local or object
storage), so "restart" is just another attempt with the same config. Progress is read from
the `BALLAST_EVENT {json}` lines the trainer writes to its log.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.files import write_atomic
from core.protocol import parse_event
from infra.jobs import JobBackend, JobHandle, JobSpec, JobStatus
from training.console import event_line, progress_line

LOG_TAIL = 500  # log lines read per poll


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 3  # crashes and out-of-memory endings
    max_node_losses: int = 10  # node lost / evicted / preempted
    max_recoveries: int = 1  # divergence (exit 3) restarts with rollback settings
    recovery_lr_scale: float = 0.5
    poll_s: float = 2.0
    backoff_s: float = 5.0  # before a restart after a crash; doubles, at most 5 min
    # An attempt that never starts (image pull errors, a missing Secret, no GPU node fits)
    # stays "pending" on Kubernetes forever: give up on it after this long (a crash).
    pending_timeout_s: float | None = 1800.0

    def __post_init__(self) -> None:
        if min(self.max_restarts, self.max_node_losses, self.max_recoveries) < 0:
            raise ValueError("restart budgets must be >= 0")
        if not 0 < self.recovery_lr_scale <= 1:
            raise ValueError(f"recovery_lr_scale must be in (0, 1], got {self.recovery_lr_scale}")


@dataclass
class Attempt:
    number: int
    job: str
    args: list[str]
    started_at: float
    ended_at: float | None = None
    ending: str | None = None
    exit_code: int | None = None
    detail: str = ""
    resumed_from: str | None = None  # "fresh", or the checkpoint the trainer resumed from
    step_reached: int | None = None
    recovered: dict[str, Any] | None = None  # the trainer's "recovered" event, if any
    next_action: str = ""
    checkpoint: int | None = None  # the newest checkpoint step the trainer reported saving
    progress: dict[str, Any] | None = None  # the trainer's latest "progress" event
    adopted: bool = False  # a job left running by an earlier supervisor, watched to its end

    def row(self) -> dict[str, Any]:
        """One row of the attempts table (Prefect artifact)."""
        took = (self.ended_at or time.time()) - self.started_at
        p = self.progress or {}
        return {
            "attempt": self.number,
            "job": self.job,
            "ending": self.ending or "running",
            "exit code": self.exit_code,
            "step reached": self.step_reached,
            "loss": p.get("loss"),
            "last checkpoint": None if self.checkpoint is None else f"step {self.checkpoint}",
            "resumed from": ("adopted: " if self.adopted else "") + (self.resumed_from or ""),
            "detail": self.detail,
            "then": self.next_action,
            "minutes": round(took / 60, 2),
        }


@dataclass
class Outcome:
    ok: bool
    ending: str
    message: str
    attempts: list[Attempt] = field(default_factory=list)


# Which RestartPolicy budget each restartable ending draws on.
_BUDGET = {
    "node_lost": "max_node_losses",
    "diverged": "max_recoveries",
    "crashed": "max_restarts",
    "oom": "max_restarts",
}


def parse_events(log_text: str) -> list[dict[str, Any]]:
    # A line cut by a log tail parses as no event.
    return [ev for line in log_text.splitlines() if (ev := parse_event(line)) is not None]


def _progress(attempt: Attempt, events: list[dict[str, Any]]) -> None:
    for ev in events:
        kind = ev.get("event")
        if kind == "start" and attempt.resumed_from is None:
            attempt.resumed_from = "fresh"
        elif kind == "resume" and attempt.resumed_from is None:
            attempt.resumed_from = str(ev.get("checkpoint"))
        elif kind == "recovered":
            attempt.recovered = ev
        elif kind == "checkpoint" and isinstance(ev.get("step"), int):
            attempt.checkpoint = max(attempt.checkpoint or 0, ev["step"])
        elif kind == "progress" and (attempt.progress or {}).get("step", -1) <= ev.get("step", 0):
            attempt.progress = ev
        if isinstance(ev.get("step"), int):
            attempt.step_reached = max(attempt.step_reached or 0, ev["step"])


RECOVERY_FLAGS = ("--recover", "--lr-scale", "--rollback-to", "--skip-to-sample")


def recovery_args(diverged: dict[str, Any] | None, lr_scale: float) -> list[str]:
    """training.train arguments for the restart after a divergence (exit 3)."""
    args = ["--recover", f"--lr-scale={lr_scale:g}"]
    if diverged:
        # The checkpoint to go back to (at most): the trainer names it, the one before the
        # divergence's first step. A trainer from before that field numbered its steps
        # from 0, so its start_step was that checkpoint's number.
        to = diverged.get("rollback_to", diverged.get("start_step", diverged.get("step")))
        if isinstance(to, int):
            args.append(f"--rollback-to={to}")
        if isinstance(diverged.get("samples_seen"), int):
            args.append(f"--skip-to-sample={diverged['samples_seen']}")
    return args


def supervise(
    backend: JobBackend,
    spec: JobSpec,
    policy: RestartPolicy | None = None,
    *,
    log: Callable[[str], None] = print,
    on_attempt: Callable[[list[Attempt]], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    handle_file: Path | None = None,
    handle_extra: dict[str, Any] | None = None,
    adopt: JobHandle | None = None,
    on_progress: Callable[[Attempt], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> Outcome:
    """Run `spec` to an end, restarting within `policy`. `on_attempt` is called with every
    attempt so far whenever one starts or ends, `on_progress` with the running attempt
    whenever the trainer reports progress; `should_stop` is polled (a cancelled flow):
    when it turns true the running job is cancelled. `handle_file` holds the running job's
    handle (plus `handle_extra`, e.g. who submitted it), so another process (a
    cancellation hook, the next supervisor) can find it. `adopt` is a job an earlier
    supervisor left running: it is watched as the first attempt instead of submitting."""
    policy = policy or RestartPolicy()
    attempts: list[Attempt] = []
    extra: list[str] = []  # recovery arguments, kept until a later divergence replaces them
    used: dict[str, int] = dict.fromkeys(_BUDGET.values(), 0)  # restarts per budget
    number = spec.attempt
    while True:
        run_spec = dataclasses.replace(spec, attempt=number, args=(*spec.args, *extra))
        adopted, adopt = adopt, None
        handle = adopted or backend.submit(run_spec)
        if handle_file is not None:
            # Atomic: a reader never sees half a handle.
            write_atomic(
                handle_file,
                json.dumps(
                    {**(handle_extra or {}), **handle.to_json(), "args": list(run_spec.args)}
                ),
            )
        a = Attempt(
            number, handle.name, list(run_spec.args), time.time(), adopted=adopted is not None
        )
        attempts.append(a)
        log(
            f"attempt {number}: "
            + (
                f"adopted {handle.name}, left running by an earlier supervisor"
                if adopted
                else f"submitted {handle.name} ({backend.name})"
            )
            + (f" with {' '.join(extra)}" if extra else "")
        )
        if on_attempt:
            on_attempt(attempts)
        status = _watch(backend, handle, a, policy, log, should_stop, sleep, on_progress)
        a.ended_at, a.ending, a.exit_code, a.detail = (
            time.time(),
            status.ending,
            status.exit_code,
            status.detail,
        )
        text = backend.logs(handle)  # once, whole: the events, then the last lines
        events = parse_events(text)
        _progress(a, events)
        tail = "\n".join(text.strip().splitlines()[-15:])
        log(
            f"attempt {number}: {a.ending} ({a.detail}); step reached {a.step_reached}, "
            f"resumed from {a.resumed_from}"
            + (f"\n--- last log lines ---\n{tail}" if a.ending != "done" and tail else "")
        )

        outcome: Outcome | None = None
        if a.ending == "done":
            a.next_action = "stop: done"
            outcome = Outcome(True, "done", f"training finished at step {a.step_reached}")
        elif a.ending in ("bad_input", "cancelled"):
            a.next_action = f"stop: {a.ending}"
            outcome = Outcome(
                False,
                a.ending,
                {
                    "bad_input": "bad config or data (exit 1): not retried; see the log above",
                    "cancelled": "cancelled",
                }[a.ending],
            )
        else:  # node_lost, diverged, crashed, oom: a restart, if its budget allows
            budget = _BUDGET[a.ending or "crashed"]
            used[budget] += 1
            if used[budget] > getattr(policy, budget):
                outcome = Outcome(
                    False,
                    a.ending or "crashed",
                    f"{a.ending} {used[budget]} times ({budget}={getattr(policy, budget)})",
                )
            elif a.ending == "diverged":
                diverged = next((e for e in reversed(events) if e.get("event") == "diverged"), None)
                extra = recovery_args(diverged, policy.recovery_lr_scale)
        if outcome is not None:
            a.next_action = a.next_action or "stop: budget exhausted"
            outcome.attempts = attempts
            if on_attempt:
                on_attempt(attempts)
            log(f"supervisor: {outcome.ending}: {outcome.message}")
            return outcome

        a.next_action = (
            "restart with rollback: " + " ".join(extra)
            if a.ending == "diverged"
            else "restart with resume"
        )
        if on_attempt:
            on_attempt(attempts)
        if a.ending in ("crashed", "oom"):
            crashes = used["max_restarts"]
            wait = min(policy.backoff_s * 2 ** (crashes - 1), 300.0)
            log(
                f"supervisor: restarting in {wait:g} s ({crashes}/{policy.max_restarts} "
                "restarts used)"
            )
            sleep(wait)
        number += 1


def _watch(
    backend: JobBackend,
    handle: JobHandle,
    a: Attempt,
    policy: RestartPolicy,
    log: Callable[[str], None],
    should_stop: Callable[[], bool] | None,
    sleep: Callable[[float], None],
    on_progress: Callable[[Attempt], None] | None = None,
) -> JobStatus:
    seen: set[str] = set()
    pending_since: float | None = None
    try:
        while True:
            if should_stop is not None and should_stop():
                log(f"attempt {a.number}: stop requested, cancelling {handle.name}")
                backend.cancel(handle)
                return JobStatus("finished", "cancelled", None, "cancelled by the supervisor")
            status = backend.status(handle)
            # The log's tail only: a pod's whole log grows with the run, and polls come every
            # few seconds. The whole log is read once, when the attempt ends.
            events = parse_events(backend.logs(handle, tail=LOG_TAIL))
            fresh = []
            for ev in events:
                key = json.dumps(ev, sort_keys=True)
                if key not in seen:
                    fresh.append(ev)
                    if ev.get("event") in ("start", "resume", "recovered", "diverged"):
                        log(f"attempt {a.number}: {event_line(ev)}")
                seen.add(key)
            _progress(a, events)
            news = [ev for ev in fresh if ev.get("event") == "progress"]
            if news:
                log(f"attempt {a.number}: {progress_line(news[-1])}")
                if on_progress is not None:
                    on_progress(a)
            if status.phase == "finished":
                return status
            if status.phase == "pending":
                pending_since = pending_since or time.monotonic()
                waited = time.monotonic() - pending_since
                if policy.pending_timeout_s is not None and waited > policy.pending_timeout_s:
                    log(
                        f"attempt {a.number}: pending for {waited:.0f} s, cancelling "
                        f"{handle.name}: {status.detail}"
                    )
                    backend.cancel(handle)
                    return JobStatus(
                        "finished",
                        "crashed",
                        None,
                        f"never started: pending for {waited:.0f} s ({status.detail})",
                    )
            else:
                pending_since = None
            sleep(policy.poll_s)
    except BaseException:
        # The supervisor itself is going away (flow cancelled, KeyboardInterrupt): a job
        # nobody watches must not keep a GPU node busy.
        backend.cancel(handle)
        raise
