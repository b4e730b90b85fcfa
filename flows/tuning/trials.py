"""The trials of a search, each a training job supervised on the `train` flow's JobBackend:
its config and run dir, its objective's values (validation loss, or an in-loop benchmark:
flows/tuning/objective.py) read from its metrics log and reported to the pruner, its
ending and last value told to the study; and `search`, which keeps `parallel` of them
running until the study holds n_trials finished ones."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import threading
from pathlib import Path
from typing import Any

import yaml
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait

from flows.runs import flow_run_alive
from flows.train import HANDLE, job_name, job_spec, run_token
from flows.tuning.config import Search, flat_message, set_key
from flows.tuning.objective import VALIDATION, Objective
from flows.tuning.study import suggest, trial_state
from infra.jobs import JobHandle, make_backend
from infra.launch import LaunchConfig
from infra.supervisor import supervise
from training.config import TrainConfigError, parse_train_config

# --- a trial's config and metrics --------------------------------------------------------


def trial_dir(s: Search, number: int) -> Path:
    return s.cfg.out_dir() / "trials" / f"trial-{number:04d}"


def write_trial_config(s: Search, number: int, params: dict[str, Any]) -> Path:
    """The trial's training config, written into its run dir; TrainConfigError when this
    combination of values is invalid."""
    doc = copy.deepcopy(s.base)
    for key, value in params.items():
        set_key(doc, key, value)
    rd = trial_dir(s, number)
    doc["run_dir"] = str(rd)
    if "://" not in doc["dataset"]:
        # The job may run in another working directory (the local backend: the repo root).
        doc["dataset"] = str(Path(doc["dataset"]).resolve())
    doc.pop("launch", None)
    # A trial is a throwaway proxy run: its checkpoints stay in its run dir (trial run dir
    # names repeat across studies, so a shared object-store root would mix them).
    doc.setdefault("checkpoint", {})
    doc["checkpoint"] = {**doc["checkpoint"], "remote": None}
    parse_train_config(doc, f"trial {number}")
    rd.mkdir(parents=True, exist_ok=True)
    path = rd / "train.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def read_evals(metrics: Path) -> list[tuple[int, float]]:
    """(step, validation loss) of each evaluation the trial has logged so far."""
    return VALIDATION.values(metrics)


# --- one trial: a supervised training job ------------------------------------------------


@task(name="hpo-trial", task_run_name="trial-{number}", cache_policy=NO_CACHE)
def run_trial(
    number: int,
    config_path: str,
    run_dir: str,
    launch: LaunchConfig,
    stop: threading.Event,
    poll_s: float,
) -> dict[str, Any]:
    """Train one trial under the supervisor (restarts after a crash or a lost node; none
    after a divergence: a rollback with a lower LR would change the very hyperparameter
    under test). Setting `stop` (the pruner's call) cancels the job within `poll_s`."""
    from prefect.runtime import flow_run

    logger = get_run_logger()
    rd = Path(run_dir)
    spec = job_spec(
        config_path,
        launch.backend,
        job_name(str(rd), run_token()),
        [],
        launch.nnodes,
        launch.nproc_per_node,
    )
    backend = make_backend(launch.backend, run_dir=rd, kubernetes=launch.kubernetes)
    policy = dataclasses.replace(launch.policy(), max_recoveries=0, poll_s=poll_s)
    outcome = supervise(
        backend,
        spec,
        policy,
        log=logger.info,
        should_stop=stop.is_set,
        handle_file=rd / HANDLE,
        handle_extra={"flow_run": flow_run.get_id(), "trial": number},
    )
    return {"ok": outcome.ok, "ending": outcome.ending, "message": outcome.message}


@dataclasses.dataclass
class Running:
    trial: Any  # optuna.Trial
    params: dict[str, Any]
    run_dir: Path
    future: Any
    stop: threading.Event
    reported: int = -1  # the last step reported to the pruner
    pruned_at: int | None = None


def _start(s: Search, study: Any, log: Any) -> Running | None:
    from prefect.runtime import flow_run

    trial = study.ask()
    params = suggest(trial, s.cfg.space)
    trial.set_user_attr("flow_run", flow_run.get_id())
    trial.set_user_attr("run_dir", str(trial_dir(s, trial.number)))
    try:
        path = write_trial_config(s, trial.number, params)
    except TrainConfigError as e:
        # This combination is invalid even though every range end is valid alone.
        trial.set_user_attr("ending", "bad_input")
        study.tell(trial, state=trial_state("FAIL"))
        log(f"trial {trial.number}: {params}: {flat_message(str(e))}")
        return None
    stop = threading.Event()
    log(f"trial {trial.number}: {params}")
    fut = run_trial.submit(
        trial.number, str(path), str(trial_dir(s, trial.number)), s.launch, stop, s.cfg.poll_s
    )
    return Running(trial, params, trial_dir(s, trial.number), fut, stop)


def _report(r: Running, objective: Objective, log: Any) -> None:
    """Report the trial's new values of the objective; set its stop event when the pruner
    says so, or when a value is not finite (a diverged proxy needs no pruner's opinion)."""
    if r.stop.is_set():
        return
    for step, value in objective.values(r.run_dir / "metrics.jsonl"):
        if step <= r.reported:
            continue
        r.reported = step
        if not math.isfinite(value):
            log(f"trial {r.trial.number}: {objective.label} {value} at step {step}: stopped")
            r.pruned_at = step
            r.stop.set()
            return
        r.trial.report(value, step)
        if r.trial.should_prune():
            log(f"trial {r.trial.number}: pruned at step {step} ({objective.label} {value:.4f})")
            r.pruned_at = step
            r.stop.set()
            return


def _finish(r: Running, study: Any, objective: Objective, log: Any) -> None:
    result = r.future.result(raise_on_failure=False)
    if not isinstance(result, dict):  # the task itself failed (an exception in the flow)
        result = {"ok": False, "ending": "crashed", "message": str(result)}
    metrics = r.run_dir / "metrics.jsonl"
    evals = [(st, v) for st, v in objective.values(metrics) if math.isfinite(v)]
    if result["ok"] and not evals:  # trained to its end, yet nothing to rank it by
        result = {**result, "ok": False, "message": objective.missing(metrics)}
    r.trial.set_user_attr("ending", "pruned" if r.pruned_at is not None else result["ending"])
    if r.pruned_at is not None or result["ending"] == "diverged":
        # Pruned with its intermediate values: TPE still learns that this region is bad.
        study.tell(r.trial, state=trial_state("PRUNED"))
        log(
            f"trial {r.trial.number}: pruned"
            + ("" if r.pruned_at is not None else f" ({result['message']})")
        )
    elif result["ok"] and evals:
        step, value = evals[-1]
        study.tell(r.trial, value)
        log(f"trial {r.trial.number}: {objective.label} {value:.4f} at step {step}")
    else:
        r.trial.set_user_attr("message", result["message"])
        study.tell(r.trial, state=trial_state("FAIL"))
        log(f"trial {r.trial.number}: failed: {result['ending']}: {result['message']}")


def _counted(study: Any) -> int:
    """Trials that count against n_trials: every one that finished (completed, pruned,
    failed: those have an `ending`), not those a stopped search left unfinished."""
    final = (trial_state("COMPLETE"), trial_state("PRUNED"), trial_state("FAIL"))
    return sum(
        1 for t in study.get_trials(deepcopy=False) if t.state in final and "ending" in t.user_attrs
    )


def _close_stale(s: Search, study: Any, log: Any) -> int:
    """Trials an earlier search left RUNNING (its process was killed): their jobs are
    stopped and they are marked failed (interrupted, not counted), so the search runs
    that many new ones. Trials of a search still running elsewhere on the same study are
    left alone and counted. Returns how many are still running elsewhere."""
    elsewhere = 0
    for t in study.get_trials(deepcopy=False, states=(trial_state("RUNNING"),)):
        owner = t.user_attrs.get("flow_run")
        if owner and flow_run_alive(owner):
            elsewhere += 1
            continue
        cancel_handle(Path(t.user_attrs.get("run_dir") or trial_dir(s, t.number)), s.launch)
        study.tell(t.number, state=trial_state("FAIL"))  # no `ending`: not counted
        log(f"trial {t.number}: left unfinished by an earlier search; not counted")
    return elsewhere


def cancel_handle(run_dir: Path, launch: LaunchConfig) -> None:
    try:
        handle = JobHandle.from_json(json.loads((run_dir / HANDLE).read_text()))
    except (OSError, ValueError, KeyError):
        return
    with contextlib.suppress(Exception):  # a job its backend no longer knows is stopped
        make_backend(handle.backend, run_dir=run_dir, kubernetes=launch.kubernetes).cancel(handle)


def search(s: Search, study: Any, log: Any) -> None:
    """Run trials, `parallel` at a time, until the study holds n_trials finished ones."""
    todo = s.cfg.n_trials - _counted(study) - _close_stale(s, study, log)
    if todo <= 0:
        log(
            f"study {s.name}: {_counted(study)} trials finished already "
            f"(n_trials {s.cfg.n_trials}); nothing to run"
        )
        return
    log(f"study {s.name}: running {todo} trials, {s.cfg.parallel} at a time")
    running: list[Running] = []
    try:
        while todo > 0 or running:
            while todo > 0 and len(running) < s.cfg.parallel:
                todo -= 1
                r = _start(s, study, log)
                if r is not None:
                    running.append(r)
            if not running:
                continue
            done = wait([r.future for r in running], timeout=s.cfg.poll_s).done
            for r in list(running):
                _report(r, s.objective, log)
                if r.future in done:
                    _finish(r, study, s.objective, log)
                    running.remove(r)
    finally:
        # Interrupted (Ctrl-C, an error): every job still running is stopped, and its
        # trial is marked so that the next search runs a new one instead.
        for r in running:
            r.stop.set()
        for r in running:
            with contextlib.suppress(BaseException):
                r.future.wait()
            study.tell(r.trial, state=trial_state("FAIL"))  # no `ending`: not counted
