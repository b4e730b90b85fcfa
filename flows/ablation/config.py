"""The ablation config: a base prep config, named arms (each a set of dotted overrides of
it), the proxy model every arm trains (same token budget, several seeds) and the evals
they are compared on. Validated whole before anything runs: every arm's prep config and
every proxy's training config, errors naming the key."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from core.config import Strict, format_validation_error, read_yaml
from core.errors import ConfigError
from dataprep.config import PrepConfig, load_config, parse_config
from flows.tuning.config import set_key
from infra.launch import LaunchConfig, parse_launch
from infra.mesh import fit_launch
from training.config import TrainConfig, parse_train_config, read_train_doc
from training.config.evals import EvalsConfig

BASE = "base"  # the arm that is the base config itself, always run


class AblationError(ConfigError):
    """An ablation that cannot run as configured (one line)."""


class ProxySpec(Strict):
    config: str = Field(
        description=(
            "The training config every arm's proxies start from (relative: from the working "
            "directory); its `dataset`, `run_dir`, `seed` and `steps` are set per proxy."
        )
    )
    steps: int | None = Field(default=None, ge=1, description="Optimizer steps per proxy.")
    tokens: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Instead of steps: the token budget per proxy (steps = tokens / (micro_batch x "
            "accum_steps x seq_len), rounded up), equal across arms whatever their seq_len."
        ),
    )
    seeds: list[int] = Field(
        default=[0, 1], min_length=1, description="One proxy per seed per arm."
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Dotted keys of the training config set for every proxy (model.d_model: 64).",
    )

    @model_validator(mode="after")
    def _budget(self) -> ProxySpec:
        if (self.steps is None) == (self.tokens is None):
            raise ValueError("give exactly one of proxy.steps and proxy.tokens")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError("proxy.seeds must be distinct")
        return self


class AblationConfig(Strict):
    base: str = Field(description="The base prep config (relative: from the working directory).")
    out: str = Field(description="Where the arms' preps, proxies and results go.")
    arms: dict[str, dict[str, Any]] = Field(
        min_length=1,
        description=(
            "Arm name -> dotted overrides of the base prep config (`quality: []`, "
            "`dedup.near.threshold: 0.7`, `mixture.alpha: 0.3`); the base itself is the arm "
            "`base`."
        ),
    )
    proxy: ProxySpec = Field(description="The proxy model the arms are compared by.")
    evals: EvalsConfig | None = Field(
        default=None,
        description="The proxies' `evals` section; None: the proxy config's own.",
    )
    parallel: int = Field(default=1, ge=1, description="Proxies training at the same time.")
    launch: dict[str, Any] | None = Field(
        default=None, description="Overrides of the proxy config's `launch:` for the proxies."
    )

    @field_validator("arms")
    @classmethod
    def _names(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name in v:
            if name == BASE:
                raise ValueError(f"`{BASE}` is the base config's own arm; name the arm otherwise")
            if not name or "/" in name or name.startswith("."):
                raise ValueError(f"arm name {name!r}: not a directory name")
        return v

    def out_dir(self) -> Path:
        return Path(self.out).resolve()

    def arm_dir(self, arm: str) -> Path:
        return self.out_dir() / "arms" / arm


def set_dotted(doc: dict[str, Any], key: str, value: Any) -> None:
    """`key` (a.b.c) set in nested dicts, creating them on the way."""
    *parents, last = key.split(".")
    node = doc
    for p in parents:
        child = node.get(p)
        if not isinstance(child, dict):
            child = node[p] = {}
        node = child
    node[last] = value


@dataclass(frozen=True)
class Ablation:
    cfg: AblationConfig
    path: str
    prep: dict[str, PrepConfig]  # arm -> its prep config (base first)
    proxy: dict[str, Any]  # the proxy training config's YAML data, overrides applied
    launch: LaunchConfig

    @property
    def arms(self) -> list[str]:
        return list(self.prep)

    def proxy_doc(self, arm: str, seed: int, dataset: str, seq_len: int) -> dict[str, Any]:
        """The training config of `arm`'s proxy with `seed` on `dataset`."""
        doc = copy.deepcopy(self.proxy)
        doc["dataset"] = dataset
        doc["run_dir"] = str(proxy_dir(self.cfg, arm, seed))
        doc["seed"] = seed
        doc.pop("launch", None)
        doc["steps"] = proxy_steps(self.cfg, parse_train_config(doc, f"(arm {arm})"), seq_len)
        if self.cfg.evals is not None:
            doc["evals"] = self.cfg.evals.model_dump(mode="json")
        # A proxy is a throwaway run: its checkpoints stay in its run dir.
        doc["checkpoint"] = {**(doc.get("checkpoint") or {}), "remote": None}
        return doc


