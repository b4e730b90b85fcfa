"""The search config of the `hpo` flow: the YAML's models (search space, sampler, pruner),
the dotted keys into the training config, and `load_hpo_config`, which validates a search
(every key exists; every end of every range gives a valid training config) into a
`Search`."""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from core.config import Strict, format_validation_error, read_yaml
from core.errors import ConfigError
from flows.tuning.objective import Objective, parse_objective
from infra.launch import LaunchConfig, parse_launch
from infra.mesh import fit_launch
from training.config import TrainConfig, TrainConfigError, parse_train_config, read_train_doc

# Keys a trial sets itself: where it runs and how it is launched are not hyperparameters.
_RESERVED = ("run_dir", "launch", "dataset")


class HpoError(RuntimeError):
    """A search that cannot go on (no study, no finished trial to transfer...)."""


class FloatDist(Strict):
    type: Literal["float"] = Field(description="A float between low and high.")
    low: float = Field(description="The lowest value.")
    high: float = Field(description="The highest value (>= low).")
    log: bool = Field(
        default=False, description=("Sample on a log scale (needs low > 0; not with step).")
    )
    step: float | None = Field(default=None, gt=0, description=("Sample only low + k * step."))

    @model_validator(mode="after")
    def _range(self) -> FloatDist:
        _check_range(self.low, self.high, self.log, self.step)
        return self


class IntDist(Strict):
    type: Literal["int"] = Field(description="An integer between low and high.")
    low: int = Field(description="The lowest value.")
    high: int = Field(description="The highest value (>= low).")
    log: bool = Field(
        default=False,
        description=("Sample on a log scale (needs low > 0; not with a step above 1)."),
    )
    step: int = Field(default=1, ge=1, description="Sample only low + k * step.")

    @model_validator(mode="after")
    def _range(self) -> IntDist:
        _check_range(self.low, self.high, self.log, None if self.step == 1 else self.step)
        return self


class CategoricalDist(Strict):
    type: Literal["categorical"] = Field(description="One of the choices.")
    choices: list[bool | int | float | str | None] = Field(
        min_length=1, description=("The values to choose from.")
    )


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
    kind: Literal["tpe", "random"] = Field(
        default="tpe", description=("Optuna's TPE or random sampling.")
    )
    seed: int | None = Field(default=0, description="The sampler's seed.")
    n_startup_trials: int = Field(
        default=10, ge=0, description=("tpe: random trials before the model.")
    )


class PrunerConfig(Strict):
    kind: Literal["median", "asha", "hyperband", "none"] = Field(
        default="median",
        description=(
            "`median`: stop a trial whose loss at a step is worse than the median of the "
            "finished trials' at that step; `asha` (successive halving) and `hyperband`: keep "
            "the best 1/reduction_factor at each rung of min_resource * reduction_factor**k "
            "steps; `none`: no pruning."
        ),
    )
    n_startup_trials: int = Field(
        default=2, ge=0, description=("median: finished trials before pruning.")
    )
    n_warmup_steps: int = Field(
        default=0, ge=0, description=("median: no pruning before this step.")
    )
    min_resource: int | None = Field(
        default=None,
        ge=1,
        description=("asha/hyperband: steps of the first rung; None: eval_every."),
    )
    reduction_factor: int = Field(default=3, ge=2, description=("asha/hyperband: see kind."))


