"""The `hpo` flow: hyperparameter search on small proxy models with Optuna. Each trial is a
training job on the same JobBackend the `train` flow uses (infra/jobs.py: local processes
here, Kubernetes Jobs on a cluster), several at a time; the validation losses the trial
writes to its metrics log are reported to Optuna's pruner while it runs, and a trial the
pruner gives up on is stopped through the backend. The study lives in an Optuna storage
(SQLite under `out:` by default), so a search run again only runs the trials still missing.

    python -m flows.hpo HPO_CONFIG        (or `ballast hpo run HPO_CONFIG`)

The search config (YAML):

    base_config: configs/train-demo.yaml   # the training config every trial starts from
    out: runs/hpo-demo                     # trials/, study.db, the plot
    n_trials: 12
    parallel: 2                            # trials training at the same time
    steps: 60                              # each trial's budget (not transferred)
    eval_every: 10                         # how often a trial reports its validation loss
    overrides: {model.d_model: 64, model.mup_base_d_model: 64}   # the proxy, every trial
    space:
      optim.lr: {type: float, low: 1.0e-4, high: 3.0e-2, log: true}
      optim.betas.1: {type: categorical, choices: [0.95, 0.99]}
      schedule.warmup_steps: {type: int, low: 0, high: 20}
    sampler: {kind: tpe, seed: 0}          # tpe | random
    pruner: {kind: median}                 # median | asha | hyperband | none

Space and override keys are dotted paths into the training config (training/config.py);
`optim.betas.1` is beta2. `transfer()` (`ballast hpo transfer`) writes the best trial's
hyperparameters into a training config at another width under muP.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import dataclasses
import json
import math
import threading
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import wait
from pydantic import BaseModel, Field, ValidationError, model_validator

from core.config import Strict, format_validation_error, read_yaml
from core.errors import ConfigError
from flows.runs import run_name
from flows.train import HANDLE, job_name, job_spec, run_token
from infra.jobs import JobHandle, make_backend
from infra.launch import LaunchConfig, parse_launch
from infra.supervisor import supervise
from training.config import TrainConfig, TrainConfigError, parse_train_config, read_train_doc

TRIALS_KEY = "hpo-trials"  # the trials table's artifact key
PLOT_KEY = "hpo-best-loss"
# Keys a trial sets itself: where it runs and how it is launched are not hyperparameters.
_RESERVED = ("run_dir", "launch", "dataset")


class HpoError(RuntimeError):
    """A search that cannot go on (no study, no finished trial to transfer...)."""


# --- the search config -------------------------------------------------------------------


class FloatDist(Strict):
    type: Literal["float"] = Field(description="A float between low and high.")
    low: float = Field(description="The lowest value.")
    high: float = Field(description="The highest value (>= low).")
    log: bool = Field(default=False, description=(
        "Sample on a log scale (needs low > 0; not with step)."))
    step: float | None = Field(default=None, gt=0, description=(
        "Sample only low + k * step."))

    @model_validator(mode="after")
    def _range(self) -> FloatDist:
        _check_range(self.low, self.high, self.log, self.step)
        return self


class IntDist(Strict):
    type: Literal["int"] = Field(description="An integer between low and high.")
    low: int = Field(description="The lowest value.")
    high: int = Field(description="The highest value (>= low).")
    log: bool = Field(default=False, description=(
        "Sample on a log scale (needs low > 0; not with a step above 1)."))
    step: int = Field(default=1, ge=1, description="Sample only low + k * step.")

    @model_validator(mode="after")
    def _range(self) -> IntDist:
        _check_range(self.low, self.high, self.log, None if self.step == 1 else self.step)
        return self


class CategoricalDist(Strict):
    type: Literal["categorical"] = Field(description="One of the choices.")
    choices: list[bool | int | float | str | None] = Field(min_length=1, description=(
        "The values to choose from."))


Distribution = Annotated[FloatDist | IntDist | CategoricalDist, Field(discriminator="type")]
_DIST_TAGS = ("float", "int", "categorical")


def _check_range(low: float, high: float, log: bool, step: float | None) -> None:
    if high < low:
        raise ValueError(f"high ({high}) must be >= low ({low})")
    if log and low <= 0:
        raise ValueError(f"log: true needs low > 0 (got {low})")
    if log and step is not None:
        raise ValueError("log and step cannot be used together")


class SamplerConfig(Strict):
    kind: Literal["tpe", "random"] = Field(default="tpe", description=(
        "Optuna's TPE or random sampling."))
    seed: int | None = Field(default=0, description="The sampler's seed.")
    n_startup_trials: int = Field(default=10, ge=0, description=(
        "tpe: random trials before the model."))


class PrunerConfig(Strict):
    kind: Literal["median", "asha", "hyperband", "none"] = Field(default="median", description=(
        "`median`: stop a trial whose loss at a step is worse than the median of the "
        "finished trials' at that step; `asha` (successive halving) and `hyperband`: keep "
        "the best 1/reduction_factor at each rung of min_resource * reduction_factor**k "
        "steps; `none`: no pruning."))
    n_startup_trials: int = Field(default=2, ge=0, description=(
        "median: finished trials before pruning."))
    n_warmup_steps: int = Field(default=0, ge=0, description=(
        "median: no pruning before this step."))
    min_resource: int | None = Field(default=None, ge=1, description=(
        "asha/hyperband: steps of the first rung; None: eval_every."))
    reduction_factor: int = Field(default=3, ge=2, description=(
        "asha/hyperband: see kind."))


class HpoConfig(Strict):
    base_config: str = Field(description=(
        "The training config every trial starts from."))
    study: str | None = Field(default=None, description=(
        "The study's name in the storage; None: the config's stem."))
    out: str = Field(default="runs/hpo", description=(
        "trials/trial-NNNN/ (each a run dir), study.db, the best-loss plot. Pruning reads "
        "the trials' metrics here: on Kubernetes, a volume the trial pods share."))
    storage: str | None = Field(default=None, description=(
        "An Optuna storage URL (sqlite:///..., postgresql://...); None: "
        "sqlite:///<out>/study.db."))
    dataset: str | None = Field(default=None, description="Overrides the base config's.")
    n_trials: int = Field(ge=1, description=(
        "Finished trials the study should hold: a second run of the search runs only the "
        "missing ones."))
    parallel: int = Field(default=1, ge=1, description="Trials run at a time.")
    steps: int | None = Field(default=None, ge=1, description=(
        "Each trial's budget; None: the base config's."))
    eval_every: int | None = Field(default=None, ge=1, description=(
        "Each trial's; the validation losses the pruner sees. None: the base config's."))
    overrides: dict[str, Any] = Field(default_factory=dict, description=(
        "The proxy: dotted keys of the training config set in every trial and in the "
        "transferred config, e.g. `model.d_model: 64`, `model.mup_base_d_model: 64`."))
    space: dict[str, Distribution] = Field(min_length=1, description=(
        "Dotted keys of the training config (`optim.lr`, `optim.betas.1` for beta2, ...) "
        "to their distributions: `{type: float|int, low, high, log, step}` or `{type: "
        "categorical, choices}`. A key the training config does not have, or a range end "
        "that makes an invalid training config, is an error naming the key."))
    enqueue: list[dict[str, Any]] = Field(default_factory=list, description=(
        "Parameter sets tried first (the base config's own values: a baseline to beat)."))
    sampler: SamplerConfig = Field(default=SamplerConfig(), description=(
        "How trials' parameters are chosen."))
    pruner: PrunerConfig = Field(default=PrunerConfig(), description=(
        "When a trial is stopped early."))
    launch: dict[str, Any] | None = Field(default=None, description=(
        "Overrides of the base config's `launch:` for the trials."))
    poll_s: float = Field(default=1.0, gt=0, description=(
        "Seconds between looks at the trials."))

    def out_dir(self) -> Path:
        return Path(self.out).resolve()

    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{self.out_dir() / 'study.db'}"


@dataclasses.dataclass(frozen=True)
class Search:
    """A validated search: the config, its base training config (as YAML data, the
    proxy's keys and the trial budget set) and the launch settings of its trials."""

    cfg: HpoConfig
    name: str
    path: str
    base: dict[str, Any]
    proxy: TrainConfig
    launch: LaunchConfig


def _one_line(e: ValidationError, where: str) -> str:
    def untagged(loc: tuple[Any, ...]) -> tuple[Any, ...]:
        # A distribution's type tag is in the location of its errors; the key is not.
        if len(loc) > 2 and loc[0] == "space" and loc[2] in _DIST_TAGS:
            return loc[:2] + loc[3:]
        return loc

    head, *rows = format_validation_error(e, where, "hpo config", untagged).splitlines()
    return f"{head} " + "; ".join(r.strip() for r in rows)


def _flat(message: str) -> str:
    """A multi-line config error as one line."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _field_at(key: str, leaf: bool = True) -> None:
    """ValueError unless `key` is a dotted path to a field of TrainConfig (a value, when
    `leaf`; an item of a tuple field by its index: `optim.betas.1`)."""
    node: Any = TrainConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        where = ".".join(parts[:i]) or "the training config"
        if isinstance(node, type) and issubclass(node, BaseModel):
            if part not in node.model_fields:
                raise ValueError(f"no key {part!r} in {where} (it has: "
                                 f"{', '.join(node.model_fields)})")
            node = _unoptional(node.model_fields[part].annotation)
        elif typing.get_origin(node) is tuple:
            size = len(typing.get_args(node))
            if not part.isdigit() or int(part) >= size:
                raise ValueError(f"{where} is a list of {size}: use an index 0..{size - 1}")
            node = typing.get_args(node)[int(part)]
        else:
            raise ValueError(f"{where} is a value, not a section")
    if leaf and isinstance(node, type) and issubclass(node, BaseModel):
        raise ValueError(f"{key} is a section: name one of its keys "
                         f"({', '.join(node.model_fields)})")


def _unoptional(ann: Any) -> Any:
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        return args[0] if len(args) == 1 else ann
    return ann


def set_key(doc: dict[str, Any], key: str, value: Any) -> None:
    """Set the dotted `key` in a training config's YAML data, creating sections on the
    way; an index into a tuple field (`optim.betas.1`) replaces that item only."""
    parts = key.split(".")
    node, default = doc, TrainConfig(dataset="-").model_dump(mode="json")
    for i, part in enumerate(parts[:-1]):
        default = default.get(part) if isinstance(default, dict) else None
        if parts[i + 1].isdigit():
            items = list(node.get(part) if node.get(part) is not None else default)
            items[int(parts[i + 1])] = value
            node[part] = items
            return
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


def load_hpo_config(path: str | Path) -> Search:
    """The search at `path`, validated: every key path exists in the training config and
    every end of every range gives a valid training config. ConfigError (one line naming
    the key) otherwise."""
    where = str(path)
    data = read_yaml(path, ConfigError)
    if not isinstance(data, dict):
        raise ConfigError(f"invalid hpo config {where}: expected a mapping")
    try:
        cfg = HpoConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_one_line(e, where)) from None
    for section, keys, leaf in (("overrides", cfg.overrides, False), ("space", cfg.space, True),
                                *((f"enqueue[{i}]", e, True) for i, e in
                                  enumerate(cfg.enqueue))):
        for key in keys:
            try:
                if key.split(".")[0] in _RESERVED:
                    raise ValueError("set by the search for each trial, not searchable")
                _field_at(key, leaf)
                if section.startswith("enqueue") and key not in cfg.space:
                    raise ValueError("not a key of `space`")
            except ValueError as e:
                raise ConfigError(f"invalid hpo config {where}: {section}.{key}: {e}") from None
    try:
        base = read_train_doc(cfg.base_config)
    except ConfigError as e:
        raise ConfigError(f"invalid hpo config {where}: base_config: {e}") from None
    base = copy.deepcopy(base)
    for key, value in (("dataset", cfg.dataset), ("steps", cfg.steps),
                       ("eval_every", cfg.eval_every)):
        if value is not None:
            base[key] = value
    for key, value in cfg.overrides.items():
        set_key(base, key, value)
    try:
        proxy = parse_train_config(base, cfg.base_config)
    except TrainConfigError as e:
        raise ConfigError(f"invalid hpo config {where}: base_config with overrides: "
                          f"{_flat(str(e))}") from None
    # Each end of each range, the others as the base has them: a range that reaches an
    # invalid value (lr 0, a head count that does not divide d_model) fails here, not as
    # a failed trial an hour in.
    for key, dist in cfg.space.items():
        ends = dist.choices if isinstance(dist, CategoricalDist) else [dist.low, dist.high]
        for value in ends:
            doc = copy.deepcopy(base)
            set_key(doc, key, value)
            try:
                parse_train_config(doc)
            except TrainConfigError as e:
                raise ConfigError(f"invalid hpo config {where}: space.{key}: {value!r} gives "
                                  f"an invalid training config: {_flat(str(e))}") from None
    try:
        launch = parse_launch(base.get("launch"), cfg.launch, cfg.base_config)
    except ConfigError as e:
        raise ConfigError(f"invalid hpo config {where}: {_flat(str(e))}") from None
    return Search(cfg, cfg.study or Path(where).stem, where, base, proxy, launch)


# --- the study ---------------------------------------------------------------------------


def open_study(s: Search, create: bool = True) -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    s.cfg.out_dir().mkdir(parents=True, exist_ok=True)
    if not create:
        try:
            return optuna.load_study(study_name=s.name, storage=s.cfg.storage_url())
        except KeyError:
            raise HpoError(f"no study {s.name!r} in {s.cfg.storage_url()}: run "
                           f"`ballast hpo run {s.path}` first") from None
    sc, pc = s.cfg.sampler, s.cfg.pruner
    sampler = (optuna.samplers.RandomSampler(seed=sc.seed) if sc.kind == "random" else
               # constant_liar: trials running in parallel count as bad guesses near their
               # point, so the sampler does not propose the same region twice at once.
               optuna.samplers.TPESampler(seed=sc.seed, n_startup_trials=sc.n_startup_trials,
                                          constant_liar=True))
    rung = pc.min_resource or s.proxy.eval_every
    pruner = {"median": lambda: optuna.pruners.MedianPruner(
                  n_startup_trials=pc.n_startup_trials, n_warmup_steps=pc.n_warmup_steps),
              "asha": lambda: optuna.pruners.SuccessiveHalvingPruner(
                  min_resource=rung, reduction_factor=pc.reduction_factor),
              "hyperband": lambda: optuna.pruners.HyperbandPruner(
                  min_resource=rung, max_resource=s.proxy.steps,
                  reduction_factor=pc.reduction_factor),
              "none": optuna.pruners.NopPruner}[pc.kind]()
    study = optuna.create_study(study_name=s.name, storage=s.cfg.storage_url(),
                                sampler=sampler, pruner=pruner, direction="minimize",
                                load_if_exists=True)
    for params in s.cfg.enqueue:
        study.enqueue_trial(params, skip_if_exists=True)
    return study


def suggest(trial: Any, space: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, d in space.items():
        if isinstance(d, FloatDist):
            out[key] = trial.suggest_float(key, d.low, d.high, log=d.log, step=d.step)
        elif isinstance(d, IntDist):
            out[key] = trial.suggest_int(key, d.low, d.high, log=d.log, step=d.step)
        else:
            out[key] = trial.suggest_categorical(key, d.choices)
    return out


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
    """(step, validation loss) of each evaluation the trial has logged so far; a line the
    trainer is writing right now is skipped until it is whole."""
    try:
        text = metrics.read_text(encoding="utf-8")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "eval" and isinstance(rec.get("step"), int):
            out.append((rec["step"], float(rec["val_loss"])))
    return out


# --- one trial: a supervised training job ------------------------------------------------


@task(name="hpo-trial", task_run_name="trial-{number}", cache_policy=NO_CACHE)
def run_trial(number: int, config_path: str, run_dir: str, launch: LaunchConfig,
              stop: threading.Event, poll_s: float) -> dict[str, Any]:
    """Train one trial under the supervisor (restarts after a crash or a lost node; none
    after a divergence: a rollback with a lower LR would change the very hyperparameter
    under test). Setting `stop` (the pruner's call) cancels the job within `poll_s`."""
    from prefect.runtime import flow_run

    logger = get_run_logger()
    rd = Path(run_dir)
    spec = job_spec(config_path, launch.backend, job_name(str(rd), run_token()), [],
                    launch.nnodes, launch.nproc_per_node)
    backend = make_backend(launch.backend, run_dir=rd, kubernetes=launch.kubernetes)
    policy = dataclasses.replace(launch.policy(), max_recoveries=0, poll_s=poll_s)
    outcome = supervise(backend, spec, policy, log=logger.info, should_stop=stop.is_set,
                        handle_file=rd / HANDLE,
                        handle_extra={"flow_run": flow_run.get_id(), "trial": number})
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
        study.tell(trial, state=_state("FAIL"))
        log(f"trial {trial.number}: {params}: {_flat(str(e))}")
        return None
    stop = threading.Event()
    log(f"trial {trial.number}: {params}")
    fut = run_trial.submit(trial.number, str(path), str(trial_dir(s, trial.number)),
                           s.launch, stop, s.cfg.poll_s)
    return Running(trial, params, trial_dir(s, trial.number), fut, stop)


def _state(name: str) -> Any:
    from optuna.trial import TrialState

    return TrialState[name]


def _report(r: Running, log: Any) -> None:
    """Report the trial's new validation losses; set its stop event when the pruner says
    so, or when the loss is not finite (a diverged proxy needs no pruner's opinion)."""
    if r.stop.is_set():
        return
    for step, loss in read_evals(r.run_dir / "metrics.jsonl"):
        if step <= r.reported:
            continue
        r.reported = step
        if not math.isfinite(loss):
            log(f"trial {r.trial.number}: validation loss {loss} at step {step}: stopped")
            r.pruned_at = step
            r.stop.set()
            return
        r.trial.report(loss, step)
        if r.trial.should_prune():
            log(f"trial {r.trial.number}: pruned at step {step} (validation loss {loss:.4f})")
            r.pruned_at = step
            r.stop.set()
            return


def _finish(r: Running, study: Any, log: Any) -> None:
    result = r.future.result(raise_on_failure=False)
    if not isinstance(result, dict):  # the task itself failed (an exception in the flow)
        result = {"ok": False, "ending": "crashed", "message": str(result)}
    evals = [(st, v) for st, v in read_evals(r.run_dir / "metrics.jsonl") if math.isfinite(v)]
    r.trial.set_user_attr("ending", "pruned" if r.pruned_at is not None else result["ending"])
    if r.pruned_at is not None or result["ending"] == "diverged":
        # Pruned with its intermediate values: TPE still learns that this region is bad.
        study.tell(r.trial, state=_state("PRUNED"))
        log(f"trial {r.trial.number}: pruned"
            + ("" if r.pruned_at is not None else f" ({result['message']})"))
    elif result["ok"] and evals:
        step, value = evals[-1]
        study.tell(r.trial, value)
        log(f"trial {r.trial.number}: validation loss {value:.4f} at step {step}")
    else:
        r.trial.set_user_attr("message", result["message"])
        study.tell(r.trial, state=_state("FAIL"))
        log(f"trial {r.trial.number}: failed: {result['ending']}: {result['message']}")


def _counted(study: Any) -> int:
    """Trials that count against n_trials: every one that finished (completed, pruned,
    failed: those have an `ending`), not those a stopped search left unfinished."""
    final = (_state("COMPLETE"), _state("PRUNED"), _state("FAIL"))
    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.state in final and "ending" in t.user_attrs)


def _close_stale(s: Search, study: Any, log: Any) -> int:
    """Trials an earlier search left RUNNING (its process was killed): their jobs are
    stopped and they are marked failed (interrupted, not counted), so the search runs
    that many new ones. Trials of a search still running elsewhere on the same study are
    left alone and counted. Returns how many are still running elsewhere."""
    elsewhere = 0
    for t in study.get_trials(deepcopy=False, states=(_state("RUNNING"),)):
        owner = t.user_attrs.get("flow_run")
        if owner and _flow_run_alive(owner):
            elsewhere += 1
            continue
        _cancel_handle(Path(t.user_attrs.get("run_dir") or trial_dir(s, t.number)), s.launch)
        study.tell(t.number, state=_state("FAIL"))  # no `ending`: not counted
        log(f"trial {t.number}: left unfinished by an earlier search; not counted")
    return elsewhere


def _flow_run_alive(flow_run_id: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if flow_run_id == flow_run.get_id():
        return False
    try:
        with get_client(sync_client=True) as client:
            fr = client.read_flow_run(flow_run_id)
    except Exception:
        return False  # unknown to this API: not alive here
    return fr.state is not None and not fr.state.is_final()


def _cancel_handle(run_dir: Path, launch: LaunchConfig) -> None:
    try:
        handle = JobHandle.from_json(json.loads((run_dir / HANDLE).read_text()))
    except (OSError, ValueError, KeyError):
        return
    with contextlib.suppress(Exception):  # a job its backend no longer knows is stopped
        make_backend(handle.backend, run_dir=run_dir, kubernetes=launch.kubernetes).cancel(
            handle)


def search(s: Search, study: Any, log: Any) -> None:
    """Run trials, `parallel` at a time, until the study holds n_trials finished ones."""
    todo = s.cfg.n_trials - _counted(study) - _close_stale(s, study, log)
    if todo <= 0:
        log(f"study {s.name}: {_counted(study)} trials finished already "
            f"(n_trials {s.cfg.n_trials}); nothing to run")
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
                _report(r, log)
                if r.future in done:
                    _finish(r, study, log)
                    running.remove(r)
    finally:
        # Interrupted (Ctrl-C, an error): every job still running is stopped, and its
        # trial is marked so that the next search runs a new one instead.
        for r in running:
            r.stop.set()
        for r in running:
            with contextlib.suppress(BaseException):
                r.future.wait()
            study.tell(r.trial, state=_state("FAIL"))  # no `ending`: not counted


# --- reporting ---------------------------------------------------------------------------


def trial_rows(study: Any) -> list[dict[str, Any]]:
    keys = sorted({k for t in study.get_trials(deepcopy=False) for k in t.params})
    rows = []
    for t in study.get_trials(deepcopy=False):
        steps = sorted(t.intermediate_values)
        rows.append({"trial": t.number, "state": t.state.name.lower(),
                     "value": None if t.value is None else round(t.value, 5),
                     **{k: t.params.get(k) for k in keys},
                     "last step": steps[-1] if steps else None,
                     "ending": t.user_attrs.get("ending"),
                     "minutes": round(t.duration.total_seconds() / 60, 2)
                     if t.duration else None})
    return rows


def plot_best(study: Any, png: Path) -> None:
    """Each completed trial's loss, pruned ones at their last reported loss, and the best
    so far against the trial number."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [(t.number, t.value) for t in study.get_trials(deepcopy=False)
            if t.state == _state("COMPLETE") and t.value is not None]
    pruned = [(t.number, t.intermediate_values[max(t.intermediate_values)])
              for t in study.get_trials(deepcopy=False)
              if t.state == _state("PRUNED") and t.intermediate_values]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if done:
        best, line = math.inf, []
        for n, v in done:
            best = min(best, v)
            line.append((n, best))
        ax.plot(*zip(*done, strict=True), "o", label="completed", ms=4)
        ax.step(*zip(*line, strict=True), where="post", label="best so far", lw=1.5)
    if pruned:
        ax.plot(*zip(*pruned, strict=True), "x", color="gray", label="pruned (last report)")
    ax.set_xlabel("trial")
    ax.set_ylabel("validation loss")
    ax.set_title(f"study {study.study_name}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def summary(s: Search, study: Any) -> dict[str, Any]:
    trials = study.get_trials(deepcopy=False)
    by_state = {st: sum(1 for t in trials if t.state.name == st)
                for st in ("COMPLETE", "PRUNED", "FAIL")}
    complete = [t for t in trials if t.state == _state("COMPLETE")]
    best = min(complete, key=lambda t: t.value) if complete else None
    return {"study": s.name, "storage": s.cfg.storage_url(), "trials": len(trials),
            "completed": by_state["COMPLETE"], "pruned": by_state["PRUNED"],
            "failed": by_state["FAIL"],
            "best_trial": best.number if best else None,
            "best_value": best.value if best else None,
            "best_params": best.params if best else None,
            "best_config": str(trial_dir(s, best.number) / "train.yaml") if best else None,
            "plot": str(s.cfg.out_dir() / "best-loss.png")}


def _summary_md(r: dict[str, Any], png: Path) -> str:
    lines = [f"**study {r['study']}**: {r['trials']} trials ({r['completed']} completed, "
             f"{r['pruned']} pruned, {r['failed']} failed)", ""]
    if r["best_trial"] is not None:
        lines += [f"**best validation loss {r['best_value']:.4f}** (trial {r['best_trial']})",
                  "", *(f"- `{k}`: {v}" for k, v in r["best_params"].items()),
                  f"- config: `{r['best_config']}`", ""]
    uri = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode("ascii")
    return "\n".join([*lines, f"![best loss against trials]({uri})"])


def _cancel_trials(flow: Any, flow_run: Any, state: Any) -> None:
    """on_cancellation / on_crashed: the flow's process may be gone; each trial job this
    flow run started and left running is found through its handle file and stopped."""
    try:
        s = load_hpo_config(flow_run.parameters["config_path"])
    except (ConfigError, KeyError):
        return
    for rd in (s.cfg.out_dir() / "trials").glob("trial-*"):
        try:
            owner = json.loads((rd / HANDLE).read_text()).get("flow_run")
        except (OSError, ValueError):
            continue
        if owner == str(flow_run.id):
            _cancel_handle(rd, s.launch)


@flow(name="hpo", flow_run_name=run_name, on_cancellation=[_cancel_trials],
      on_crashed=[_cancel_trials])
def hpo(config_path: str) -> dict[str, Any]:
    """Search hyperparameters on proxy models: run the trials the study still misses,
    then post the `hpo-trials` table and the `hpo-best-loss` plot.

    Args:
        config_path: The search config (YAML): base training config, space, n_trials,
            parallel, sampler, pruner (see the module's docstring).
    """
    logger = get_run_logger()
    s = load_hpo_config(config_path)
    study = open_study(s)
    search(s, study, logger.info)
    rows = trial_rows(study)
    create_table_artifact(key=TRIALS_KEY, table=rows,
                          description=f"Trials of study {s.name}: parameters, loss, state")
    r = summary(s, study)
    png = Path(r["plot"])
    plot_best(study, png)
    create_markdown_artifact(key=PLOT_KEY, markdown=_summary_md(r, png),
                             description=f"Best validation loss against trials, {s.name}")
    return r


def summary_text(r: dict[str, Any]) -> str:
    lines = ["", f"study {r['study']}: {r['trials']} trials, {r['completed']} completed, "
                 f"{r['pruned']} pruned, {r['failed']} failed ({r['storage']})"]
    if r["best_trial"] is not None:
        lines += [f"  best validation loss: {r['best_value']:.4f} (trial {r['best_trial']})",
                  *(f"    {k}: {v:.4g}" if isinstance(v, float) else f"    {k}: {v}"
                    for k, v in r["best_params"].items()),
                  f"  best trial's config: {r['best_config']}"]
    lines.append(f"  plot:                 {r['plot']}")
    return "\n".join(lines)


# --- muP transfer ------------------------------------------------------------------------


def transfer(hpo_config: str, width: int, out: str | Path) -> dict[str, Any]:
    """Write the training config at width `width` with the study's best hyperparameters:
    the base config with the proxy's overrides and the best trial's values, d_model set to
    `width`, heads added to keep the proxy's head size, and mup_base_d_model kept at the
    proxy's (muP scales the hidden learning rates, init and readout from it, so lr and
    init_std carry over as they are). The trial budget (steps, eval_every) is not
    transferred. ConfigError / HpoError with one line on what is wrong."""
    s = load_hpo_config(hpo_config)
    m = s.proxy.model
    if m.mup_base_d_model is None:
        raise HpoError(f"{hpo_config}: the proxies trained without muP (model.mup_base_d_model "
                       "unset), so their hyperparameters do not transfer across width; set "
                       f"overrides: {{model.mup_base_d_model: {m.d_model}}} and search again")
    head_dim = m.d_model // m.n_head
    if width % head_dim:
        raise HpoError(f"--to-width {width} is not a multiple of the proxy's head size "
                       f"{head_dim} (d_model {m.d_model} / n_head {m.n_head})")
    study = open_study(s, create=False)
    try:
        best = study.best_trial
    except ValueError:
        raise HpoError(f"study {s.name} has no completed trial yet") from None
    doc = copy.deepcopy(read_train_doc(s.cfg.base_config))
    if s.cfg.dataset is not None:
        doc["dataset"] = s.cfg.dataset
    for key, value in (*s.cfg.overrides.items(), *best.params.items()):
        set_key(doc, key, value)
    set_key(doc, "model.d_model", width)
    set_key(doc, "model.n_head", width // head_dim)
    set_key(doc, "model.mup_base_d_model", m.mup_base_d_model)
    try:
        parse_train_config(copy.deepcopy(doc), str(out))
    except TrainConfigError as e:
        raise HpoError(f"the transferred config is invalid: {_flat(str(e))}") from None
    header = (f"# Transferred by `ballast hpo transfer` from study {s.name} "
              f"({s.cfg.storage_url()}), trial {best.number}: validation loss "
              f"{best.value:.4f} at width {m.d_model}.\n# muP base width "
              f"{m.mup_base_d_model}; hyperparameters: {json.dumps(best.params)}\n")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(header + yaml.safe_dump(doc, sort_keys=False))
    return {"out": str(out), "trial": best.number, "value": best.value,
            "params": best.params, "width": width, "base_width": m.mup_base_d_model}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config", help="the search config (YAML)")
    a = ap.parse_args()
    print(summary_text(hpo(a.config)))


if __name__ == "__main__":
    main()
