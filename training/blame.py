"""`ballast blame`: from a training step back to the documents it trained on, with their
sources, input locations and the quality statistics that kept them.

The data order is the trainer's own (training/data.py): step N trains on samples
[start, start + micro_batch * accum) of the training order; `Sampler.take` maps them to
dataset rows; micro-batch k is the k-th run of micro_batch of them, and under DDP rank r
takes its contiguous share of each (`distributed.rank_slice`). The dataset's provenance
(core/provenance.py) names the document pieces of each row. `start` comes from the
metrics log: every train record carries the sampler position after its step
(`samples_seen`), and the guard's events say which steps were skipped, which were rolled
back (their step numbers are reused by the timeline that follows) and where a recovery
moved the position. Nothing here re-implements the order: the sampler, the permutation and
the rank split are imported from the trainer.

Steps are numbered as the trainer numbers them everywhere: step N is the N-th optimizer
step (1-based), the one the console calls "step N/M", whose train record and guard events
say `"step": N`; checkpoint step-N (a rollback's `to_step`) is the state after it.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from core.dataset import not_a_dataset, read_manifest, resolve
from core.provenance import Document, Provenance, ProvenanceError
from training import checkpoint as ckpt
from training.config import TrainConfig, load_train_config
from training.data import Sampler, TrainData, dataset_cache, epoch_permutation, fetch_dataset
from training.metrics import read as read_metrics

# Documents a guard event names (those with the most tokens in its batch first): enough to
# point at a culprit, few enough for a log line; `ballast blame --event` lists them all.
EVENT_DOCS = 8


class BlameError(ValueError):
    """The run or its dataset cannot answer the question (one line, exit 1)."""


@dataclass
class Batch:
    """One step's samples of the training order."""

    step: int
    start: int  # its first sample's position in the training order
    samples: int  # micro_batch x accum
    accum: int
    skipped: str | None = None  # the guard's reason, when it skipped the step
    rolled_back: bool = False  # trained, then abandoned by a rollback or a recovery


@dataclass
class Event:
    """A guard event (skip, rollback, abort) and the batches it concerns: the skipped
    step's, or every step of a rollback's window (start_step..step, the last one the step
    that called it)."""

    record: dict[str, Any]
    batches: list[Batch]


