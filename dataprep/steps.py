"""The stage graph's building blocks (dataprep/graph.py has the graph itself, and says
what a stage and a step are): Run, what a run knows as it goes; Step; Stage; and the small
functions the graph and its partitioned steps (dataprep/graph_parts.py) share."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dataprep.config import PrepConfig
from dataprep.layout import output_store, version_store
from dataprep.stages import ingest
from dataprep.stages.ingest import Unit


@dataclass
class Run:
    """What a run knows as it goes: steps draw their items and inputs from it."""

    cfg: PrepConfig
    units: list[Unit]
    prev: str = ingest.STAGE  # the stage whose documents the next stage reads
    # The report's entries besides the accounting; the stages' summaries land here
    # (Stage.reports), "shards" and "inputs" among them.
    extra: dict[str, Any] = field(default_factory=dict)
    # The shards of the earlier dataset versions this version builds on (dataprep/versions.py):
    # new documents are deduplicated against them; the mixture and packing take them in.
    prior: list[str] = field(default_factory=list)
    prior_units: list[str] = field(default_factory=list)  # their ingest units

    @property
    def shards(self) -> list[str]:
        """This run's shards: those its units ingested."""
        return self.extra["shards"]

    @property
    def all_shards(self) -> list[str]:
        """Every shard of the version: the earlier versions' it builds on, then this run's."""
        return [*self.prior, *self.shards]

    @property
    def appends(self) -> bool:
        """This version mixes and packs its new documents only, after its parent's rows
        (dataset.versions: append)."""
        return bool(self.prior) and self.cfg.dataset.versions == "append"

    @property
    def mix_shards(self) -> list[str]:
        """The shards the version's mixture plans and packs: every shard of the version,
        or with `appends` this run's only."""
        return self.shards if self.appends else self.all_shards


def always(_cfg: PrepConfig) -> bool:
    return True


@dataclass(frozen=True)
class Step:
    # The step's name in progress bars, timings, failpoints ("near: signatures:3") and,
    # as "near-signatures", in task names.
    name: str
    fn: Callable[..., Any]
    # An item's output keys (one or several); all present = the item is done.
    done: Callable[[Any], str | tuple[str, ...]]
    # The items to map over; None: run once, with the list of every shard as the item.
    over: Callable[[Run], Sequence[Any]] | None = None
    # Run attributes passed after cfg and before the item: "prev", "shards".
    inputs: tuple[str, ...] = ()
    # The name shown when the config completes it, formatted with cfg ("pack: {cfg...}").
    label: str = ""
    # Its done keys are in the version's store (layout.version_store), not the output's:
    # a step over all of a version's documents, made anew for each version.
    versioned: bool = False
    # A run-once step's item: the shards the version's mixture covers (Run.mix_shards:
    # every shard of the version unless it appends), not this run's.
    all_versions: bool = False
    # (key, read): before the step's items are drawn, read(run) (which may open the
    # output: the flow runs it as a task) goes into run.extra[key], for `over` to use. A
    # stage's reports, read after its steps, may replace it.
    plan: tuple[str, Callable[[Run], Any]] | None = None
    # Whether the config runs this step (its stage being on): a stage's single-task and
    # partitioned forms of a step (max_task_memory) are two steps, one of them skipped.
    when: Callable[[PrepConfig], bool] = always
    # Rounds: after its items are done, the plan is read again and the items drawn again,
    # until there are none (an iteration whose length the data decides: near: components).
    repeat: bool = False

    def title(self, cfg: PrepConfig) -> str:
        return self.label.format(cfg=cfg) if self.label else self.name

    def args(self, run: Run) -> tuple[Any, ...]:
        return tuple(getattr(run, name) for name in self.inputs)

    def items(self, run: Run) -> list[Any]:
        if self.over is not None:
            return list(self.over(run))
        return [run.mix_shards if self.all_versions else run.shards]

    def is_done(self, cfg: PrepConfig, item: Any) -> bool:
        store = version_store(cfg) if self.versioned else output_store(cfg)
        keys = self.done(item)
        return all(store.exists(k) for k in ((keys,) if isinstance(keys, str) else keys))


def shards_of(run: Run) -> list[str]:
    return run.shards


def all_shards_of(run: Run) -> list[str]:
    return run.all_shards


def mix_shards_of(run: Run) -> list[str]:
    return run.mix_shards


@dataclass(frozen=True)
class Stage:
    name: str  # as `--until` names it
    steps: tuple[Step, ...]
    enabled: Callable[[PrepConfig], bool] = always
    # The names whose _done/<stage>/<name>.json hold the stage's document accounting;
    # the stage's documents are then what the next stage reads. None: the stage works on
    # rows, not documents, and is reported apart.
    accounting: Callable[[Run], list[str]] | None = shards_of
    # (key, read) each: read(run), once the steps are done, goes into the report under key.
    reports: tuple[tuple[str, Callable[[Run], Any]], ...] = ()
    # Its accounting markers are in the version's store (a stage over all of a version's
    # documents), not the output's.
    versioned: bool = False
    # The names of its accounting over every version the run builds on.
    accounting_all: Callable[[Run], list[str]] = all_shards_of
    # Its kept documents are text, in docs/<stage>/ (dataprep/layout.py), for the next such
    # stage to read; False for the stages after the text is gone (tokens, mixture, rows).
    docs: bool = True

    def all_versions(self, run: Run) -> list[str]:
        return self.accounting_all(run)


def item_name(item: Any) -> str:
    """A short name of a work item, for task names and logs."""
    if isinstance(item, str):
        return item
    if isinstance(item, Unit):
        return item.name
    return str(item[0]) if isinstance(item, list | tuple) and item else "all"


def fixed_key(key: str, _item: Any) -> str:
    return key
