"""The whole prep with every native kernel on (quality chain, MinHash, BPE) and off
(BALLAST_NATIVE=0: the Python references) writes the same bytes, on the adversarial
corpus (broken records, odd Unicode, huge and empty documents) and on a corpus of
real web pages, through near dedup, the web quality chain, a trained BPE and packing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from tests.support import adversarial
from tests.support.adversarial import MAX_DOC_BYTES
from tests.support.helpers import SHARED

WEB = ["char_repetition", "length", "gopher_quality", "gopher_repetition", "c4", "fineweb"]
# What a run records about itself (ids, times, absolute paths): the rest must match.
VOLATILE = {"_run.json", "report.json"}


def prep(sources: list[dict], out: Path) -> dict[str, bytes]:
    cfg: dict[str, Any] = {
        "output": str(out),
        "workers": 1,
        "sources": sources,
        "ingest": {"max_doc_bytes": MAX_DOC_BYTES, "shard_docs": 64},
        "dedup": {"exact": True, "near": {"threshold": 0.7}},
        "quality": WEB,
        "tokenizer": {"kind": "bpe", "vocab_size": 600},
        "pack": {"seq_len": 64},
        "dataset": {"validation_fraction": 0.1, "pack_partitions": 2},
    }
    run_prep(parse_config(cfg), progress=False)
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name not in VOLATILE and "_versions" not in p.parts
    }


def assert_identical(sources: list[dict], tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BALLAST_NATIVE", "0")
    reference = prep(sources, tmp / "python")
    monkeypatch.setenv("BALLAST_NATIVE", "1")
    fast = prep(sources, tmp / "native")
    assert sorted(fast) == sorted(reference)
    differ = [k for k in reference if fast[k] != reference[k]]
    assert not differ, f"files differ: {differ[:8]}"
    # The comparison covered what each kernel writes.
    for part in ("near/sig", "docs/quality", "tokens"):
        assert any(part in k for k in reference), part


def test_adversarial_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tmp_path / "adv"
    data.mkdir()
    adversarial.write_corpus(data)
    assert_identical([adversarial.source(data)], tmp_path, monkeypatch)


WEB_FILES = (
    "web_openwebtext_1k.jsonl",
    "web_c4_olmo_fixtures.jsonl",
    "web_dolma_cc_fixtures.jsonl",
)


@pytest.mark.skipif(
    not all((SHARED / f).exists() for f in WEB_FILES), reason=f"no web corpora under {SHARED}"
)
def test_real_web_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A slice of each, so both runs stay a few seconds; documents as they are.
    data = tmp_path / "web.jsonl"
    with data.open("w", encoding="utf-8") as out:
        for name in WEB_FILES:
            for i, line in enumerate((SHARED / name).open(encoding="utf-8")):
                if i >= 300:
                    break
                out.write(json.dumps({"text": json.loads(line)["text"]}) + "\n")
    assert_identical([{"name": "web", "paths": [str(data)]}], tmp_path, monkeypatch)
