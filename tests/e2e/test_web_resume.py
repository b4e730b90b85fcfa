"""`ballast prep` over web archives, SIGKILLed (the whole process group: the CLI, its
workers and their extraction helpers) in the middle of ingest, then run again: the output
is byte for byte that of a run never interrupted."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.support.helpers import ROOT, cli_env
from tests.unit.dataprep.warc_files import Rec, crawl, page, write_warc

SOURCES = 4  # a source is a unit: four units for two workers
PAGES = 150  # a source's pages: a unit takes a second or more to extract


def _data(root: Path) -> list[Path]:
    paths = []
    for s in range(SOURCES):
        recs = crawl() if s == 0 else []
        # Long pages; sources 0 and 2 (and 1 and 3) hold the same pages under other URLs
        # (exact duplicates across sources), and every fifth page is a near copy of the
        # one before it.
        for i in range(PAGES):
            if i % 5 == 4:
                body = page(f"S{s % 2}P{i - 1}", 1500).replace(b"more to say", b"more to tell")
            else:
                body = page(f"S{s % 2}P{i}", words=1500)
            recs.append(Rec(f"https://s{s}.example/{i}", body))
        p = root / (f"crawl{s}.warc.gz" if s % 2 == 0 else f"crawl{s}.warc")
        write_warc(p, recs, gzip=s % 2 == 0)
        paths.append(p)
    return paths


def _config(tmp: Path, data: list[Path], name: str) -> Path:
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "output": str(tmp / name),
                "workers": 2,
                "sources": [{"name": f"web{i}", "paths": [str(p)]} for i, p in enumerate(data)],
                "ingest": {"shard_docs": 40, "extract": {"timeout_s": 60}},
                "dedup": {"exact": True, "near": {"threshold": 0.8}},
                "quality": ["url", {"length": {"min_chars": 100}}],
                "pack": {"seq_len": 128},
            }
        )
    )
    return cfg


def _prep(cfg: Path, **popen: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "cli.main", "prep", str(cfg), "--no-progress"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=cli_env(),
        **popen,  # type: ignore[arg-type]
    )


def _files(root: Path) -> dict[str, bytes]:
    """Every data file of a prep output, by path: stage shards and dropped rows, the
    dataset; not the run's bookkeeping (timings, the claim, the inputs' mtimes)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and (rel.endswith(".parquet") or rel.startswith("dataset/")):
            out[rel] = p.read_bytes()
    return out


def _report(root: Path) -> dict:
    r = json.loads((root / "v0001" / "report.json").read_text())
    return {k: v for k, v in r.items() if not k.endswith("_seconds") and k != "dataset"}


def test_killed_in_ingest_resumes_to_identical_output(tmp_path: Path) -> None:
    data = _data(tmp_path)
    ref = _prep(_config(tmp_path, data, "ref"))
    assert ref.wait(timeout=600) == 0, ref.stderr.read().decode()[-3000:] if ref.stderr else ""

    out = tmp_path / "killed"
    done = out / "_done" / "ingest"
    proc = _prep(_config(tmp_path, data, "killed"), start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (done.is_dir() and any(done.glob("*.json"))):
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "no ingest unit finished in 300 s"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)  # the CLI, its workers, their helpers
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    finished = sorted(p.name for p in done.glob("*.json"))
    assert 1 <= len(finished) < SOURCES, f"not killed in the middle of ingest: {finished}"
    assert not (out / "v0001" / "report.json").exists()

    again = _prep(tmp_path / "killed.yaml")
    _, err = again.communicate(timeout=600)
    assert again.returncode == 0, err.decode()[-3000:]
    want, got = _files(tmp_path / "ref"), _files(out)
    assert sorted(got) == sorted(want)
    assert [f for f in want if want[f] != got[f]] == []
    # The run did dedup (and the files compared hold it).
    assert any(f.startswith("dropped/exact/") for f in want)
    assert any(f.startswith("dropped/near/") for f in want)
    assert _report(out) == _report(tmp_path / "ref")
    ingest = _report(out)["stages"]["ingest"]["total"]
    assert ingest["docs_in"] == SOURCES * (1 + PAGES) + len(crawl())  # warcinfo each