def proxy_dir(cfg: AblationConfig, arm: str, seed: int) -> Path:
    return cfg.arm_dir(arm) / f"seed-{seed}"


def proxy_steps(cfg: AblationConfig, t: TrainConfig, seq_len: int) -> int:
    p = cfg.proxy
    if p.steps is not None:
        return p.steps
    assert p.tokens is not None
    return math.ceil(p.tokens / (t.micro_batch * t.accum_steps * seq_len))


def _one_line(e: ValidationError, where: str) -> str:
    head, *rows = format_validation_error(
        e, where, "ablation config", model=AblationConfig
    ).splitlines()
    return f"{head} " + "; ".join(r.strip() for r in rows)


def _flat(message: str) -> str:
    return " ".join(line.strip() for line in message.splitlines())


def load_ablation_config(path: str | Path) -> Ablation:
    where = str(path)
    data = read_yaml(path, ConfigError)
    if not isinstance(data, dict):
        raise AblationError(f"invalid ablation config {where}: expected a mapping")
    try:
        cfg = AblationConfig.model_validate(data)
    except ValidationError as e:
        raise AblationError(_one_line(e, where)) from None
    try:
        base = load_config(cfg.base)
    except ConfigError as e:
        raise AblationError(f"{where}: base: {_flat(str(e))}") from None
    base_doc = base.model_dump(mode="json", exclude={"version"})
    prep: dict[str, PrepConfig] = {}
    for arm, over in {BASE: {}, **cfg.arms}.items():
        doc = copy.deepcopy(base_doc)
        doc["output"] = str(cfg.arm_dir(arm) / "prep")
        for key, value in over.items():
            set_dotted(doc, key, value)
        try:
            prep[arm] = parse_config(doc, f"(arm {arm})")
        except ConfigError as e:
            raise AblationError(f"{where}: arms.{arm}: {_flat(str(e))}") from None
    try:
        proxy = read_train_doc(cfg.proxy.config)
    except ConfigError as e:
        raise AblationError(f"{where}: proxy.config: {_flat(str(e))}") from None
    proxy.setdefault("dataset", "-")
    for key, value in cfg.proxy.overrides.items():
        set_key(proxy, key, value)
    check = {k: v for k, v in proxy.items() if k != "launch"}
    if cfg.evals is not None:
        check["evals"] = cfg.evals.model_dump(mode="json")
    try:
        checked = parse_train_config(check, f"{where} (proxy)")
    except ConfigError as e:
        raise AblationError(f"{where}: proxy: {_flat(str(e))}") from None
    if cfg.evals is None and proxy.get("evals") is None:
        raise AblationError(
            f"{where}: evals: the proxies need an evals section (here or in {cfg.proxy.config})"
        )
    launch = parse_launch(proxy.get("launch"), cfg.launch, where)
    try:  # the proxies' mesh on their launch, before any arm is prepared
        fit_launch(checked.parallel, launch.nnodes, launch.nproc_per_node)
    except ConfigError as e:
        raise AblationError(f"{where}: proxy: {_flat(str(e))}") from None
    return Ablation(cfg, where, prep, proxy, launch)


def write_yaml(path: Path, doc: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path
