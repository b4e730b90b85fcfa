"""The `train` flow: the supervisor (infra/supervisor.py) in Prefect. It submits the
training job to a backend (`local`: torchrun on this machine; `kubernetes`: a Job or JobSet),
watches it, restarts it after crashes, node loss and divergence within a budget, and reports
every attempt (logs, and the artifacts of flows/train_report.py). Cancelling the
flow run cancels the job. The backend, the sizes and the restart budgets come from the
config's `launch:` section (infra/launch.py).

    python -m flows.train CONFIG [--dataset URI] [--backend local|kubernetes] [--steps N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from core.files import write_atomic
from flows.errors import register
from flows.runs import flow_run_alive, run_name
from flows.train_evals import downstream_md, downstream_text, regressions_md
from flows.train_report import (
    ATTEMPTS_KEY,
    CURVE_KEY,
    SUMMARY_KEY,
    LiveReport,
    curve_md,
    data_uri,
    find_artifact,
    post_attempts,
)
from infra.jobs import JobBackend, JobHandle, JobSpec, backend_entry, make_backend
from infra.launch import LaunchConfig, add_launch_arguments, launch_overrides, load_launch
from infra.mesh import MESH_ENV, fit_launch
from infra.supervisor import RECOVERY_FLAGS, Attempt, parse_events, supervise
from infra.tracking import TrackingError, check_tracking, log_run, tracking_on
from training import checkpoint as ckpt
from training.arguments import add_train_overrides
from training.config import TrainConfig, load_train_config

CONFIG_ENV = "BALLAST_TRAIN_CONFIG"  # the config, inline in the pod's environment
HANDLE = "supervisor/current-job.json"
ROWS = "supervisor/attempts.json"  # the attempts table's records, for the cancellation hook


class TrainingFailed(RuntimeError):
    """The run ended without finishing: bad input, or a restart budget ran out."""


register(TrainingFailed)  # its message is the cause: no traceback under it in the UI


def job_name(run_dir: str, token: str = "") -> str:
    """A DNS-1123 name for one flow run's jobs: the run dir's last part, a short hash of the
    whole path (two runs with the same last part do not share Kubernetes objects) and
    `token`, short for the flow run (each night's run submits jobs of its own, so it never
    collides with an earlier night's attempts)."""
    base = re.sub(r"[^a-z0-9-]+", "-", Path(run_dir.rstrip("/")).name.lower()).strip("-")
    digest = hashlib.sha256(run_dir.encode()).hexdigest()[:6]
    token = re.sub(r"[^a-z0-9]+", "", token.lower())[:6]
    return "-".join(x for x in ((base or "run")[:24].strip("-"), digest, token) if x)


def run_token() -> str:
    """This flow run's token for job names: its id's first characters, or the time when
    the flow runs without an API (then a second run cannot start within the same 0.1 s)."""
    from prefect.runtime import flow_run

    fid = flow_run.get_id()
    return fid.replace("-", "")[:6] if fid else f"{int(time.time() * 10) % 36**6:x}"


def _backend(launch: LaunchConfig, run_dir: Path, name: str | None = None) -> JobBackend:
    return make_backend(name or launch.backend, run_dir=run_dir, kubernetes=launch.kubernetes)


def job_spec(
    config_path: str,
    backend: str,
    name: str,
    args: list[str],
    nnodes: int = 1,
    nproc_per_node: int = 1,
    mesh: str | None = None,
) -> JobSpec:
    """The attempt's JobSpec. On Kubernetes the pod gets the very config file this flow
    validated, inline in its environment (`--config env:BALLAST_TRAIN_CONFIG`), so each run
    trains on its own config without a ConfigMap per run (the supervisor's Role creates
    only jobs and jobsets). `mesh` (infra/mesh.py mesh_name) goes into the environment too:
    the Kubernetes objects are labelled with it."""
    env = {MESH_ENV: mesh} if mesh else {}
    if backend_entry(backend).shares_disk:
        return JobSpec(
            name,
            str(Path(config_path).resolve()),
            tuple(args),
            nnodes=nnodes,
            nproc_per_node=nproc_per_node,
            env=env,
        )
    text = Path(config_path).read_text(encoding="utf-8")
    return JobSpec(
        name,
        f"env:{CONFIG_ENV}",
        tuple(args),
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        env={CONFIG_ENV: text, **env},
    )


def _resolve(
    config_path: str, dataset: str | None, run_dir: str | None, steps: int | None
) -> TrainConfig:
    # Validated here, before anything is submitted: a bad config fails the flow at once
    # with the key that is wrong.
    return load_train_config(config_path, {"dataset": dataset, "run_dir": run_dir, "steps": steps})


def _cancel_job(flow: Any, flow_run: Any, state: Any) -> None:
    """on_cancellation / on_crashed hook: the flow's process may be gone, so the job is found
    through the handle the supervisor wrote, cancelled, and the attempts table ends with
    how it stopped and the last checkpoint."""
    from prefect.logging.loggers import flow_run_logger

    logger = flow_run_logger(flow_run, flow)
    p = flow_run.parameters
    try:
        cfg = _resolve(p["config_path"], p.get("dataset"), p.get("run_dir"), p.get("steps"))
        run_dir = Path(cfg.run_dir)
        data = json.loads((run_dir / HANDLE).read_text())
    except FileNotFoundError:
        return  # nothing was submitted
    if data.get("flow_run") not in (None, str(flow_run.id)):
        return  # a job of another flow run: not this run's to stop
    handle = JobHandle.from_json(data)
    launch = load_launch(p["config_path"], p.get("launch"))
    _backend(launch, run_dir, handle.backend).cancel(handle)
    last = ckpt.latest_step(cfg.checkpoint_dir())
    ending = "cancelled" if state.is_cancelled() or state.is_cancelling() else "crashed"
    logger.info(
        f"training job {handle.name} stopped ({ending} flow run); last checkpoint: "
        + (f"{ckpt.step_name(last)} in {cfg.checkpoint_dir()}" if last is not None else "none")
    )
    rows = _read_rows(run_dir)
    if rows and rows[-1].get("ending") == "running":
        # The row was written at the attempt's last progress event; the job went on after
        # it. Its own log and the checkpoint on disk say how far: the step reached is never
        # behind the checkpoint it wrote.
        try:
            logged = [
                ev["step"]
                for ev in parse_events(_backend(launch, run_dir, handle.backend).logs(handle))
                if isinstance(ev.get("step"), int)
            ]
        except Exception:  # a log the backend no longer has: the row and the disk
            logged = []
        reached = [x for x in (rows[-1].get("step"), last, *logged) if isinstance(x, int)]
        rows[-1].update(
            {
                "ending": "cancelled",
                "detail": f"{ending} flow run: job stopped",
                "then": "stop",
                "step": max(reached) if reached else None,
                "checkpoint": last,
            }
        )
        write_atomic(run_dir / ROWS, json.dumps(rows, indent=1, default=str))
        post_attempts(
            rows,
            re.sub(r"-a\d+$", "", handle.name),
            find_artifact(flow_run.id, ATTEMPTS_KEY),
            flow_run.id,
        )


def _read_rows(run_dir: Path) -> list[dict[str, Any]]:
    try:
        rows = json.loads((run_dir / ROWS).read_text())
    except (OSError, ValueError):
        return []
    return rows if isinstance(rows, list) else []


def _leftover(backend: JobBackend, run_dir: Path, spec: JobSpec, log: Any) -> JobHandle | None:
    """A job an earlier flow run of this run dir left behind (its process was killed before
    it could stop the job): adopted when it still runs the same training, stopped when it
    runs another; a finished one is only reported. Another flow run still alive and
    training here is an error: two trainers must not share a run dir."""
    try:
        data = json.loads((run_dir / HANDLE).read_text())
        handle = JobHandle.from_json(data)
    except (OSError, ValueError, KeyError):
        return None
    try:
        status = backend.status(handle) if handle.backend == backend.name else None
    except Exception as e:  # a job the backend no longer knows: nothing to adopt
        log(f"leftover job {handle.name}: status unknown ({e}); starting anew")
        return None
    if status is None or status.phase == "finished":
        return None
    owner = data.get("flow_run")
    if owner and flow_run_alive(owner):
        raise TrainingFailed(
            f"{run_dir}: flow run {owner} is still training here (job {handle.name}); "
            "cancel it, or give this run another run_dir"
        )
    args = list(data.get("args") or [])
    n = len(spec.args)
    # The same training: the same config and arguments, plus at most the supervisor's own
    # recovery arguments (a restart after divergence).
    same = (
        data.get("config") == spec.config
        and args[:n] == list(spec.args)
        and all(a.split("=")[0] in RECOVERY_FLAGS for a in args[n:])
    )
    if same:
        log(
            f"adopting job {handle.name}, left running by flow run {owner or '?'} "
            "(its supervisor is gone)"
        )
        return handle
    log(
        f"stopping job {handle.name}, left running by flow run {owner or '?'} with other "
        "settings; this run resumes from its last checkpoint"
    )
    backend.cancel(handle)
    return None


@flow(name="train", on_cancellation=[_cancel_job], on_crashed=[_cancel_job], flow_run_name=run_name)
def train(
    config_path: str,
    dataset: str | None = None,
    run_dir: str | None = None,
    steps: int | None = None,
    launch: dict[str, Any] | None = None,
    extra_args: list[str] | None = None,
) -> dict[str, Any]:
    """Train on a prepared dataset under the supervisor; returns where the results are.
    Raises TrainingFailed (the flow run fails) when the run did not finish.

    Args:
        config_path: The training config (YAML), as the worker sees it: absolute, or
            relative to the worker's working directory.
        dataset: A prepared dataset (`<prep output>/dataset`); overrides the config's.
        run_dir: Where the run keeps checkpoints and metrics; overrides the config's. A
            second run with the same run dir resumes from its checkpoints.
        steps: Total optimizer steps; overrides the config's.
        launch: Overrides of the config's `launch:` section for this run, key by key:
            backend (`local`: torchrun on the worker's machine; `kubernetes`: a Job or
            JobSet per attempt), nnodes, nproc_per_node, max_restarts (crashes, out of
            memory), max_node_losses, max_recoveries (rollbacks after a divergence),
            recovery_lr_scale, poll_s, kubernetes (namespace, image, gpus_per_node...).
        extra_args: More `training.train` arguments, passed as they are.
    """
    logger = get_run_logger()
    cfg = _resolve(config_path, dataset, run_dir, steps)
    check_tracking(cfg)  # an unusable MLflow store fails the flow now, not after training
    lc = load_launch(config_path, launch)
    # The `parallel` mesh against nnodes x nproc_per_node, before anything is submitted.
    mesh = fit_launch(cfg.parallel, lc.nnodes, lc.nproc_per_node)
    for warning in mesh.warnings:
        logger.warning(warning)
    rd = Path(cfg.run_dir).resolve()
    rd.mkdir(parents=True, exist_ok=True)
    overrides: dict[str, Any] = {"--dataset": dataset, "--run-dir": run_dir, "--steps": steps}
    if backend_entry(lc.backend).shares_disk:
        # The job runs in the backend's directory, not the flow's: the paths this flow took
        # from its working directory go to it absolute (a relative run_dir gave the job
        # another run dir, and the supervisor never found its exit code).
        overrides["--run-dir"] = str(rd)
        if "://" not in cfg.dataset:
            overrides["--dataset"] = str(Path(cfg.dataset).resolve())
    args: list[str] = []
    for flag, value in overrides.items():
        if value is not None:
            args += [flag, str(value)]
    args += list(extra_args or [])
    spec = job_spec(
        config_path,
        lc.backend,
        job_name(str(rd.resolve()), run_token()),
        args,
        lc.nnodes,
        lc.nproc_per_node,
        mesh.name,
    )
    jobs = _backend(lc, rd)
    adopt = _leftover(jobs, rd, spec, logger.info)
    logger.info(
        f"training {cfg.steps} steps in {rd.resolve()} on {cfg.dataset} "
        f"({lc.backend} backend, jobs {spec.name}-aN, mesh {mesh.name} on "
        f"{lc.nnodes} x {lc.nproc_per_node})"
    )
    from prefect.runtime import flow_run

    live = LiveReport(rd.name, spec.name, rd / ROWS, rd / "metrics.jsonl")
    attempts_so_far: list[Attempt] = []

    def on_attempt(attempts: list[Attempt]) -> None:
        attempts_so_far[:] = attempts
        live.attempts(attempts)

    outcome = supervise(
        jobs,
        spec,
        lc.policy(),
        log=logger.info,
        on_attempt=on_attempt,
        on_progress=lambda a: live.progress(a, attempts_so_far),
        handle_file=rd / HANDLE,
        adopt=adopt,
        handle_extra={"flow_run": flow_run.get_id(), "config": spec.config},
    )
    final_path = rd / "final.json"
    final = json.loads(final_path.read_text()) if outcome.ok and final_path.is_file() else {}
    evals = _evals(rd / "metrics.jsonl")
    live.evals.poll()  # what the log gained since the last progress line
    result = {
        "ok": outcome.ok,
        "ending": outcome.ending,
        "message": outcome.message,
        "run_dir": str(rd.resolve()),
        "attempts": [a.row() for a in outcome.attempts],
        "checkpoint": final.get("checkpoint"),
        "remote": cfg.remote_checkpoint_uri(),
        "loss_curve": str((rd / "loss.png").resolve()) if (rd / "loss.png").is_file() else None,
        "metrics": str((rd / "metrics.jsonl").resolve()),
        "step": final.get("step"),
        "tokens_seen": final.get("tokens_seen"),
        "val_loss": evals[-1]["val_loss"] if evals else None,
        "val_step": evals[-1]["step"] if evals else None,
        # The in-loop evals (the `evals` section): the latest downstream record, and the
        # eval_regression events (each also a `train-eval-regression` table).
        "downstream": live.evals.latest,
        "eval_regressions": live.evals.regressions,
    }
    live.finish(outcome.ok, _closing_line(result, attempts_so_far))
    tracking_error = None
    if tracking_on(cfg):  # the run as its metrics log has it, done or not
        try:
            result["mlflow"] = log_run(
                cfg, outcome.ok, outcome.ending, {"prefect.flow_run_id": str(flow_run.get_id())}
            )
            logger.info(
                f"MLflow run {result['mlflow']['run_id']} in experiment "
                f"{result['mlflow']['experiment']} at {result['mlflow']['uri']}"
            )
        except TrackingError as e:
            tracking_error = str(e)
            logger.error(tracking_error)
    guard_rows = _guard_events(rd / "metrics.jsonl")
    result["guard_events"] = len(guard_rows)
    if guard_rows:
        create_table_artifact(
            key="train-guard-events",
            table=guard_rows,
            description=f"Skipped and rolled-back steps of {rd.name} and "
            "the documents in their batches (`ballast blame "
            f"{rd.resolve()} --event` for all of them)",
        )
    create_markdown_artifact(
        key=SUMMARY_KEY, description="Where the run's results are", markdown=_summary_md(result)
    )
    if result["loss_curve"]:
        create_markdown_artifact(
            key=CURVE_KEY,
            markdown=curve_md(Path(result["loss_curve"]), _curve_caption(rd / "metrics.jsonl")),
            description=f"Loss of {rd.name}, step {result['step']}",
        )
    if not outcome.ok:
        raise TrainingFailed(f"{outcome.ending}: {outcome.message}")
    if tracking_error is not None:  # trained, but not tracked: not a silent success
        again = " ".join(
            [
                config_path,
                *(
                    f"{f} {v}"
                    for f, v in (("--dataset", dataset), ("--run-dir", run_dir))
                    if v is not None
                ),
            ]
        )
        raise TrackingError(
            f"training done, but {tracking_error}; log it again with `ballast track {again}`"
        )
    return result


def _evals(metrics: Path) -> list[dict[str, Any]]:
    from training.metrics import read

    try:
        return [m for m in read(metrics) if m.get("kind") == "eval"]
    except (OSError, ValueError):
        return []


GUARD_EVENTS = ("skip", "rollback", "abort")


def _guard_events(metrics: Path) -> list[dict[str, Any]]:
    """A row per guard event of the metrics log (skip, rollback, abort), with the documents
    the trainer named for its batch (most tokens first, from the dataset's provenance)."""
    from training.metrics import read

    try:
        records = read(metrics)
    except (OSError, ValueError):
        return []
    rows = []
    for r in records:
        if r.get("kind") != "event" or r.get("event") not in GUARD_EVENTS:
            continue
        docs = r.get("documents") or []
        named = "; ".join(
            f"{d.get('path') or d.get('location')} ({d.get('tokens')} tokens)" for d in docs[:3]
        )
        more = int(r.get("documents_total", len(docs))) - min(len(docs), 3)
        rows.append(
            {
                "step": r.get("step"),
                "event": r.get("event"),
                "reason": r.get("reason"),
                "loss": r.get("loss"),
                "loss_z": r.get("loss_z"),
                "documents": named + (f" and {more} more" if more > 0 else ""),
            }
        )
    return rows


def _curve_caption(metrics: Path) -> str:
    from training.metrics import curve_caption, read

    try:
        return curve_caption(read(metrics))
    except (OSError, ValueError):
        return ""


def _closing_line(r: dict[str, Any], attempts: list[Attempt]) -> str:
    """The progress artifact's description once the run has ended."""
    last = (attempts[-1].progress or {}) if attempts else {}
    step = r["step"] if r["step"] is not None else last.get("step")
    line = f"**{r['ending']}**" + (f" at step {step}" if step is not None else "")
    if isinstance(last.get("loss"), float):
        line += f", loss {last['loss']:.4f}"
    if r.get("val_loss") is not None:
        line += f", validation loss {r['val_loss']:.4f} (step {r['val_step']})"
    return line + f": {r['message']}"


def _summary_md(r: dict[str, Any]) -> str:
    lines = [f"**{r['ending']}**: {r['message']}", ""]
    if r.get("val_loss") is not None:
        lines += [f"**validation loss {r['val_loss']:.4f}** at step {r['val_step']}", ""]
    for part in (downstream_md(r.get("downstream")), regressions_md(r.get("eval_regressions"))):
        if part:
            lines += [part, ""]
    lines += [f"- run dir: `{r['run_dir']}`", f"- metrics: `{r['metrics']}`"]
    if r["checkpoint"]:
        lines.append(
            f"- final checkpoint: `{_absolute(r['checkpoint'])}` (step {r['step']}, "
            f"{r['tokens_seen']:,} tokens)"
        )
    if r["remote"]:
        lines.append(f"- object storage: `{_absolute(r['remote'])}`")
    lines.append(f"- attempts: {len(r['attempts'])} (the `train-attempts` artifact)")
    if r.get("guard_events"):
        lines.append(
            f"- guard events: {r['guard_events']} skipped or rolled-back steps, with "
            "their documents (the `train-guard-events` artifact; `ballast blame "
            f"{r['run_dir']} --event`)"
        )
    if r.get("mlflow"):
        m = r["mlflow"]
        lines.append(
            f"- MLflow: run `{m['run_id']}` in experiment `{m['experiment']}` at `{m['uri']}`"
        )
    if r["loss_curve"]:
        lines += [
            f"- loss curve: `{r['loss_curve']}`",
            "",
            f"![loss curve]({data_uri(Path(r['loss_curve']))})",
        ]
    return "\n".join(lines)


def _absolute(uri: str) -> str:
    return uri if "://" in uri else str(Path(uri).resolve())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="training config (YAML), or a run config with `train:`")
    add_train_overrides(ap)
    add_launch_arguments(ap)
    a = ap.parse_args()
    r = train(a.config, a.dataset, a.run_dir, a.steps, launch_overrides(a))
    print(summary_text(r))


def summary_text(r: dict[str, Any]) -> str:
    """The end-of-run summary for a terminal."""
    from training.metrics import read

    evals = [m for m in read(Path(r["metrics"])) if m.get("kind") == "eval"]
    lines = [
        "",
        f"training {r['ending']}: {r['message']} "
        f"({len(r['attempts'])} attempt{'s' * (len(r['attempts']) != 1)})",
    ]
    if evals:
        lines.append(
            f"  val loss:          {evals[-1]['val_loss']:.4f} at step "
            f"{evals[-1]['step']} (first eval: {evals[0]['val_loss']:.4f})"
        )
    lines += downstream_text(r.get("downstream"), r.get("eval_regressions"))
    lines += [
        f"  loss curve:        {r['loss_curve']}",
        f"  metrics:           {r['metrics']}",
        f"  final checkpoint:  {r['checkpoint']}",
    ]
    if r["remote"]:
        lines.append(
            f"  object storage:    {r['remote']} (`latest` names the newest complete checkpoint)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