@dataclass
class Timeline:
    """The run's steps as the metrics log tells them: `steps` are the final timeline's
    (what the weights were trained on, skipped steps included, marked); `abandoned` those
    a rollback or recovery threw away; `events` the guard's events in order."""

    micro_batch: int
    steps: dict[int, Batch] = field(default_factory=dict)
    abandoned: list[Batch] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    @classmethod
    def from_records(cls, records: Iterable[dict[str, Any]], micro_batch: int) -> Timeline:
        t = cls(micro_batch)
        skips: dict[int, dict[str, Any]] = {}  # skip events waiting for their train record
        for r in records:
            kind, ev = r.get("kind"), r.get("event")
            if kind == "train":
                if "samples_seen" not in r:
                    raise BlameError(
                        "the metrics log has no sampler positions (train records "
                        "without samples_seen: written by a ballast before "
                        "blame); blame cannot map its steps to data"
                    )
                n = int(r["step"])
                k = micro_batch * int(r["accum"])
                b = Batch(n, int(r["samples_seen"]) - k, k, int(r["accum"]))
                skip = skips.pop(n, None)
                if skip is not None:
                    b.skipped = str(skip.get("reason"))
                    t.events.append(Event(skip, [b]))
                t.steps[n] = b
            elif kind == "event" and ev == "skip":
                skips[int(r["step"])] = r
            elif kind == "event" and ev in ("rollback", "abort"):
                n = int(r["step"])
                div = t.steps.get(n)
                own = div is None
                if div is None:
                    # The guard's own call: the step was not applied and has no train
                    # record; its batch starts where the previous one ended, at the
                    # previous step's size.
                    prev = t.steps.get(n - 1)
                    accum = prev.accum if prev is not None else 1
                    div = Batch(n, t.position(n), micro_batch * accum, accum, rolled_back=True)
                # else: found after the step was counted (a non-finite validation loss or
                # weights): its train record is the batch.
                div.skipped = ev
                lo = int(r.get("start_step", n))
                window = [t.steps[j] for j in range(lo, n) if j in t.steps]
                t.events.append(Event(r, [*window, div]))
                if ev == "rollback":
                    t.abandon(int(r["to_step"]))
                    if own:
                        t.abandoned.append(div)
            elif kind == "event" and ev == "recovered":
                t.abandon(int(r["to_step"]))
            elif kind == "event" and ev == "resume":
                # The log was cut after the checkpoint's step: what follows it is redone.
                c = int(r["step"])
                t.abandon(c, keep=True)
                skips = {s: v for s, v in skips.items() if s <= c}
        for n, skip in sorted(skips.items()):  # a skip whose train record never came
            prev = t.steps.get(n - 1)
            accum = prev.accum if prev is not None else 1
            t.events.append(
                Event(
                    skip,
                    [
                        Batch(
                            n,
                            t.position(n),
                            micro_batch * accum,
                            accum,
                            skipped=str(skip.get("reason")),
                        )
                    ],
                )
            )
        return t

    def abandon(self, checkpoint: int, keep: bool = False) -> None:
        """The steps after checkpoint `checkpoint` (the state after that many steps) leave
        the timeline (rolled back, unless `keep`: a resume whose log was cut there)."""
        for n in [n for n in self.steps if n > checkpoint]:
            b = self.steps.pop(n)
            if not keep:
                b.rolled_back = True
                self.abandoned.append(b)

    def position(self, step: int) -> int:
        """The sampler position at the start of `step` on the current timeline."""
        if step <= 1:
            return 0
        prev = self.steps.get(step - 1)
        if prev is None:
            prev = self.batch(step - 1)
        return prev.start + prev.samples

    def batch(self, step: int) -> Batch:
        """Step `step`'s batch on the final timeline. A step without its own train record
        (log_every > 1) is placed between its logged neighbours when the batch size is
        the same throughout; otherwise it cannot be told and BlameError says so."""
        b = self.steps.get(step)
        if b is not None:
            return b
        known = sorted(self.steps)
        if not known or step < 1:
            raise BlameError(f"step {step} is not in the metrics log")
        j = bisect.bisect_left(known, step)
        if j == len(known):
            raise BlameError(f"step {step} was not trained: the run's last step is {known[-1]}")
        after = self.steps[known[j]]
        k = after.samples
        # The logged step before it (none: the run's start, position 0 after step 0).
        before = self.steps[known[j - 1]] if j else None
        lo_step = before.step if before is not None else 0
        lo_end = before.start + before.samples if before is not None else 0
        if (before is None or before.samples == k) and after.start - lo_end == (
            after.step - lo_step - 1
        ) * k:
            return Batch(step, lo_end + (step - lo_step - 1) * k, k, after.accum)
        raise BlameError(
            f"step {step} has no train record and the batch size changed "
            f"between steps {lo_step} and {after.step}: train with "
            "log_every: 1 to blame every step"
        )


def input_path(inputs: list[dict[str, Any]], source: str, location: str) -> str:
    """A document's location with its input's full URI (the manifest's `inputs` say where
    each source's relative path was read from): a.jsonl:12 -> s3://corpus/web/a.jsonl:12."""
    for inp in inputs:
        rel = str(inp.get("rel", ""))
        if (
            inp.get("source") == source
            and location.startswith(rel)
            and location[len(rel) : len(rel) + 1] in (":", "#")
        ):
            return f"{inp['uri']}{location[len(rel) :]}"
    return location


