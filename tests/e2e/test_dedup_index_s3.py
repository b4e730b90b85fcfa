"""Version 3 of an output on S3 (a real moto_server) looks its new documents up in the
dedup index by ranged reads (Store.get_range): it writes the files the same versions
write to a local directory, and fetches a small part of the index's files, not each file
whole. The versions append (dataset.versions: append): each takes its parent's dataset
files over by server-side copies (CopyObject), which keep their sha256 metadata."""

from __future__ import annotations

import hashlib
import json
import random
import uuid
from pathlib import Path
from typing import Any

import pytest

from core.dataset import verify
from core.store import open_store
from dataprep import dedup_index
from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from tests.e2e.test_dedup_index_versions import cfg, digests, grow, history, write_rows
from tests.support.moto import set_aws_env

PREFIX = "out/run"


def s3_digests(client: Any, bucket: str) -> dict[str, str]:
    """digests() of the output under s3://bucket/PREFIX, from the objects themselves."""
    out: dict[str, str] = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=PREFIX):
        for obj in page.get("Contents", []):
            body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            out[obj["Key"].removeprefix(PREFIX + "/")] = hashlib.sha256(body).hexdigest()
    return out


def index_bytes(client: Any, bucket: str, kind_prefix: str, versions: set[int]) -> int:
    """The listed sizes of the index runs of single `versions`, over the kinds that start
    with `kind_prefix` (`exact`, or `band` for every band's)."""
    runs = tuple(f"v{v:04d}-v{v:04d}-" for v in versions)
    total = 0
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=f"{PREFIX}/{dedup_index.INDEX}/{kind_prefix}"
    ):
        for obj in page.get("Contents", []):
            if obj["Key"].split("/")[-2].startswith(runs):
                total += int(obj["Size"])
    return total


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, moto_endpoint: str, s3_client: Any
) -> dict[str, Any]:
    """Versions 1 to 3 of the same inputs, output to a local directory and to S3."""
    root = tmp_path_factory.mktemp("index_s3")
    data = root / "data"
    data.mkdir()
    bucket = f"test-{uuid.uuid4().hex[:20]}"
    s3_client.create_bucket(Bucket=bucket)
    rng = random.Random(0)
    old = history(rng)
    write_rows(data / "a.jsonl", old)
    reports: dict[str, list[dict[str, Any]]] = {"local": [], "s3": []}
    with pytest.MonkeyPatch.context() as mp:
        set_aws_env(mp, moto_endpoint, root)
        mp.setenv(dedup_index.ENV, "1")
        # Block by block, as on local disk, so that the bytes compare with pread's; the
        # default hole (nearby blocks in one GET) is tests/unit/dataprep/
        # test_dedup_index_holes.py's.
        mp.setenv(dedup_index.HOLE_ENV, "0")
        for _ in grow(data, rng, old, 3):
            for form, out in (("local", str(root / "local")), ("s3", f"s3://{bucket}/{PREFIX}")):
                c = {**cfg(data, Path(".")), "output": out}
                c["dataset"] = {**c["dataset"], "versions": "append"}
                reports[form].append(run_prep(parse_config(c), progress=False))
        return {"root": root, "bucket": bucket, "reports": reports}


def test_the_s3_output_is_the_local_one(runs: dict[str, Any], s3_client: Any) -> None:
    local = digests(runs["root"] / "local")
    remote = s3_digests(s3_client, runs["bucket"])
    assert {k: remote.get(k) for k in local} == local
    assert any(k.startswith("exact/dups/v0003") for k in local)  # copies were found
    assert any(k.startswith("near/dups/v0003") for k in local)
    for form in ("local", "s3"):
        assert all(r["problems"] == [] for r in runs["reports"][form])
    m3 = json.loads((runs["root"] / "local" / "dataset" / "v0003" / "manifest.json").read_text())
    assert m3["appended_to"]["version"] == 2 and m3["appended_to"]["rows"]["train"] > 0
    assert verify(str(runs["root"] / "local" / "dataset" / "v0003")) == []


def test_lookups_on_s3_fetch_a_small_part_of_the_index(
    runs: dict[str, Any], s3_client: Any
) -> None:
    bucket = runs["bucket"]
    exact = runs["reports"]["s3"][2]["exact_index"]
    near = runs["reports"]["s3"][2]["near_index"]
    # Version 2 indexed version 1 from its hashes (bytes_read counts those too); version 3
    # only looks its keys up, in the runs of versions 1 and 2.
    assert exact["built_lazily"] == [] and exact["runs"] == 2 and exact["found"] >= 8
    assert near["built_lazily"] == [] and near["found"] >= 6
    # Reading those runs' files whole (what a store without ranged reads did) would fetch
    # their listed sizes.
    assert 0 < exact["bytes_read"] < index_bytes(s3_client, bucket, "exact", {1, 2}) / 4
    assert 0 < near["bytes_read"] < index_bytes(s3_client, bucket, "band", {1, 2}) / 4
    # The same blocks as on local disk: a ranged read fetches what pread reads.
    local = runs["reports"]["local"][2]
    assert exact["bytes_read"] == local["exact_index"]["bytes_read"]
    assert near["bytes_read"] == local["near_index"]["bytes_read"]
    assert open_store(f"s3://{bucket}/{PREFIX}").local_path("x") is None  # really remote


def test_carried_objects_keep_their_checksums(runs: dict[str, Any], s3_client: Any) -> None:
    """Each of version 3's files from version 1 carries the sha256 metadata that reads
    verify (S3Store.get), the same as the file it was copied from."""
    bucket = runs["bucket"]

    def manifest(v: str) -> dict[str, Any]:
        key = f"{PREFIX}/dataset/{v}/manifest.json"
        return json.loads(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read())

    m1, m3 = manifest("v0001"), manifest("v0003")
    old, new = m1["splits"]["train"]["files"], m3["splits"]["train"]["files"]
    assert len(new) > len(old)
    for a, b in zip(old, new, strict=False):
        head_a = s3_client.head_object(Bucket=bucket, Key=f"{PREFIX}/dataset/v0001/{a}")
        head_b = s3_client.head_object(Bucket=bucket, Key=f"{PREFIX}/dataset/v0003/{b}")
        assert head_b["Metadata"]["sha256"] == head_a["Metadata"]["sha256"]
        assert head_b["Metadata"]["sha256"] == m1["files"][a]["sha256"]
