"""The dataset contract between prep (which writes it) and training (which reads it): the
packed-row columns, manifest.json, and `verify`, which checks a prepared dataset against its
manifest and says exactly what does not match. The trainer refuses a dataset that does not
verify."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from core.files import sha256_file
from core.store import NotFound, StorageError, StorageOptions, open_store

MANIFEST = "manifest.json"
FORMAT = "ballast-dataset/1"
# A dataset root holds each version in vNNNN/ and `latest`, naming the newest ("v0002\n"),
# written last. A root made before versions had directories (prep's layout 3) holds
# version 1 itself, later versions beside it, and `latest` once there is one: a root
# without `latest` is such a version 1 (or holds no finished version).
LATEST = "latest"
_VERSION_DIR = re.compile(r"^v\d{4,}$")

# One packed row: seq_len tokens of one or more documents.
COLUMNS = ("input_ids", "position_ids", "segment_ids", "loss_mask")
COLUMN_DOCS = {
    "input_ids": "int32[seq_len]",
    "position_ids": "int32[seq_len], restart at 0 at every document",
    "segment_ids": "int32[seq_len], 1..k per document in the row, 0 on padding",
    "loss_mask": "int8[seq_len], 0 on padding",
}


def row_schema(seq_len: int) -> pa.Schema:
    """The Arrow schema of packed rows (fixed-size lists of seq_len)."""
    return pa.schema(
        [
            (name, pa.list_(pa.int8() if name == "loss_mask" else pa.int32(), seq_len))
            for name in COLUMNS
        ]
    )


def arrow_stats(path: Path) -> tuple[int, int]:
    """Rows and real (non-pad) tokens of one saved Arrow shard, batch by batch."""
    rows = real = 0
    with pa.memory_map(str(path)) as src:
        for batch in pa.ipc.open_stream(src):
            rows += batch.num_rows
            if batch.num_rows:
                mask = batch.column("loss_mask").flatten()
                real += int(pc.sum(mask.cast(pa.int64())).as_py() or 0)
    return rows, real


def is_version_key(key: str) -> bool:
    """A key of the versions beside a version 1 kept at its dataset root (a root made
    before versions had directories): not version 1's own."""
    return key == LATEST or bool(_VERSION_DIR.match(key.split("/", 1)[0]))


def resolve(uri: str, options: StorageOptions | None = None) -> str:
    """The newest version of the dataset at `uri`: the version `latest` names, else `uri`
    itself (a version's own directory, or a root made before versions had directories
    that holds only version 1)."""
    store = open_store(uri, options)
    try:
        name = store.get(LATEST).decode("utf-8").strip()
    except NotFound:
        return uri
    if not _VERSION_DIR.match(name):
        raise StorageError(f"{uri}/{LATEST} names no version: {name[:40]!r}")
    return f"{uri.rstrip('/')}/{name}"


def shown_path(uri: str) -> str:
    """`uri` as messages show it: a local path made absolute (a relative one is read from
    the working directory), a URL as it is."""
    return uri if "://" in uri else str(Path(uri).absolute())


def not_a_dataset(uri: str, options: StorageOptions | None = None) -> str | None:
    """None when `uri` holds a manifest.json, else one line saying what is there instead:
    no such directory, or no manifest, with the absolute path looked at, what a relative
    one was resolved against, and the dataset's place when `uri` is a prep output's root
    (its dataset is `<output>/dataset`)."""
    shown = shown_path(uri)
    against = (
        f" (resolved against {Path.cwd()})"
        if "://" not in uri and not Path(uri).is_absolute()
        else ""
    )
    if "://" not in uri:
        p = Path(uri)
        if (p / MANIFEST).is_file():
            return None
        if not p.exists():
            return f"{shown}: no such directory{against}"
        if not p.is_dir():
            return f"{shown}: a file, not a dataset directory{against}"
        sub = p / "dataset"
        prep_output = (sub / LATEST).is_file() or (sub / MANIFEST).is_file()
    else:
        store = open_store(uri, options)
        if store.exists(MANIFEST):
            return None
        prep_output = store.exists(f"dataset/{LATEST}") or store.exists(f"dataset/{MANIFEST}")
    hint = (
        f"; this is a prep output: its dataset is {shown.rstrip('/')}/dataset"
        if prep_output
        else " (not a ballast dataset, or an incomplete one)"
    )
    return f"{shown}: no {MANIFEST}{against}{hint}"