@dataclass
class BlameRun:
    """What blame needs from a run directory: its config, timeline, dataset provenance."""

    run_dir: Path
    cfg: TrainConfig
    timeline: Timeline
    prov: Provenance
    n_rows: int
    world_size: int = 1
    inputs: list[dict[str, Any]] = field(default_factory=list)  # the manifest's inputs

    def document(self, index: int) -> dict[str, Any]:
        d = self.prov.document(index).to_json()
        d["path"] = input_path(self.inputs, d["source"], d["location"])
        return d

    def sampler(self) -> Sampler:
        return Sampler(self.n_rows, self.cfg.seed, self.cfg.shuffle)

    def rows(self, b: Batch) -> np.ndarray:
        """The dataset rows of a batch, in the sampler's order (the trainer's own take)."""
        return self.sampler().take(b.start, b.samples)

    def describe(self, b: Batch) -> dict[str, Any]:
        mb = self.cfg.micro_batch
        per_rank = max(1, mb // self.world_size)
        out = []
        for j, row in enumerate(self.rows(b).tolist()):
            docs = []
            for sp in self.prov.spans("train", int(row)):
                docs.append({**self.document(sp.doc), "start": sp.start, "end": sp.end})
            out.append(
                {
                    "row": int(row),
                    "micro_batch": j // mb,
                    "rank": (j % mb) // per_rank,
                    "documents": docs,
                }
            )
        return {
            "step": b.step,
            "samples": [b.start, b.start + b.samples],
            "accum": b.accum,
            "skipped": b.skipped,
            "rolled_back": b.rolled_back,
            "rows": out,
        }

    def steps_with(self, doc_id: str) -> dict[str, Any]:
        """Every step that trained on a piece of the document(s) with id `doc_id`."""
        docs = self.prov.find(doc_id)
        if not docs:
            raise BlameError(f"no document with id {doc_id!r} in the dataset's provenance")
        rows = self.prov.rows_holding("train", docs)
        all_batches = [*self.timeline.steps.values(), *self.timeline.abandoned]
        hits: list[dict[str, Any]] = []
        if rows and all_batches:
            end = max(b.start + b.samples for b in all_batches)
            wanted = np.fromiter(rows, dtype=np.int64)
            positions: dict[int, int] = {}  # position in the training order -> row
            # The sampler's order, an epoch at a time (Sampler.take reads the same
            # permutations), searched for the rows instead of walked step by step.
            for e in range(-(-end // self.n_rows)):
                perm = (
                    epoch_permutation(self.n_rows, self.cfg.seed, e)
                    if self.cfg.shuffle
                    else np.arange(self.n_rows)
                )
                for p in np.flatnonzero(np.isin(perm, wanted)).tolist():
                    positions[e * self.n_rows + p] = int(perm[p])
            pos = sorted(positions)
            for b in sorted(all_batches, key=lambda b: (b.rolled_back, b.step)):
                lo = bisect.bisect_left(pos, b.start)
                hi = bisect.bisect_left(pos, b.start + b.samples)
                for p in pos[lo:hi]:
                    row = positions[p]
                    hits.append(
                        {
                            "step": b.step,
                            "row": row,
                            "micro_batch": (p - b.start) // self.cfg.micro_batch,
                            "skipped": b.skipped,
                            "rolled_back": b.rolled_back,
                            "pieces": [[s.start, s.end] for s in rows[row]],
                        }
                    )
        return {
            "id": doc_id,
            "documents": [self.document(d) for d in docs],
            "rows": sorted(rows),
            "steps": hits,
        }


def run_config(run_dir: Path, config: str | None = None) -> TrainConfig:
    """The run's training config: `config` if given, else final.json's, else the newest
    checkpoint's (a run that has not finished)."""
    if config is not None:
        return load_train_config(config)
    final = run_dir / "final.json"
    if final.is_file():
        return TrainConfig.model_validate(json.loads(final.read_text())["config"])
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise BlameError(f"{run_dir}: no metrics.jsonl (not a training run directory)")
    for d in (run_dir / "checkpoints", run_dir):
        steps = ckpt.steps(d) if d.is_dir() else []
        if steps:
            return TrainConfig.model_validate(ckpt.load(d, max(steps))["config"])
    raise BlameError(
        f"{run_dir}: no final.json and no checkpoint to read the training "
        "config from; pass --config"
    )


def local_dataset(uri: str) -> Path:
    uri = resolve(uri)
    if "://" in uri:
        return fetch_dataset(uri, dataset_cache())
    return Path(uri)


def run_world_size(run_dir: Path) -> int | None:
    """The ranks a finished run trained on (final.json), None when it does not say."""
    final = run_dir / "final.json"
    if not final.is_file():
        return None
    size = json.loads(final.read_text()).get("environment", {}).get("world_size")
    return int(size) if size else None


def open_run(
    run_dir: str | Path,
    config: str | None = None,
    dataset: str | None = None,
    world_size: int | None = None,
) -> BlameRun:
    """`world_size`: None takes the run's own (final.json), else 1."""
    rd = Path(run_dir)
    if not rd.is_dir():
        raise BlameError(f"{rd}: no such run directory")
    cfg = run_config(rd, config)
    if world_size is None:
        world_size = run_world_size(rd) or 1
    if not (rd / "metrics.jsonl").is_file():
        raise BlameError(f"{rd}: no metrics.jsonl (not a training run directory)")
    root = local_dataset(dataset or cfg.dataset)
    missing = not_a_dataset(str(root))
    if missing is not None:
        raise BlameError(f"{missing}; the run's dataset is gone? pass --dataset")
    manifest = read_manifest(str(root))
    try:
        prov = Provenance(root, manifest)
    except ProvenanceError as e:
        raise BlameError(str(e)) from None
    timeline = Timeline.from_records(read_metrics(rd / "metrics.jsonl"), cfg.micro_batch)
    return BlameRun(
        rd,
        cfg,
        timeline,
        prov,
        int(manifest["splits"]["train"]["rows"]),
        world_size,
        list(manifest.get("inputs", [])),
    )


def step_report(run: BlameRun, step: int) -> dict[str, Any]:
    """`--step N`: the batch step N (the N-th optimizer step) trained on (the final
    timeline's), and any batches the same step number had on timelines a rollback
    abandoned."""
    if step < 1:
        raise BlameError(
            f"--step {step}: steps count from 1 (step N is the N-th optimizer step, as the "
            "trainer's 'step N/M' lines and the metrics log number it)"
        )
    out = run.describe(run.timeline.batch(step))
    out["abandoned"] = [run.describe(b) for b in run.timeline.abandoned if b.step == step]
    return out


def events_report(run: BlameRun) -> list[dict[str, Any]]:
    """`--event`: every guard event with the batches it concerns."""
    return [
        {"event": e.record, "batches": [run.describe(b) for b in e.batches]}
        for e in run.timeline.events
    ]


def event_documents(data: TrainData) -> Callable[[list[str | int]], dict[str, Any]] | None:
    """For the guard (StabilityGuard's `describe`): the documents of an event's rows, those
    with the most tokens in them first, at most EVENT_DOCS; None for a dataset without
    provenance. A lookup that fails is reported in the event, never raised: the guard's
    decision matters more than its description."""
    if data.root is None:
        return None
    try:
        prov = Provenance(data.root, data.manifest)
    except ProvenanceError:
        return None

    def describe(ids: list[str | int]) -> dict[str, Any]:
        try:
            return documents_of(
                prov, [int(i) for i in ids], inputs=list(data.manifest.get("inputs", []))
            )
        except (ProvenanceError, OSError, ValueError, KeyError) as e:
            return {"documents_error": str(e)}

    return describe


def documents_of(
    prov: Provenance,
    rows: list[int],
    limit: int = EVENT_DOCS,
    inputs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    tokens: dict[int, int] = {}
    for r in rows:
        for sp in prov.spans("train", r):
            tokens[sp.doc] = tokens.get(sp.doc, 0) + sp.end - sp.start
    top = sorted(tokens.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]
    docs = []
    for d, n in top:
        doc: Document = prov.document(d)
        docs.append(
            {
                "doc": d,
                "id": doc.id,
                "source": doc.source,
                "location": doc.location,
                "path": input_path(inputs or [], doc.source, doc.location),
                "tokens": n,
            }
        )
    return {"documents": docs, "documents_total": len(tokens)}


# -- text output ------------------------------------------------------------------------


def _stats(stats: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in sorted(stats.items())) or "(none recorded)"


def batch_text(d: dict[str, Any], world_size: int = 1) -> list[str]:
    lo, hi = d["samples"]
    if d["skipped"] in ("rollback", "abort"):
        state = f"the step that called the {d['skipped']}"
    elif d["skipped"]:
        state = f"skipped by the guard: {d['skipped']}"
    elif d["rolled_back"]:
        state = "applied, then rolled back"
    else:
        state = "applied"
    lines = [
        f"step {d['step']}: samples {lo}..{hi} "
        f"of the training order, {hi - lo} rows (accum {d['accum']}); {state}"
    ]
    for r in d["rows"]:
        rank = f", rank {r['rank']}" if world_size > 1 else ""
        lines.append(f"  micro-batch {r['micro_batch']}{rank}: row {r['row']}")
        for doc in r["documents"]:
            lines.append(
                f"    {doc['path']}  source {doc['source']}  doc {doc['doc']}  "
                f"tokens {doc['start']}..{doc['end']}  (id {doc['id']})"
            )
            lines.append(f"      quality: {_stats(doc['stats'])}")
    return lines


def step_text(d: dict[str, Any], world_size: int = 1) -> list[str]:
    lines = batch_text(d, world_size)
    for a in d.get("abandoned", []):
        lines += [
            "",
            "the same step number on a timeline a rollback abandoned:",
            *batch_text(a, world_size),
        ]
    return lines


def events_text(events: list[dict[str, Any]], world_size: int = 1) -> list[str]:
    if not events:
        return ["no guard events in this run (no skipped step, no rollback)"]
    lines: list[str] = []
    for e in events:
        if lines:
            lines.append("")
        lines.append(event_header(e["event"]))
        for b in e["batches"]:
            lines += ["  " + ln for ln in batch_text(b, world_size)]
    return lines


def doc_text(d: dict[str, Any]) -> list[str]:
    lines = []
    for doc in d["documents"]:
        lines.append(f"{doc['path']}  source {doc['source']}  doc {doc['doc']}  (id {doc['id']})")
        lines.append(f"  quality: {_stats(doc['stats'])}")
    if not d["rows"]:
        lines.append("  not in the train split (validation, or left out by the mixture)")
    elif not d["steps"]:
        lines.append(f"  in train rows {d['rows'][:20]}, which no step has reached yet")
    for h in d["steps"]:
        state = (
            "skipped by the guard: " + h["skipped"]
            if h["skipped"]
            else "rolled back"
            if h["rolled_back"]
            else "applied"
        )
        pieces = ", ".join(f"{a}..{b}" for a, b in h["pieces"])
        lines.append(
            f"  step {h['step']}: row {h['row']} (micro-batch {h['micro_batch']}), "
            f"tokens {pieces}; {state}"
        )
    return lines


def event_header(r: dict[str, Any]) -> str:
    def num(key: str) -> str:
        v = r.get(key)
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    head = (
        f"{r.get('event')} at step {r.get('step')}: {r.get('reason')}, loss {num('loss')}"
        f" (z {num('loss_z')}), grad norm {num('grad_norm')} (z {num('grad_z')})"
    )
    if r.get("event") in ("rollback", "abort"):
        head += f"; window steps {r.get('start_step')}..{r.get('end_step')}" + (
            f", rolled back to checkpoint step {r['to_step']}" if "to_step" in r else ""
        )
    return head