class HpoConfig(Strict):
    base_config: str = Field(description=("The training config every trial starts from."))
    study: str | None = Field(
        default=None, description=("The study's name in the storage; None: the config's stem.")
    )
    out: str = Field(
        default="runs/hpo",
        description=(
            "trials/trial-NNNN/ (each a run dir), study.db, the best-loss plot. Pruning reads "
            "the trials' metrics here: on Kubernetes, a volume the trial pods share."
        ),
    )
    storage: str | None = Field(
        default=None,
        description=(
            "An Optuna storage URL (sqlite:///..., postgresql://...); None: "
            "sqlite:///<out>/study.db."
        ),
    )
    dataset: str | None = Field(default=None, description="Overrides the base config's.")
    n_trials: int = Field(
        ge=1,
        description=(
            "Finished trials the study should hold: a second run of the search runs only the "
            "missing ones."
        ),
    )
    parallel: int = Field(default=1, ge=1, description="Trials run at a time.")
    steps: int | None = Field(
        default=None, ge=1, description=("Each trial's budget; None: the base config's.")
    )
    eval_every: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Each trial's; the validation losses the pruner sees. None: the base config's."
        ),
    )
    objective: str = Field(
        default="val_loss",
        description=(
            "What ranks the trials: `val_loss`, or `downstream/<task>/<metric>`, a "
            "benchmark the base config's `evals:` section scores in the loop (acc, "
            "acc_per_char, acc_per_token or bpb of a task; bpb of a text set). A trial's "
            "value is the objective's last value in its metrics log; the pruner sees each "
            "one as it is logged (every `eval_every` steps for val_loss, `evals.every` for "
            "a benchmark)."
        ),
    )
    direction: Literal["minimize", "maximize"] | None = Field(
        default=None,
        description=(
            "Whether lower or higher values are better; None: minimize val_loss and bpb, "
            "maximize the accuracies."
        ),
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "The proxy: dotted keys of the training config set in every trial and in the "
            "transferred config, e.g. `model.d_model: 64`, `model.mup_base_d_model: 64`."
        ),
    )
    space: dict[str, Distribution] = Field(
        min_length=1,
        description=(
            "Dotted keys of the training config (`optim.lr`, `optim.betas.1` for beta2, ...) "
            "to their distributions: `{type: float|int, low, high, log, step}` or `{type: "
            "categorical, choices}`. A key the training config does not have, or a range end "
            "that makes an invalid training config, is an error naming the key."
        ),
    )
    enqueue: list[dict[str, Any]] = Field(
        default_factory=list,
        description=(
            "Parameter sets tried first (the base config's own values: a baseline to beat)."
        ),
    )
    sampler: SamplerConfig = Field(
        default=SamplerConfig(), description=("How trials' parameters are chosen.")
    )
    pruner: PrunerConfig = Field(
        default=PrunerConfig(), description=("When a trial is stopped early.")
    )
    launch: dict[str, Any] | None = Field(
        default=None, description=("Overrides of the base config's `launch:` for the trials.")
    )
    poll_s: float = Field(default=1.0, gt=0, description=("Seconds between looks at the trials."))

    def out_dir(self) -> Path:
        return Path(self.out).resolve()

    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{self.out_dir() / 'study.db'}"


@dataclasses.dataclass(frozen=True)
class Search:
    """A validated search: the config, its base training config (as YAML data, the
    proxy's keys and the trial budget set), the launch settings of its trials and what
    ranks them."""

    cfg: HpoConfig
    name: str
    path: str
    base: dict[str, Any]
    proxy: TrainConfig
    launch: LaunchConfig
    objective: Objective


def _one_line(e: ValidationError, where: str) -> str:
    def untagged(loc: tuple[Any, ...]) -> tuple[Any, ...]:
        # A distribution's type tag is in the location of its errors; the key is not.
        if len(loc) > 2 and loc[0] == "space" and loc[2] in _DIST_TAGS:
            return loc[:2] + loc[3:]
        return loc

    head, *rows = format_validation_error(
        e, where, "hpo config", untagged, model=HpoConfig
    ).splitlines()
    return f"{head} " + "; ".join(r.strip() for r in rows)


def flat_message(message: str) -> str:
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
                raise ValueError(
                    f"no key {part!r} in {where} (it has: {', '.join(node.model_fields)})"
                )
            node = _unoptional(node.model_fields[part].annotation)
        elif typing.get_origin(node) is tuple:
            size = len(typing.get_args(node))
            if not part.isdigit() or int(part) >= size:
                raise ValueError(f"{where} is a list of {size}: use an index 0..{size - 1}")
            node = typing.get_args(node)[int(part)]
        else:
            raise ValueError(f"{where} is a value, not a section")
    if leaf and isinstance(node, type) and issubclass(node, BaseModel):
        raise ValueError(
            f"{key} is a section: name one of its keys ({', '.join(node.model_fields)})"
        )


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
    for section, keys, leaf in (
        ("overrides", cfg.overrides, False),
        ("space", cfg.space, True),
        *((f"enqueue[{i}]", e, True) for i, e in enumerate(cfg.enqueue)),
    ):
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
    for key, value in (
        ("dataset", cfg.dataset),
        ("steps", cfg.steps),
        ("eval_every", cfg.eval_every),
    ):
        if value is not None:
            base[key] = value
    for key, value in cfg.overrides.items():
        set_key(base, key, value)
    try:
        proxy = parse_train_config(base, cfg.base_config)
    except TrainConfigError as e:
        raise ConfigError(
            f"invalid hpo config {where}: base_config with overrides: {flat_message(str(e))}"
        ) from None
    try:
        objective = parse_objective(cfg.objective, cfg.direction, proxy)
    except ValueError as e:
        raise ConfigError(f"invalid hpo config {where}: objective: {cfg.objective}: {e}") from None
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
                raise ConfigError(
                    f"invalid hpo config {where}: space.{key}: {value!r} gives "
                    f"an invalid training config: {flat_message(str(e))}"
                ) from None
    try:
        launch = parse_launch(base.get("launch"), cfg.launch, cfg.base_config)
        # the trials' mesh on their launch, before the study starts
        fit_launch(proxy.parallel, launch.nnodes, launch.nproc_per_node)
    except ConfigError as e:
        raise ConfigError(f"invalid hpo config {where}: {flat_message(str(e))}") from None
    return Search(cfg, cfg.study or Path(where).stem, where, base, proxy, launch, objective)
