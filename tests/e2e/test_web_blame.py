"""`ballast blame` on a model trained from a WARC: the documents of a step, and the steps
of a document, are named by their archive, record offset and page URL."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tests.support.factories import train_config
from tests.support.helpers import run_cli
from tests.unit.dataprep.warc_files import Rec, page, write_warc

URLS = [f"https://docs.example/page/{i}" for i in range(6)]


def test_blame_names_the_page_url(tmp_path: Path) -> None:
    warc = tmp_path / "crawl.warc.gz"
    write_warc(warc, [Rec(u, page(f"Subject{i}", 150)) for i, u in enumerate(URLS)])
    (tmp_path / "prep.yaml").write_text(
        yaml.safe_dump(
            {
                "output": str(tmp_path / "prep"),
                "workers": 1,
                "sources": [{"name": "web", "paths": [str(warc)]}],
                "quality": ["url"],
                "pack": {"seq_len": 64},
            }
        )
    )
    r = run_cli("prep", str(tmp_path / "prep.yaml"), "--no-progress")
    assert r.returncode == 0, r.stderr
    cfg = train_config(
        str(tmp_path / "prep" / "dataset"), tmp_path / "run", micro_batch=2, eval_every=1000
    )
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(cfg))
    r = run_cli("train", str(tmp_path / "train.yaml"))
    assert r.returncode == 0, r.stderr[-2000:]

    r = run_cli("blame", str(tmp_path / "run"), "--step", "1", "--json")
    assert r.returncode == 0, r.stderr
    docs = [d for row in json.loads(r.stdout)["rows"] for d in row["documents"]]
    assert docs
    for d in docs:
        offset, _, url = d["path"].partition(" url=")
        assert offset.startswith(f"{warc}#offset=") and url in URLS, d["path"]
    text = run_cli("blame", str(tmp_path / "run"), "--step", "1")
    assert text.returncode == 0 and f"{docs[0]['path']}  source web" in text.stdout

    hits = json.loads(
        run_cli("blame", str(tmp_path / "run"), "--doc", docs[0]["id"], "--json").stdout
    )
    assert [d["path"] for d in hits["documents"]] == [docs[0]["path"]]
    assert 1 in {h["step"] for h in hits["steps"]}
