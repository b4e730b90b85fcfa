"""Dataset versions: how a run on an existing output takes in the data that arrived since.

An output is built in versions. Version 1 reads every input. A later run compares the
inputs with those the newest finished version read (dataprep/inputs.py):

- unchanged: nothing to do; the run says so and returns that version's report;
- new files, rows appended to a file: version N+1 reads only the new data, as new shards
  (units named vNNNN-uXXXXX). Its documents are deduplicated against themselves and against
  every document of the earlier versions it builds on: their exact hashes and MinHash
  signatures, kept in the output, are the index (datatrove's "dedup against an index").
  Quality and tokenization run on the new shards only; the mixture and packing are planned
  anew over all the version's documents;
- a file changed in the middle or removed: refused (InputsChanged), unless the run asks
  for a new version from scratch, which reads every current input and builds on nothing.

Records, under the output:
    _versions/vNNNN.plan.json   what version N reads (its units), written before any work
                                (a killed run resumes that same plan)
    _versions/vNNNN.json        version N is complete: its parent, the inputs it added, its
                                shards and the inventory of every input as of version N
    vNNNN/                      what version N computes over all of its documents (mixture,
                                packed rows, report.json)
    dataset/vNNNN/              its dataset
    dataset/latest              the newest version, written last
(An output made before version 1 had these directories holds version 1 at the roots
themselves, and keeps it there: dataprep/layout.py version_dir.)
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.dataset import LATEST
from core.store import Store, open_store
from dataprep.config import PrepConfig
from dataprep.formats import FORMATS, InputFile
from dataprep.inputs import (
    CurrentBytes,
    FileRecord,
    InputChanges,
    InputsChanged,
    check_inputs,
    compare_inputs,
    listed,
    marker_parts,
    read_inventory,
    with_parts,
)
from dataprep.layout import output_store, version_dir, version_name
from dataprep.stages import ingest
from dataprep.stages.dataset import dataset_root
from dataprep.stages.ingest import Unit

VERSIONS_PREFIX = "_versions/"
_RECORD = re.compile(r"^_versions/v(\d{4,})\.json$")
_CHUNK = 1 << 20


def record_key(version: int) -> str:
    return f"{VERSIONS_PREFIX}{version_name(version)}.json"


def plan_key(version: int) -> str:
    return f"{VERSIONS_PREFIX}{version_name(version)}.plan.json"


@dataclass
class Prepared:
    """What a run works on: the config of its version (cfg.version), the units it reads,
    the shards of earlier versions its documents are deduplicated against, and whether
    this run found anything new (False: it runs the newest version again, all done)."""

    cfg: PrepConfig
    units: list[Unit]
    prior: list[str] = field(default_factory=list)  # shard names
    parent: int | None = None
    prior_units: list[str] = field(default_factory=list)  # their unit names, for accounting
    added: list[dict[str, Any]] = field(default_factory=list)
    nothing_new: bool = False

    @property
    def version(self) -> int:
        return self.cfg.version


def finished_versions(store: Store) -> list[int]:
    return sorted(int(m.group(1)) for k in store.list(VERSIONS_PREFIX) if (m := _RECORD.match(k)))


def read_record(store: Store, version: int) -> dict[str, Any]:
    return json.loads(store.get(record_key(version)))


def lineage(store: Store, version: int, key: str) -> list[str]:
    """The `key` list ("shards", "units") of `version` and of every version it builds
    on, oldest first."""
    chain: list[list[str]] = []
    v: int | None = version
    while v is not None:
        rec = read_record(store, v)
        chain.append(rec[key])
        v = rec.get("parent")
    return [s for names in reversed(chain) for s in names]


def _appended(rec: FileRecord, now: InputFile, version: int) -> InputFile | None:
    """The part of a grown file that is new: the lines from the old end on, numbered on
    from the old last line. None when the growth cannot be read as appended records
    (not a plain line format, or the old end is not at a line start)."""
    fmt = FORMATS.get(rec.format)
    if fmt is None or fmt.parts != "bytes" or now.uri.startswith("s3://"):
        return None
    if now.uri.endswith((".gz", ".zst")):
        return None
    lines = 0
    with open(now.uri, "rb") as fh:
        pos = 0
        while pos < rec.size:
            block = fh.read(min(_CHUNK, rec.size - pos))
            if not block:
                return None
            lines += block.count(b"\n")
            pos += len(block)
            last = block[-1:]
    if rec.size and last != b"\n":
        return None  # the old last line was extended, not followed by new lines
    size = now.file_size if now.file_size is not None else now.size
    return dataclasses.replace(
        now,
        start=rec.size,
        end=None,
        row_groups=None,
        first_record=lines + 1,
        size=size - rec.size,
        file_size=size,
    )


def _new_units(
    units: Sequence[Unit], changes: InputChanges, recorded: Sequence[FileRecord], version: int
) -> tuple[list[Unit], list[dict[str, Any]], list[tuple[str, str]]]:
    """Units of `version`: the new files as planned, and the appended part of each grown
    file. Returns (units, what was added, grown files that cannot be read as appended)."""
    new, grown = set(changes.new), set(changes.grown)
    was = {r.key: r for r in recorded}
    picked: dict[tuple[str, str], list[InputFile]] = {}
    for u in units:
        for f in u.files:
            if (f.source, f.uri) in new or (f.source, f.uri) in grown:
                picked.setdefault((f.source, f.uri), []).append(f)
    out: list[Unit] = []
    added: list[dict[str, Any]] = []
    bad: list[tuple[str, str]] = []
    group: list[InputFile] = []  # new small files, read together as plan_units does

    def flush() -> None:
        if group:
            out.append(Unit(len(out), group[0].source, tuple(group), version))
            group.clear()

    for key, files in picked.items():
        if key in new:
            for f in files:
                alone = f.is_part or f.format == "hf"
                if alone or (
                    group
                    and (
                        group[0].source != f.source
                        or sum(g.size for g in group) + f.size > ingest.UNIT_BYTES
                    )
                ):
                    flush()
                if alone:
                    out.append(Unit(len(out), f.source, (f,), version))
                else:
                    group.append(f)
            added.append({"source": key[0], "uri": key[1], "kind": "new"})
            continue
        flush()
        part = _appended(was[key], files[0], version)
        if part is None:
            bad.append(key)
            continue
        out.append(Unit(len(out), part.source, (part,), version))
        added.append(
            {
                "source": key[0],
                "uri": key[1],
                "kind": "appended",
                "from_byte": part.start,
                "first_line": part.first_record,
            }
        )
    flush()
    return out, added, bad


def prepare_version(
    cfg: PrepConfig, units: list[Unit], log: Callable[[str], None], from_scratch: bool = False
) -> Prepared:
    """Decide what this run builds, once the output is claimed (see the module doc)."""
    store = output_store(cfg)
    files = [f for u in units for f in u.files]
    done = finished_versions(store)
    latest = max(done) if done else 0
    pending = plan_key(latest + 1)
    if store.exists(pending):
        plan = json.loads(store.get(pending))
        log(f"resuming version {version_name(latest + 1)} ({len(plan['units'])} units)")
        return _from_plan(cfg, plan)
    if not done:
        # Version 1, as every output began: all inputs (refused if they changed under a
        # run that did not finish).
        check_inputs(store, cfg, files, log)
        return Prepared(cfg, units)
    rec = read_record(store, latest)
    recorded = [FileRecord.from_json(d) for d in rec["inventory"]]
    current = listed(files)
    with CurrentBytes(cfg.storage) as read:  # the record holds the parts each version read
        changes = compare_inputs(recorded, current, read)
    vcfg = cfg.model_copy(update={"version": latest + 1})
    if changes.all_unchanged:
        log(
            f"inputs unchanged since version {version_name(latest)} ({len(current)} files): "
            "nothing new to take in"
        )
        # That version again: every step finds its work done; what runs is the report and
        # the cleanup of what a killed run may have left (temporary files, staging).
        again = (
            Prepared(cfg, units)
            if latest == 1
            else _from_plan(cfg, json.loads(store.get(plan_key(latest))))
        )
        again.nothing_new = True
        return again
    if changes.changed or changes.removed:
        if not from_scratch:
            raise InputsChanged(
                f"the inputs of {cfg.output} changed since version {version_name(latest)}: "
                f"{changes.describe()}; a version never changes: to build a new version "
                "from all current inputs instead, re-run with --from-scratch"
            )
        vunits = [dataclasses.replace(u, version=vcfg.version) for u in units]
        added = [{"source": f.source, "uri": f.uri, "kind": "from_scratch"} for f in current]
        prepared = Prepared(vcfg, vunits, added=added)
    else:
        vunits, added, bad = _new_units(units, changes, recorded, vcfg.version)
        if bad:
            names = ", ".join(k[1] for k in bad[:3])
            raise InputsChanged(
                f"the inputs of {cfg.output} changed since version {version_name(latest)}: "
                f"{len(bad)} grown but not by whole appended lines ({names}); to build a "
                "new version from all current inputs instead, re-run with --from-scratch"
            )
        prepared = Prepared(
            with_mode(vcfg, _mode(cfg, rec, log)),
            vunits,
            prior=lineage(store, latest, "shards"),
            parent=latest,
            added=added,
            prior_units=lineage(store, latest, "units"),
        )
    plan = {
        "version": vcfg.version,
        "parent": prepared.parent,
        "prior": prepared.prior,
        "prior_units": prepared.prior_units,
        "added": prepared.added,
        "versions": prepared.cfg.dataset.versions,
        "units": [u.to_json() for u in prepared.units],
        "inventory": [f.to_json() for f in current],
        "created": time.time(),
    }
    if not store.put_if_absent(pending, json.dumps(plan, indent=1).encode()):
        return _from_plan(cfg, json.loads(store.get(pending)))  # a racing run made it
    log(f"version {version_name(vcfg.version)}: {_added_line(prepared.added)}")
    return prepared


def _added_line(added: Sequence[dict[str, Any]]) -> str:
    kinds: dict[str, int] = {}
    for a in added:
        kinds[a["kind"]] = kinds.get(a["kind"], 0) + 1
    return ", ".join(f"{n} {k} file{'s' if n > 1 else ''}" for k, n in sorted(kinds.items()))


def with_mode(cfg: PrepConfig, mode: str) -> PrepConfig:
    """`cfg` building its version in `mode` (dataset.versions)."""
    if cfg.dataset.versions == mode:
        return cfg
    return cfg.model_copy(update={"dataset": cfg.dataset.model_copy(update={"versions": mode})})


def _mode(cfg: PrepConfig, parent: dict[str, Any], log: Callable[[str], None]) -> str:
    """How a new version builds on `parent` (its record): append needs the parent's
    dataset (its rows, its document index); a parent prepared `--until` an earlier stage
    has none, and the version is then planned whole."""
    if cfg.dataset.versions == "append" and not parent.get("dataset"):
        log(
            f"version {version_name(parent['version'])} has no dataset to append to: this "
            "version is mixed and packed whole"
        )
        return "whole"
    return cfg.dataset.versions


def _from_plan(cfg: PrepConfig, plan: dict[str, Any]) -> Prepared:
    # A version is finished in the mode it began in (dataset.versions is outside the
    # fingerprint: the config may have changed since); plans before the setting: whole.
    mode = plan.get("versions", "whole") if plan.get("parent") is not None else cfg.dataset.versions
    return Prepared(
        with_mode(cfg, mode).model_copy(update={"version": int(plan["version"])}),
        [Unit.from_json(u) for u in plan["units"]],
        prior=list(plan["prior"]),
        parent=plan.get("parent"),
        added=list(plan["added"]),
        prior_units=list(plan["prior_units"]),
    )


def finish_version(prepared: Prepared, shards: list[str], wrote_dataset: bool) -> None:
    """Record a complete version, then point `latest` at its dataset: last, so a reader
    never finds `latest` naming a version not yet complete."""
    cfg = prepared.cfg
    store = output_store(cfg)
    key = record_key(cfg.version)
    if store.exists(key):
        return
    if cfg.version == 1:
        files = read_inventory(store) or listed(f for u in prepared.units for f in u.files)
        inventory = with_parts(files, marker_parts(store))
    else:
        plan = json.loads(store.get(plan_key(cfg.version)))
        inventory = with_parts(
            [FileRecord.from_json(d) for d in plan["inventory"]], marker_parts(store)
        )
    record = {
        "version": cfg.version,
        "parent": prepared.parent,
        "added": prepared.added,
        "units": [u.name for u in prepared.units],
        "shards": shards,
        "inventory": [f.to_json() for f in inventory],
        "dataset": wrote_dataset,
        "finished": time.time(),
    }
    store.put(key, json.dumps(record, indent=1).encode())
    if wrote_dataset and (name := version_dir(cfg)):  # "": the root is version 1 itself
        open_store(dataset_root(cfg), cfg.storage).put(LATEST, f"{name}\n".encode())
