"""Line-level dedup within a source (the `lines` stage): real web pages with a planted
cookie banner in many of them and a navigation line in a few, run through run_prep."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from dataprep import graph
from dataprep.config import ConfigError, parse_config
from dataprep.pipeline import run_prep
from dataprep.stages import lines as lines_stage
from tests.support.helpers import read_jsonl, shared_file, write_jsonl

BANNER = "Accept cookies to continue browsing this website"
BANNER_2 = "Subscribe to our newsletter for the latest updates"
NAV = "Home | News | Sport | Weather | Contact us"
MAX_DOCS = 10
N_BANNER = 30  # web documents given the banner (more than MAX_DOCS)
N_NAV = 3  # web documents given the navigation line (not more than MAX_DOCS)


def make_corpus(root: Path) -> dict[str, Any]:
    """web: 50 real pages, 30 with the banner appended (two with extra spaces around it),
    3 with the navigation line, one page of nothing but banners; forum (no line dedup):
    15 real pages, every one with the banner."""
    pages = read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 65)
    web = []
    for k, r in enumerate(pages[:50]):
        text = r["text"]
        if k < N_BANNER:
            text += "\n" + (f"  {BANNER}  " if k in (1, 2) else BANNER) + "\n" + BANNER_2
        if 40 <= k < 40 + N_NAV:
            text = NAV + "\n" + text
        web.append({"id": f"web-{k}", "text": text})
    web.append({"id": "only-banners", "text": f"{BANNER}\n\n{BANNER_2}\n  {BANNER}\n"})
    write_jsonl(root / "web" / "web.jsonl", web)
    forum = [
        {"id": f"forum-{k}", "text": r["text"] + "\n" + BANNER} for k, r in enumerate(pages[50:65])
    ]
    write_jsonl(root / "forum" / "forum.jsonl", forum)
    return {"web": {r["id"]: r["text"] for r in web}, "forum": {r["id"]: r["text"] for r in forum}}


def config(data: Path, out: Path, workers: int = 1, line_dedup: bool = True) -> dict:
    web: dict[str, Any] = {"name": "web", "paths": [str(data / "web")], "id_field": "id"}
    if line_dedup:
        web["line_dedup"] = {"max_docs": MAX_DOCS, "min_line_chars": 20}
    return {
        "output": str(out),
        "workers": workers,
        "sources": [web, {"name": "forum", "paths": [str(data / "forum")], "id_field": "id"}],
        "ingest": {"shard_docs": 20},
        "quality": ["length"],
        "pack": {"seq_len": 256, "window": 200},
        "dataset": {"validation_fraction": 0.05, "train_shards": 1, "pack_partitions": 2},
    }


def prep(cfg: dict[str, Any]) -> dict[str, Any]:
    return run_prep(parse_config(cfg), progress=False)


def docs(out: Path, stage: str) -> dict[str, str]:
    found: dict[str, str] = {}
    for f in sorted((out / "docs" / stage).glob("*.parquet")):
        for r in pq.read_table(f, columns=["id", "text"]).to_pylist():
            found[r["id"]] = r["text"]
    return found


def dropped(out: Path, stage: str) -> list[dict[str, Any]]:
    return [
        r
        for f in sorted((out / "dropped" / stage).glob("*.parquet"))
        for r in pq.read_table(f).to_pylist()
    ]


# Files that differ between two identical runs: the claim's run id, the version record's
# finish time, the report's timings (the report is compared without them).
VARIES = {"_run.json", "v0001.json", "report.json"}


def snapshot(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name not in VARIES
    }


def stable_report(out: Path) -> dict[str, Any]:
    report = json.loads((out / "v0001" / "report.json").read_text())
    for k in ("stage_seconds", "step_seconds", "step_epoch_seconds"):
        report.pop(k)
    report["dataset"].pop("uri")  # the output's own path
    return report


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    data = tmp_path_factory.mktemp("lines-data")
    return data, make_corpus(data)


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    data, _ = corpus
    out = tmp_path_factory.mktemp("lines-out") / "run"
    return out, prep(config(data, out))


def test_common_lines_are_removed_rare_lines_kept(corpus, run) -> None:
    _, planted = corpus
    out, _ = run
    kept = docs(out, "lines")
    web = {i: t for i, t in kept.items() if i.startswith("web-")}
    assert len(web) == 50
    for i, text in web.items():
        lines = [" ".join(line.split()) for line in text.split("\n")]
        assert BANNER not in lines and BANNER_2 not in lines, i
        before = planted["web"][i]
        # Only the common lines went; every other line is kept byte for byte.
        assert text.split("\n") == [
            line for line in before.split("\n") if " ".join(line.split()) not in (BANNER, BANNER_2)
        ]
    assert sum(text.startswith(NAV + "\n") for text in web.values()) == N_NAV
    # The source without line_dedup keeps its banner, though every document has it.
    forum = {i: t for i, t in kept.items() if i.startswith("forum-")}
    assert forum == planted["forum"]
    # What quality read is what lines kept.
    assert set(docs(out, "quality")) <= set(kept)


def test_a_document_of_only_common_lines_is_dropped(run) -> None:
    out, _ = run
    rows = dropped(out, "lines")
    assert [(r["id"], r["reason"], r["source"]) for r in rows] == [
        ("only-banners", "lines:empty", "web")
    ]
    assert rows[0]["detail"] == "3 common lines removed"
    assert rows[0]["location"]  # where it came from, as every stage's drops say
    assert rows[0]["text"].startswith(BANNER)


def test_counts_add_up_in_the_report(run) -> None:
    _, report = run
    stages = report["stages"]
    assert list(stages)[:4] == ["ingest", "exact", "near", "lines"]
    assert list(stages)[4] == "quality"
    lines = stages["lines"]
    assert lines["total"]["docs_in"] == stages["near"]["total"]["kept"] == 66
    web = lines["sources"]["web"]
    assert (web["docs_in"], web["kept"], web["dropped"]) == (51, 50, {"lines:empty": 1})
    assert lines["sources"]["forum"]["kept"] == lines["sources"]["forum"]["docs_in"] == 15
    assert stages["quality"]["total"]["docs_in"] == lines["total"]["kept"]
    assert web["bytes_in"] > web["bytes_kept"] + web["bytes_dropped"]  # lines went
    assert report["problems"] == []
    # Two common lines of web; 2 x 30 removed plus the three of the dropped document.
    assert report["lines"] == {
        "common_lines": {"web": 2},
        "lines_removed": {"web": 2 * N_BANNER + 3},
    }


def test_select_in_passes_finds_the_same_lines(
    corpus, run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A corpus larger than one pass is counted in passes by hash value, with the same
    result: a line's documents all fall in one pass."""
    out, report = run
    copy = tmp_path / "run"
    shutil.copytree(out, copy)
    cfg = parse_config(config(corpus[0], copy))
    monkeypatch.setattr(lines_stage, "PASS_LINES", 100)  # 866 entries: 9 passes
    assert lines_stage.select(cfg, [], report["shards"]) == 2
    common = Path("v0001") / lines_stage.COMMON_KEY
    assert (copy / common).read_bytes() == (out / common).read_bytes()
    assert np.load(copy / common).shape == (2, 2)


