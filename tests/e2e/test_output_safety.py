"""Issue 11, prep items 6-8: what a prep run leaves in its output, and who may claim it.

6. Two runs with different configs racing for one output: exactly one claims it, the other
   gets OutputConflict (locally and on S3: the claim is an atomic create-if-absent).
7. Debris of a killed dataset write: `verify` names every file the manifest does not list
   (hidden temporaries included), the next run removes stale temporaries, and the dataset
   step stages nothing under $TMPDIR.
8. Output files follow the umask (not mkstemp's 0600).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from core.dataset import verify
from core.s3 import S3Store
from core.store import LocalStore, StorageOptions, Store
from dataprep.config import parse_config
from dataprep.driver import RUN_KEY
from dataprep.pipeline import run_prep
from dataprep.stages import dataset
from tests.support.helpers import ROOT, read_jsonl, shared_file, write_jsonl


def _current_umask() -> int:
    # Read from /proc (no process-global umask() flip in the test process).
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise RuntimeError("no Umask line in /proc/self/status")


# -- item 6: one claim per output -------------------------------------------------------


def _claim_cfg(uri: str, seed: int) -> dict[str, Any]:
    # claim_output reads nothing but the config: the input need not exist.
    return {
        "output": uri,
        "seed": seed,
        "sources": [{"name": "web", "paths": ["/nonexistent/web.jsonl"]}],
    }


def _claimer(seed: int, jobs: Any, results: Any, barrier: Any) -> None:
    """One racer: for each output URI it is sent, open the store, wait for the other racer,
    then claim the output with its own config (seed differs per racer)."""
    from core.store import open_store
    from dataprep.driver import OutputConflict, claim_output

    while (uri := jobs.get()) is not None:
        cfg = parse_config(_claim_cfg(uri, seed))
        store = open_store(uri)
        try:
            barrier.wait(timeout=120)
            claim_output(store, cfg)
            results.put((seed, "won", cfg.fingerprint()))
        except OutputConflict as e:
            results.put((seed, "conflict", str(e)))
        except Exception as e:  # reported to the test, which fails on it
            results.put((seed, "error", repr(e)))


def race(uris: list[str]) -> list[list[tuple[int, str, str]]]:
    """Two processes (spawned once) claim each of `uris` at the same moment."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    jobs = [ctx.Queue(), ctx.Queue()]
    procs = [
        ctx.Process(target=_claimer, args=(seed, q, results, barrier), daemon=True)
        for seed, q in zip((1, 2), jobs, strict=True)
    ]
    for p in procs:
        p.start()
    rounds = []
    try:
        for uri in uris:
            for q in jobs:
                q.put(uri)
            rounds.append(sorted([results.get(timeout=300), results.get(timeout=300)]))
        for q in jobs:
            q.put(None)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return rounds


def check_rounds(rounds: list[list[tuple[int, str, str]]], read_run: Any) -> None:
    both_won = 0
    for k, outcome in enumerate(rounds):
        assert not [o for o in outcome if o[1] == "error"], outcome
        won = [o for o in outcome if o[1] == "won"]
        lost = [o for o in outcome if o[1] == "conflict"]
        if len(won) == 2:
            both_won += 1
            continue
        assert len(won) == 1 and len(lost) == 1, outcome
        msg = lost[0][2]
        assert "different config" in msg and "\n" not in msg, msg
        assert won[0][2] in msg  # the loser names the winner's fingerprint
        assert json.loads(read_run(k))["config_fingerprint"] == won[0][2]
    assert both_won == 0, f"both configs claimed the same output in {both_won} of {len(rounds)}"


def test_racing_claims_local_exactly_one_wins(tmp_path: Path) -> None:
    outs = [tmp_path / f"out{k}" for k in range(300)]
    rounds = race([str(o) for o in outs])
    check_rounds(rounds, lambda k: (outs[k] / RUN_KEY).read_text())
    for o in outs:  # no temporary left next to the claim
        assert sorted(p.name for p in o.iterdir()) == [RUN_KEY]


