"""MLflow tracking: one MLflow run per training run (a `train` or `pipeline` flow run, or
one `ballast train`), holding the training and the prep that made its data together. The
prep side is found through the dataset the run trained on: its manifest (accounting per
stage, per rule and per source; the mixture planned vs realised), the prep's report.json
and the config that made the output (`_run.json`). The training side is the run dir's
metrics log, read when training ends, so the trainer never depends on MLflow and only one
process logs, whatever torchrun ran (rank 0 writes the log).

The store: `tracking.uri`, else $MLFLOW_TRACKING_URI, else a SQLite file under the run
(sqlite:///<run_dir>/mlflow/mlflow.db, artifacts beside it). MLflow 3 refuses its old
directory store (file:/, ./mlruns) unless told to with MLFLOW_ALLOW_FILE_STORE; SQLite
works offline without a server, through the SQLAlchemy and Alembic that Prefect brings.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.dataset import read_manifest, resolve
from core.errors import ConfigError, NotFound, StorageError
from core.store import open_store
from training.config import TrainConfig, check_tracking_uri
from training.metrics import plot_loss, read, scalars

ENV_URI = "MLFLOW_TRACKING_URI"
STORE_DIR = "mlflow"  # under the run dir: mlflow.db and artifacts/
PROBE_TIMEOUT_S = 5.0
# MLflow's own limits per log_batch call.
BATCH_METRICS, BATCH_PARAMS = 1000, 100
MAX_PARAM_CHARS = 6000


class TrackingError(ConfigError):
    """The MLflow store cannot be used, or logging to it failed: one line, the cause."""


def tracking_on(cfg: TrainConfig) -> bool:
    t = cfg.tracking
    return t is not None and t.enabled and t.mlflow


def tracking_uri(cfg: TrainConfig) -> str:
    """The store this run logs to (see the module docstring)."""
    assert cfg.tracking is not None
    if cfg.tracking.uri:
        return cfg.tracking.uri
    env = os.environ.get(ENV_URI)
    if env:
        try:
            check_tracking_uri(env)
        except ValueError as e:
            raise TrackingError(f"${ENV_URI}: {e} (got {env!r})") from None
        return env
    return "sqlite:///" + str(Path(cfg.run_dir).resolve() / STORE_DIR / "mlflow.db")


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///") :]) if uri.startswith("sqlite:///") else None


def _artifact_location(uri: str) -> str | None:
    """A new experiment's artifact root: beside a SQLite file (MLflow's default would be
    ./mlruns under whatever directory the process runs in); a server chooses its own."""
    db = _sqlite_path(uri)
    return (db.resolve().parent / "artifacts").as_uri() if db is not None else None


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """MLflow and Alembic announce every table they create at INFO: not for our logs."""
    loggers = [logging.getLogger(n) for n in ("mlflow", "alembic")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _one_line(e: BaseException) -> str:
    text = getattr(e, "message", None) or str(e) or type(e).__name__
    return " ".join(str(text).split())[:300]


@dataclass(frozen=True)
class MlflowStore:
    client: Any  # mlflow.tracking.MlflowClient
    uri: str
    experiment_id: str


def open_tracking(cfg: TrainConfig) -> MlflowStore:
    """The run's MLflow store and experiment (created if new), or TrackingError with one
    line: no server answers, the SQLite file cannot be made, MLflow refuses the store."""
    assert cfg.tracking is not None
    uri = tracking_uri(cfg)
    key = (
        "tracking.uri"
        if cfg.tracking.uri
        else (f"${ENV_URI}" if os.environ.get(ENV_URI) else "tracking")
    )
    if uri.startswith(("http://", "https://")):
        # A plain request with a timeout first: MLflow's client retries an unreachable
        # server for minutes before it gives up.
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=PROBE_TIMEOUT_S):
                pass
        except (urllib.error.URLError, OSError) as e:
            raise TrackingError(
                f"{key}: no MLflow server answers at {uri} ({_one_line(getattr(e, 'reason', e))})"
            ) from None
    db = _sqlite_path(uri)
    if db is not None:
        try:
            db.resolve().parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TrackingError(
                f"{key}: cannot create the MLflow store {db}: {e.strerror or e}"
            ) from None
    from mlflow.tracking import MlflowClient

    name = cfg.tracking.experiment
    try:
        with _quiet():
            client = MlflowClient(tracking_uri=uri)
            exp = client.get_experiment_by_name(name)
            if exp is None:
                exp_id = client.create_experiment(name, artifact_location=_artifact_location(uri))
            else:
                exp_id = exp.experiment_id
    except Exception as e:  # MLflow's, SQLAlchemy's, requests': one line whatever it is
        raise TrackingError(f"{key}: MLflow store {uri}: {_one_line(e)}") from None
    return MlflowStore(client, uri, exp_id)


def check_tracking(cfg: TrainConfig) -> None:
    """Before training starts: the store must open (one line naming the key if not)."""
    if tracking_on(cfg):
        open_tracking(cfg)


# -- what is logged ---------------------------------------------------------------------


def metric_key(*parts: str) -> str:
    """An MLflow metric or parameter name from parts (sources, reasons, stages): the
    characters MLflow refuses become '_', and no part is '.' or '..'."""
    clean = [re.sub(r"[^\w.\- ]", "_", str(p)) or "_" for p in parts]
    return "/".join("_" if p in (".", "..") else p for p in clean)


def flatten(prefix: str, value: Any) -> dict[str, str]:
    """A config as MLflow parameters: nested keys joined by '.', lists as JSON."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for k, v in value.items():
            out.update(flatten(f"{prefix}.{k}" if prefix else str(k), v))
        return out
    text = json.dumps(value) if isinstance(value, list) else str(value)
    if len(text) > MAX_PARAM_CHARS:  # the whole config is an artifact too
        text = text[: MAX_PARAM_CHARS - 1] + "…"
    return {prefix: text}