def test_output_is_the_same_with_one_or_two_workers(corpus, run, tmp_path: Path) -> None:
    data, _ = corpus
    out1, _ = run
    out2 = tmp_path / "run2"
    prep(config(data, out2, workers=2))
    assert snapshot(out2) == snapshot(out1)
    assert stable_report(out2) == stable_report(out1)


def test_a_config_without_line_dedup_runs_as_before(
    corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stage is off: the output is file for file what a ballast without the stage
    makes, and the config fingerprints as before (an existing output stays claimed)."""
    data, _ = corpus
    cfg = config(data, tmp_path / "with", line_dedup=False)
    assert all("line_dedup" not in s for s in parse_config(cfg).model_dump()["sources"])
    report = prep(cfg)
    assert "lines" not in report["stages"] and "lines" not in report
    assert not (tmp_path / "with" / "lines").exists()
    assert not (tmp_path / "with" / "docs" / "lines").exists()
    monkeypatch.setattr(graph, "STAGES", [s for s in graph.STAGES if s.name != "lines"])
    prep(config(data, tmp_path / "without", line_dedup=False))
    assert snapshot(tmp_path / "with") == snapshot(tmp_path / "without")
    assert stable_report(tmp_path / "with") == stable_report(tmp_path / "without")


def test_a_later_version_counts_the_earlier_documents(corpus, tmp_path: Path) -> None:
    """Version 2's documents are counted with version 1's: a line in 3 old and 9 new
    documents is common, and goes from the new ones; the old ones keep it."""
    data = tmp_path / "data"
    shutil.copytree(corpus[0], data)
    out = tmp_path / "out"
    cfg = config(data, out)
    prep(cfg)
    pages = read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 74)[65:]
    write_jsonl(
        data / "web" / "added.jsonl",
        [{"id": f"new-{k}", "text": f"{NAV}\n{r['text']}"} for k, r in enumerate(pages)],
    )
    report = prep(cfg)
    assert report["version"]["version"] == 2
    assert report["lines"]["common_lines"] == {"web": 3}
    assert report["lines"]["lines_removed"] == {"web": 9}
    new = {i: t for i, t in docs(out, "lines").items() if i.startswith("new-")}
    assert len(new) == 9 and not any(NAV in t for t in new.values())
    old = docs(out, "lines")
    assert sum(t.startswith(NAV + "\n") for t in old.values()) == N_NAV


def test_bad_line_dedup_values_name_the_key(tmp_path: Path) -> None:
    def error(line_dedup: Any) -> str:
        cfg = config(tmp_path, tmp_path / "out")
        cfg["sources"][0]["line_dedup"] = line_dedup
        with pytest.raises(ConfigError) as e:
            parse_config(cfg)
        return str(e.value)

    assert (
        "sources[0].line_dedup.max_docs: Input should be greater than or equal to 1 "
        "(got 0)" in error({"max_docs": 0})
    )
    assert "sources[0].line_dedup.min_line_chars" in error(
        {"max_docs": 5, "min_line_chars": "long"}
    )
    assert "sources[0].line_dedup.max_doc: unknown key" in error({"max_doc": 5})
    assert "sources[0].line_dedup.max_docs: required key is missing" in error({})