def verify(uri: str, options: StorageOptions | None = None, deep: bool = True) -> list[str]:
    """Every way the dataset at `uri` differs from its manifest (empty = it verifies):
    missing or unexpected files, sizes, sha256, rows and tokens per shard, the tokenizer,
    and (deep, for local datasets) that `datasets.load_from_disk` sees the same rows."""
    store = open_store(uri, options)
    try:
        manifest = json.loads(store.get(MANIFEST))
    except StorageError as e:
        try:
            missing = not_a_dataset(uri, options)
        except StorageError:
            missing = None
        return [missing or f"{uri}: cannot read {MANIFEST}: {e}"]
    except json.JSONDecodeError as e:
        return [f"{uri}/{MANIFEST} is not valid JSON: {e}"]
    if manifest.get("format") != FORMAT:
        return [f"{uri}/{MANIFEST}: format {manifest.get('format')!r}, expected {FORMAT!r}"]
    problems = []
    listed: dict[str, Any] = manifest.get("files", {})
    present = {k for k in store.list() if not is_version_key(k)} - {MANIFEST}
    root = store.local_path("")
    # Every file on disk, not only the keys a store lists: LocalStore.list() hides its
    # temporary names, and one of those here is the debris of a killed write.
    on_disk = (
        set()
        if root is None
        else {
            k
            for d, _, names in os.walk(root)
            for n in names
            if not is_version_key(k := Path(d, n).relative_to(root).as_posix())
        }
    )
    for rel in sorted(set(listed) - present):
        problems.append(f"missing file {rel}")
    for rel in sorted(present - set(listed)):
        problems.append(f"unexpected file {rel} (not in the manifest)")
    for rel in sorted(on_disk - present - {MANIFEST}):
        problems.append(
            f"unexpected file {rel} (not in the manifest; a temporary name: "
            "left by an interrupted write)"
        )
    with tempfile.TemporaryDirectory(prefix="ballast-verify-") as tmp:
        for rel in sorted(set(listed) & present):
            want = listed[rel]
            local = store.local_path(rel)
            if local is None:
                local = Path(tmp) / rel
                local.parent.mkdir(parents=True, exist_ok=True)
                store.get_file(rel, local)
            size = local.stat().st_size
            if size != want["bytes"]:
                problems.append(f"{rel}: {size} bytes, manifest says {want['bytes']}")
            digest = sha256_file(local)
            if digest != want["sha256"]:
                problems.append(
                    f"{rel}: sha256 {digest[:16]}..., manifest says {want['sha256'][:16]}..."
                )
                continue
            if rel.endswith(".arrow"):
                rows, real = arrow_stats(local)
                if rows != want.get("rows") or real != want.get("real_tokens"):
                    problems.append(
                        f"{rel}: {rows} rows / {real} real tokens, manifest says "
                        f"{want.get('rows')} / {want.get('real_tokens')}"
                    )
        tok = manifest.get("tokenizer", {})
        if tok.get("file") and listed.get(tok["file"], {}).get("sha256") != tok.get("sha256"):
            problems.append("tokenizer sha256 differs from its file entry")
    if deep and not problems and store.local_path("") is not None:
        from datasets import load_from_disk

        dd = load_from_disk(str(store.local_path("")))
        for name, split in manifest.get("splits", {}).items():
            if name not in dd:
                problems.append(
                    f"split {name} is in the manifest but load_from_disk does not find it"
                )
            elif dd[name].num_rows != split["rows"]:
                problems.append(
                    f"split {name}: load_from_disk gives {dd[name].num_rows} "
                    f"rows, manifest says {split['rows']}"
                )
    return problems


def read_manifest(uri: str, options: StorageOptions | None = None) -> dict[str, Any]:
    return json.loads(open_store(uri, options).get(MANIFEST))