def accounting_metrics(stages: dict[str, Any]) -> dict[str, float]:
    """Per stage, per rule (drop reason) and per source: documents and bytes in, kept,
    dropped, as `prep/<stage>/...` and `prep/<stage>/source/<source>/...`."""
    out: dict[str, float] = {}

    def counts(base: tuple[str, ...], s: dict[str, Any]) -> None:
        for field in ("docs_in", "kept", "bytes_in", "bytes_kept", "bytes_dropped"):
            if isinstance(s.get(field), int | float):
                out[metric_key(*base, field)] = float(s[field])
        dropped = s.get("dropped") or {}
        out[metric_key(*base, "dropped")] = float(sum(dropped.values()))
        for reason, n in dropped.items():
            out[metric_key(*base, "dropped", reason)] = float(n)

    for stage, st in stages.items():
        counts(("prep", stage), st["total"])
        for src, s in (st.get("sources") or {}).items():
            counts(("prep", stage, "source", src), s)
    return out


def _numbers(base: tuple[str, ...], d: dict[str, Any]) -> dict[str, float]:
    return {
        metric_key(*base, k): float(v)
        for k, v in d.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


def prep_metrics(manifest: dict[str, Any], report: dict[str, Any] | None) -> dict[str, float]:
    """The prep's numbers: accounting, mixture (planned vs realised, per source),
    packing, the dataset's splits and the time per stage."""
    source = report if report is not None else {}
    out = accounting_metrics(source.get("stages") or manifest.get("accounting") or {})
    mix = source.get("mixture") or manifest.get("mixture") or {}
    for src, m in (mix.get("sources") or {}).items():
        out.update(_numbers(("mixture", src), m))
    out.update(_numbers(("mixture",), mix))
    pk = source.get("packing") or manifest.get("packing") or {}
    for split in ("train", "validation"):
        out.update(_numbers(("packing", split), pk.get(split) or {}))
    for split, s in (manifest.get("splits") or {}).items():
        out.update(_numbers(("dataset", split), s))
    for stage, secs in (source.get("stage_seconds") or {}).items():
        out[metric_key("prep", stage, "seconds")] = float(secs)
    return out


@dataclass
class PrepRecord:
    """What the dataset a run trained on says about the prep that made it."""

    dataset: str  # the version trained on
    manifest: dict[str, Any]
    report: dict[str, Any] | None  # the version's report.json, if the output holds it
    config: dict[str, Any] | None  # the prep config (<output>/_run.json)


def prep_record(cfg: TrainConfig) -> PrepRecord:
    """The manifest of the dataset version `cfg` trains on, and, when the dataset is a prep
    output's (`<output>/dataset[/vNNNN]`), that output's report and config."""
    uri = resolve(cfg.dataset, cfg.storage)
    manifest = read_manifest(uri, cfg.storage)
    parts = uri.rstrip("/").split("/")
    if parts[-1].startswith("v") and parts[-1][1:].isdigit() and parts[-2:-1] == ["dataset"]:
        output, version = "/".join(parts[:-2]), parts[-1]
    elif parts[-1] == "dataset":
        output, version = "/".join(parts[:-1]), None
    else:
        return PrepRecord(uri, manifest, None, None)
    store = open_store(output or "/", cfg.storage)

    def get(key: str) -> dict[str, Any] | None:
        try:
            return json.loads(store.get(key))
        except (NotFound, ValueError):
            return None

    report = get(f"{version}/report.json" if version else "report.json")
    run = get("_run.json")
    return PrepRecord(uri, manifest, report, (run or {}).get("config"))


def training_metrics(
    records: list[dict[str, Any]], t0_ms: int
) -> list[tuple[str, float, int, int]]:
    """(name, value, timestamp ms, step) of every number in the metrics log, in its order
    (the timestamps keep it: the log holds no clock times)."""
    out = []
    for i, rec in enumerate(records):
        step = rec.get("step")
        if isinstance(step, int):
            out += [(name, value, t0_ms + i, step) for name, value in scalars(rec)]
    return out


def log_run(
    cfg: TrainConfig, ok: bool, ending: str, tags: dict[str, str] | None = None
) -> dict[str, str]:
    """Log the run dir's training and its dataset's prep as a new MLflow run (FINISHED when
    `ok`, else FAILED); returns {run_id, uri, experiment}. TrackingError with one line when
    the store cannot be reached or refuses what is logged."""
    assert cfg.tracking is not None
    st = open_tracking(cfg)
    rd = Path(cfg.run_dir)
    try:
        with _quiet():
            run_id = _log(st, cfg, rd, ok, ending, tags or {})
    except TrackingError:
        raise
    except Exception as e:
        raise TrackingError(f"logging {rd} to MLflow at {st.uri} failed: {_one_line(e)}") from None
    return {"run_id": run_id, "uri": st.uri, "experiment": cfg.tracking.experiment}


def _log(
    st: MlflowStore, cfg: TrainConfig, rd: Path, ok: bool, ending: str, tags: dict[str, str]
) -> str:
    from mlflow.entities import Metric, Param

    client = st.client
    stamp = time.strftime("%Y-%m-%d-%H%M%S", time.gmtime())
    all_tags = {
        "ballast.run_dir": str(rd.resolve()),
        "ballast.ending": ending,
        "ballast.checkpoint_fingerprint": cfg.checkpoint_fingerprint(),
        **tags,
    }
    params = flatten("train", cfg.model_dump(mode="json"))
    metrics: dict[str, float] = {}
    try:
        prep = prep_record(cfg)
    except (StorageError, ValueError, OSError) as e:
        prep = None
        all_tags["ballast.prep"] = f"not logged: {_one_line(e)}"
    if prep is not None:
        m = prep.manifest
        all_tags.update(
            {
                "ballast.dataset": prep.dataset,
                "ballast.dataset_fingerprint": str(m.get("config_fingerprint")),
            }
        )
        params.update(
            flatten(
                "dataset",
                {
                    "uri": prep.dataset,
                    "config_fingerprint": m.get("config_fingerprint"),
                    "seq_len": m.get("seq_len"),
                    "seed": m.get("seed"),
                    "version": (m.get("version") or {}).get("version"),
                    "tokenizer": {
                        k: v
                        for k, v in (m.get("tokenizer") or {}).items()
                        if k in ("kind", "vocab_size", "eos_id", "pad_id")
                    },
                },
            )
        )
        if prep.config is not None:
            params.update(flatten("prep", prep.config))
        metrics.update(prep_metrics(m, prep.report))
    run = client.create_run(
        st.experiment_id, run_name=f"{rd.resolve().name}-{stamp}", tags=all_tags
    )
    run_id = run.info.run_id
    try:
        t0 = int(time.time() * 1000)
        batch = [Metric(k, v, t0, 0) for k, v in sorted(metrics.items())]
        metrics_path = rd / "metrics.jsonl"
        records = read(metrics_path) if metrics_path.is_file() else []
        batch += [Metric(n, v, ts, s) for n, v, ts, s in training_metrics(records, t0)]
        final = _json_file(rd / "final.json")
        if final is not None:
            for k in ("step", "tokens_seen", "skipped_non_finite", "skipped_spikes"):
                if isinstance(final.get(k), int):
                    batch.append(Metric(f"final/{k}", float(final[k]), t0, final["step"]))
            env = final.get("environment") or {}
            for k in ("git_commit", "torch", "cuda"):
                if env.get(k):
                    client.set_tag(run_id, f"ballast.{k}", str(env[k]))
        items = sorted(params.items())
        for i in range(0, len(items), BATCH_PARAMS):
            client.log_batch(run_id, params=[Param(k, v) for k, v in items[i : i + BATCH_PARAMS]])
        for i in range(0, len(batch), BATCH_METRICS):
            client.log_batch(run_id, metrics=batch[i : i + BATCH_METRICS])
        with tempfile.TemporaryDirectory(prefix="ballast-mlflow-") as tmp:
            _artifacts(client, run_id, Path(tmp), rd, cfg, prep, records)
        client.set_tag(run_id, "mlflow.note.content", _note(cfg, ending, final))
        client.set_terminated(run_id, "FINISHED" if ok else "FAILED")
    except BaseException:
        with contextlib.suppress(Exception):  # the run must not stay RUNNING forever
            client.set_terminated(run_id, "FAILED")
        raise
    return run_id


def _json_file(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _artifacts(
    client: Any,
    run_id: str,
    tmp: Path,
    rd: Path,
    cfg: TrainConfig,
    prep: PrepRecord | None,
    records: list[dict[str, Any]],
) -> None:
    def put(name: str, data: Any, where: str) -> None:
        path = tmp / where / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
        client.log_artifact(run_id, str(path), artifact_path=where)

    put("config.json", cfg.model_dump(mode="json"), "training")
    put("events.json", [r for r in records if r.get("kind") == "event"], "training")
    for name in ("metrics.jsonl", "final.json", "loss.png", "supervisor/attempts.json"):
        if (rd / name).is_file():
            client.log_artifact(run_id, str(rd / name), artifact_path="training")
    if not (rd / "loss.png").is_file() and (rd / "metrics.jsonl").is_file():
        # A run that did not finish has no plot of its own yet: draw one from the log.
        plot_loss(rd / "metrics.jsonl", tmp / "loss.png")
        client.log_artifact(run_id, str(tmp / "loss.png"), artifact_path="training")
    if prep is not None:
        put("manifest.json", prep.manifest, "prep")
        if prep.report is not None:
            put("report.json", prep.report, "prep")
        if prep.config is not None:
            put("config.json", prep.config, "prep")


def _note(cfg: TrainConfig, ending: str, final: dict[str, Any] | None) -> str:
    """The run's description in the MLflow UI."""
    lines = [
        f"Ballast training run `{Path(cfg.run_dir).resolve()}`: **{ending}**",
        f"on dataset `{cfg.dataset}`.",
    ]
    if final is not None and isinstance(final.get("tokens_seen"), int):
        lines.append(f"Final step {final.get('step')}, {final['tokens_seen']:,} tokens.")
    lines.append(
        "Prep accounting under `prep/...`, mixture under `mixture/...`, training "
        "under `train/...` and `eval/...`; artifacts `prep/` and `training/`."
    )
    return " ".join(lines)