def test_racing_claims_s3_exactly_one_wins(
    moto_endpoint: str, s3_bucket: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)  # inherited by the racers
    keys = [f"out{k}" for k in range(20)]
    rounds = race([f"s3://{s3_bucket}/{k}" for k in keys])
    check_rounds(
        rounds,
        lambda k: s3_client.get_object(Bucket=s3_bucket, Key=f"{keys[k]}/{RUN_KEY}")["Body"].read(),
    )


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    endpoint: str = request.getfixturevalue("moto_endpoint")
    bucket: str = request.getfixturevalue("s3_bucket")
    return S3Store(f"s3://{bucket}/p", StorageOptions(endpoint_url=endpoint))


def test_put_if_absent(store: Store, tmp_path: Path) -> None:
    assert store.put_if_absent("a/claim.json", b"first") is True
    assert store.put_if_absent("a/claim.json", b"second") is False
    assert store.get("a/claim.json") == b"first"
    assert store.list() == ["a/claim.json"]
    local = store.local_path("a")
    if local is not None:
        assert sorted(p.name for p in local.iterdir()) == ["claim.json"]  # no temporaries
        assert stat.S_IMODE((local / "claim.json").stat().st_mode) == 0o666 & ~_current_umask()


# -- a small prep, all the way to the dataset -------------------------------------------


def prep_cfg(data: Path, out: Path) -> dict[str, Any]:
    return {
        "output": str(out),
        "workers": 1,
        "seed": 5,
        "sources": [{"name": "web", "paths": [str(data / "web.jsonl")], "id_field": "id"}],
        "ingest": {"shard_docs": 40},
        "dedup": {"exact": True, "near": False},
        "quality": [],
        "pack": {"seq_len": 128},
        "dataset": {"validation_fraction": 0.1, "train_shards": 2, "pack_partitions": 2},
    }


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("safety-data")
    web = read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 80)
    write_jsonl(root / "web.jsonl", [{"id": r["id"], "text": r["text"]} for r in web])
    return root


