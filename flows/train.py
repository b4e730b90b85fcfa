"""The `train` flow: the supervisor (infra/supervisor.py) in Prefect. It submits the
training job to a backend (`local`: torchrun on this machine; `kubernetes`: a Job or JobSet),
watches it, restarts it after crashes, node loss and divergence within a budget, and reports
every attempt (logs, and the `train-attempts` table on the Artifacts page). Cancelling the
flow run cancels the job.

    python -m flows.train CONFIG [--dataset URI] [--backend local|kubernetes] [--steps N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from infra.jobs import JobBackend, JobHandle, JobSpec
from infra.supervisor import Attempt, RestartPolicy, supervise
from training.config import TrainConfig, load_train_config

CONFIG_ENV = "BALLAST_TRAIN_CONFIG"  # the config, inline in the pod's environment
HANDLE = "supervisor/current-job.json"


class TrainingFailed(RuntimeError):
    """The run ended without finishing: bad input, or a restart budget ran out."""


def job_name(run_dir: str) -> str:
    """A DNS-1123 name for the run: the run dir's last part plus a short hash of the whole
    path (two runs with the same last part do not share Kubernetes objects)."""
    base = re.sub(r"[^a-z0-9-]+", "-", Path(run_dir.rstrip("/")).name.lower()).strip("-")
    digest = hashlib.sha256(run_dir.encode()).hexdigest()[:6]
    return f"{(base or 'run')[:30].strip('-')}-{digest}"


def make_backend(kind: str, run_dir: Path, kube: dict[str, Any] | None = None) -> JobBackend:
    if kind == "local":
        from infra.local_backend import LocalBackend

        return LocalBackend(run_dir / "supervisor" / "jobs")
    if kind == "kubernetes":
        from infra.k8s_backend import KubernetesBackend
        from infra.k8s_manifests import KubeOptions

        return KubernetesBackend(KubeOptions(**(kube or {})))
    raise ValueError(f"unknown backend {kind!r}: use local or kubernetes")


def job_spec(config_path: str, backend: str, name: str, args: list[str], nnodes: int = 1,
             nproc_per_node: int = 1) -> JobSpec:
    """The attempt's JobSpec. On Kubernetes the pod gets the very config file this flow
    validated, inline in its environment (`--config env:BALLAST_TRAIN_CONFIG`), so each run
    trains on its own config without a ConfigMap per run (the supervisor's Role creates
    only jobs and jobsets)."""
    if backend == "local":
        return JobSpec(name, str(Path(config_path).resolve()), tuple(args), nnodes=nnodes,
                       nproc_per_node=nproc_per_node)
    text = Path(config_path).read_text(encoding="utf-8")
    return JobSpec(name, f"env:{CONFIG_ENV}", tuple(args), nnodes=nnodes,
                   nproc_per_node=nproc_per_node, env={CONFIG_ENV: text})


def _resolve(config_path: str, dataset: str | None, run_dir: str | None,
              steps: int | None) -> TrainConfig:
    # Validated here, before anything is submitted: a bad config fails the flow at once
    # with the key that is wrong.
    return load_train_config(config_path, {"dataset": dataset, "run_dir": run_dir,
                                           "steps": steps})


def _cancel_job(flow: Any, flow_run: Any, state: Any) -> None:
    """on_cancellation / on_crashed hook: the flow's process may be gone, so the job is found
    through the handle the supervisor wrote, and cancelled."""
    p = flow_run.parameters
    try:
        cfg = _resolve(p["config_path"], p.get("dataset"), p.get("run_dir"), p.get("steps"))
        run_dir = Path(cfg.run_dir)
        handle = JobHandle.from_json(json.loads((run_dir / HANDLE).read_text()))
        make_backend(handle.backend, run_dir, p.get("kube")).cancel(handle)
    except FileNotFoundError:
        return  # nothing was submitted


@flow(name="train", on_cancellation=[_cancel_job], on_crashed=[_cancel_job])
def train(config_path: str, dataset: str | None = None, run_dir: str | None = None,
          steps: int | None = None, backend: str = "local", nproc_per_node: int = 1,
          nnodes: int = 1, max_restarts: int = 3, max_node_losses: int = 10,
          max_recoveries: int = 1, recovery_lr_scale: float = 0.5, poll_s: float = 5.0,
          kube: dict[str, Any] | None = None,
          extra_args: list[str] | None = None) -> dict[str, Any]:
    """Train on a prepared dataset under the supervisor; returns where the results are.
    Raises TrainingFailed (the flow run fails) when the run did not finish."""
    logger = get_run_logger()
    cfg = _resolve(config_path, dataset, run_dir, steps)
    rd = Path(cfg.run_dir)
    rd.mkdir(parents=True, exist_ok=True)
    args: list[str] = []
    for flag, value in (("--dataset", dataset), ("--run-dir", run_dir), ("--steps", steps)):
        if value is not None:
            args += [flag, str(value)]
    args += list(extra_args or [])
    spec = job_spec(config_path, backend, job_name(str(rd.resolve())), args, nnodes,
                    nproc_per_node)
    policy = RestartPolicy(max_restarts, max_node_losses, max_recoveries, recovery_lr_scale,
                           poll_s=poll_s)

    def report(attempts: list[Attempt]) -> None:
        create_table_artifact(key="train-attempts", table=[a.row() for a in attempts],
                              description=f"Attempts of {spec.name}: how each ended, the "
                                          "step it reached, the checkpoint it resumed from")

    outcome = supervise(make_backend(backend, rd, kube), spec, policy, log=logger.info,
                        on_attempt=report, handle_file=rd / HANDLE)
    final_path = rd / "final.json"
    final = json.loads(final_path.read_text()) if outcome.ok and final_path.is_file() else {}
    result = {"ok": outcome.ok, "ending": outcome.ending, "message": outcome.message,
              "run_dir": str(rd), "attempts": [a.row() for a in outcome.attempts],
              "checkpoint": final.get("checkpoint"), "remote": cfg.checkpoint.remote,
              "loss_curve": str(rd / "loss.png") if (rd / "loss.png").is_file() else None,
              "metrics": str(rd / "metrics.jsonl"), "step": final.get("step"),
              "tokens_seen": final.get("tokens_seen")}
    create_markdown_artifact(key="train-summary", description="Where the run's results are",
                             markdown=_summary_md(result))
    if not outcome.ok:
        raise TrainingFailed(f"{outcome.ending}: {outcome.message}")
    return result


def _summary_md(r: dict[str, Any]) -> str:
    lines = [f"**{r['ending']}**: {r['message']}", "",
             f"- run dir: `{r['run_dir']}`", f"- metrics: `{r['metrics']}`"]
    if r["loss_curve"]:
        lines.append(f"- loss curve: `{r['loss_curve']}`")
    if r["checkpoint"]:
        lines.append(f"- final checkpoint: `{r['checkpoint']}` (step {r['step']}, "
                     f"{r['tokens_seen']:,} tokens)")
    if r["remote"]:
        lines.append(f"- object storage: `{r['remote']}`")
    lines.append(f"- attempts: {len(r['attempts'])}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--dataset")
    ap.add_argument("--run-dir")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--backend", default="local", choices=["local", "kubernetes"])
    ap.add_argument("--nproc-per-node", type=int, default=1)
    a = ap.parse_args()
    r = train(a.config, a.dataset, a.run_dir, a.steps, a.backend, a.nproc_per_node)
    print(summary_text(r))


def summary_text(r: dict[str, Any]) -> str:
    """The end-of-run summary for a terminal."""
    from training.metrics import read

    evals = [m for m in read(Path(r["metrics"])) if m.get("kind") == "eval"]
    lines = ["", f"training {r['ending']}: {r['message']} "
                 f"({len(r['attempts'])} attempt{'s' * (len(r['attempts']) != 1)})"]
    if evals:
        lines.append(f"  val loss:          {evals[-1]['val_loss']:.4f} at step "
                     f"{evals[-1]['step']} (first eval: {evals[0]['val_loss']:.4f})")
    lines += [f"  loss curve:        {r['loss_curve']}",
              f"  metrics:           {r['metrics']}",
              f"  final checkpoint:  {r['checkpoint']}"]
    if r["remote"]:
        lines.append(f"  object storage:    {r['remote']} (`latest` names the newest "
                     "complete checkpoint)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