@pytest.fixture(scope="module")
def built(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("safety-out") / "run"
    run_prep(parse_config(prep_cfg(data, out)), progress=False)
    return out


def killed_in_dataset_step(built: Path, dest: Path) -> Path:
    """A copy of `built` as a run killed while writing the dataset leaves it: no manifest,
    a half-written shard under a temporary name, a stale staging directory."""
    shutil.copytree(built, dest)
    ds = dest / "dataset" / "v0001"
    (ds / "manifest.json").unlink()
    (ds / "train" / ".data-00001-of-00002.arrow.k2x9qz1f.tmp").write_bytes(b"x" * 99)
    (ds / ".tokenizer.json.a8b7c6d5.tmp").write_bytes(b"{")
    return dest


# -- item 7: debris ---------------------------------------------------------------------


def test_verify_names_a_stale_temporary_file(built: Path, tmp_path: Path) -> None:
    copy = tmp_path / "dataset"
    shutil.copytree(built / "dataset" / "v0001", copy)
    assert verify(str(copy)) == []
    stale = copy / "train" / ".data-00000-of-00002.arrow.q1w2e3r4.tmp"
    stale.write_bytes(b"half a shard")
    (copy / "validation" / "notes.txt").write_text("not in the manifest")
    text = "\n".join(verify(str(copy)))
    assert "train/.data-00000-of-00002.arrow.q1w2e3r4.tmp" in text
    assert "validation/notes.txt" in text

    r = subprocess.run(
        [sys.executable, "-m", "cli.main", "verify", str(copy)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 1
    assert "train/.data-00000-of-00002.arrow.q1w2e3r4.tmp" in r.stderr


def test_rerun_removes_stale_temporary_files(built: Path, data: Path, tmp_path: Path) -> None:
    out = killed_in_dataset_step(built, tmp_path / "run")
    keep = out / "dataset" / "v0001" / "train" / ".keep"  # hidden, but not a temporary name
    keep.write_text("")
    run_prep(parse_config(prep_cfg(data, out)), progress=False)
    left = sorted(
        p.relative_to(out / "dataset" / "v0001").as_posix()
        for p in (out / "dataset" / "v0001").rglob("*")
        if p.name.endswith(".tmp")
    )
    assert left == []
    assert keep.exists()
    keep.unlink()
    assert verify(str(out / "dataset" / "v0001")) == []


def test_a_stale_temporary_in_a_finished_dataset_is_removed(
    built: Path, data: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    shutil.copytree(built, out)
    stale = out / "dataset" / "v0001" / "validation" / ".data-00000-of-00001.arrow.zz99yy88.tmp"
    stale.write_bytes(b"x")
    run_prep(parse_config(prep_cfg(data, out)), progress=False)
    assert not stale.exists()
    assert verify(str(out / "dataset" / "v0001")) == []


def test_dataset_step_stages_nothing_under_tmpdir(
    built: Path, data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    out = killed_in_dataset_step(built, tmp_path / "run")
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmpdir))
    monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
    seen: list[list[str]] = []
    write_split = dataset.write_split

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(sorted(os.listdir(tmpdir)))  # while the dataset is being written
        return write_split(*args, **kwargs)

    monkeypatch.setattr(dataset, "write_split", spy)
    run_prep(parse_config(prep_cfg(data, out)), progress=False)
    assert len(seen) == 2  # train and validation
    assert seen == [[], []]
    assert os.listdir(tmpdir) == []
    assert not (out / "_scratch").exists()  # the run's own scratch is gone when it is done
    assert verify(str(out / "dataset" / "v0001")) == []


def test_stale_staging_of_a_killed_run_is_removed(built: Path, data: Path, tmp_path: Path) -> None:
    out = killed_in_dataset_step(built, tmp_path / "run")
    leftover = out / dataset.SCRATCH_DIR / "dataset-v0001" / "part.parquet"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"x" * 1000)
    run_prep(parse_config(prep_cfg(data, out)), progress=False)
    assert not (out / dataset.SCRATCH_DIR).exists()


def test_scratch_is_the_outputs_own(
    tmp_path: Path, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    local = parse_config(_claim_cfg(str(tmp_path / "out"), 1))
    assert dataset.scratch_dir(local) == tmp_path / "out" / dataset.SCRATCH_DIR / "dataset"
    monkeypatch.setenv("BALLAST_SCRATCH", str(tmp_path / "scratch"))
    a, b = (parse_config(_claim_cfg(f"s3://bucket/{k}", 1)) for k in ("a", "b"))
    sa, sb = dataset.scratch_dir(a), dataset.scratch_dir(b)
    assert sa.parent.parent == sb.parent.parent == tmp_path / "scratch" and sa != sb


# -- item 8: modes ----------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_output_files_follow_the_umask(data: Path, tmp_path: Path, umask: int) -> None:
    import yaml

    out = tmp_path / "run"
    cfg = tmp_path / "prep.yaml"
    cfg.write_text(yaml.safe_dump(prep_cfg(data, out)))
    r = subprocess.run(
        [sys.executable, "-m", "cli.main", "prep", str(cfg), "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        umask=umask,
    )
    assert r.returncode == 0, r.stderr
    wrong = {}
    for p in [out, *out.rglob("*")]:
        want = (0o777 if p.is_dir() else 0o666) & ~umask
        mode = stat.S_IMODE(p.stat().st_mode)
        if mode != want:
            wrong[p.relative_to(out).as_posix()] = oct(mode)
    assert (out / "dataset" / "v0001" / "manifest.json").is_file()
    assert wrong == {}, f"want {oct(0o666 & ~umask)} (files): {wrong}"


def test_store_writes_follow_the_umask(tmp_path: Path) -> None:
    want = 0o666 & ~_current_umask()
    store = LocalStore(tmp_path / "s")
    store.put("a/b.json", b"{}")
    src = tmp_path / "src.bin"
    src.write_bytes(b"data")
    os.chmod(src, 0o600)  # the copy follows the umask, not the source's mode
    store.put_file("a/c.bin", src)
    for key in ("a/b.json", "a/c.bin"):
        assert stat.S_IMODE((tmp_path / "s" / key).stat().st_mode) == want, key


def test_s3_download_follows_the_umask(moto_endpoint: str, s3_bucket: str, tmp_path: Path) -> None:
    store = S3Store(f"s3://{s3_bucket}/p", StorageOptions(endpoint_url=moto_endpoint))
    store.put("k.bin", b"data")
    store.get_file("k.bin", tmp_path / "k.bin")
    assert stat.S_IMODE((tmp_path / "k.bin").stat().st_mode) == 0o666 & ~_current_umask()
