"""Remote checkpoints (training.checkpoint.remote) against a real moto_server over HTTP.

Network outages are real too: a small TCP proxy sits between the store and moto and can be
switched off mid-upload (listener closed, live connections dropped) and on again on the
same port. Assertions about the remote state go straight to moto through the raw client,
never through the proxy.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from botocore.exceptions import ClientError

from core.store import StorageError, StorageOptions
from tests.support.net import TcpProxy
from training import checkpoint as ckpt
from training.checkpoint.remote import (
    RUN_RECORD,
    STAGING,
    RemoteCheckpointError,
    RemoteCheckpoints,
    RemoteOwnershipError,
)

PREFIX = "runs/r1"
MIB = 1024 * 1024


# -- helpers -------------------------------------------------------------------------------


class LatestWatcher:
    """Polls `latest` straight on moto and records every step it names, checking each time
    it changes that the named checkpoint is complete (meta.json and every listed file, with
    the listed size)."""

    def __init__(self, client: Any, bucket: str, prefix: str = PREFIX) -> None:
        self.client, self.bucket, self.prefix = client, bucket, prefix
        self.seen: list[int] = []
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poll()
            time.sleep(0.02)

    def _poll(self) -> None:
        name = raw_latest(self.client, self.bucket, self.prefix)
        if name is not None:
            step = int(name.removeprefix("step-"))
            if not self.seen or self.seen[-1] != step:
                self.seen.append(step)
                problem = self._incomplete(name)
                if problem:
                    self.violations.append(f"latest named {name} while {problem}")

    def _incomplete(self, name: str) -> str | None:
        base = f"{self.prefix}/{name}"
        try:
            meta = json.loads(
                self.client.get_object(Bucket=self.bucket, Key=f"{base}/meta.json")["Body"].read()
            )
        except ClientError:
            return "meta.json was missing"
        for fname, want in meta["files"].items():
            try:
                head = self.client.head_object(Bucket=self.bucket, Key=f"{base}/{fname}")
            except ClientError:
                return f"{fname} was missing"
            if head["ContentLength"] != want["bytes"]:
                return f"{fname} had the wrong size"
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._poll()  # a last look: the final state may have landed since the last poll


def raw_latest(client: Any, bucket: str, prefix: str = PREFIX) -> str | None:
    try:
        body = client.get_object(Bucket=bucket, Key=f"{prefix}/latest")["Body"].read()
    except ClientError:
        return None
    return body.decode().strip()


def raw_keys(client: Any, bucket: str, prefix: str = PREFIX) -> list[str]:
    resp = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/")
    return sorted(o["Key"].removeprefix(f"{prefix}/") for o in resp.get("Contents", []))


def raw_steps(client: Any, bucket: str, prefix: str = PREFIX) -> list[int]:
    return sorted(
        {
            int(k.split("/")[0].removeprefix("step-"))
            for k in raw_keys(client, bucket, prefix)
            if k.startswith("step-")
        }
    )


def assert_remote_verifies(client: Any, bucket: str, local_root: Path, step: int) -> None:
    """Every file of local checkpoint `step` is on moto with the same bytes."""
    name = ckpt.step_name(step)
    local_meta = (local_root / name / "meta.json").read_bytes()
    remote_meta = client.get_object(Bucket=bucket, Key=f"{PREFIX}/{name}/meta.json")
    assert remote_meta["Body"].read() == local_meta
    for fname, want in json.loads(local_meta)["files"].items():
        obj = client.get_object(Bucket=bucket, Key=f"{PREFIX}/{name}/{fname}")
        assert obj["Metadata"]["sha256"] == want["sha256"]
        assert hashlib.sha256(obj["Body"].read()).hexdigest() == want["sha256"]


def make_state(step: int, big: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    state: dict[str, Any] = {
        "step": step,
        "w": torch.randn(4, 8, generator=g),
        "b": torch.arange(step, step + 5),
    }
    if big:  # 12 MiB of float32: a multipart upload with a 5 MiB threshold
        state["big"] = torch.randn(3 * MIB, generator=g)
    return state


def assert_state_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


def closed_endpoint() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def proxy(moto_endpoint: str) -> Iterator[TcpProxy]:
    p = TcpProxy("127.0.0.1", int(moto_endpoint.rsplit(":", 1)[1]))
    yield p
    p.close()


@pytest.fixture
def remote(
    s3_bucket: str, moto_endpoint: str
) -> Iterator[Callable[..., tuple[RemoteCheckpoints, list[str]]]]:
    """Factory: a RemoteCheckpoints on s3://<bucket>/runs/r1 (directly on moto unless an
    endpoint is given) with a list collecting its log lines; all closed at teardown."""
    made: list[RemoteCheckpoints] = []

    def make(endpoint: str | None = None, **kwargs: Any) -> tuple[RemoteCheckpoints, list[str]]:
        logs: list[str] = []
        options = StorageOptions(
            endpoint_url=endpoint or moto_endpoint,
            multipart_threshold_mb=5,
            max_attempts=kwargs.pop("max_attempts", 2),
        )
        kwargs.setdefault("retries", 3)
        kwargs.setdefault("backoff_s", 0.05)
        rc = RemoteCheckpoints(f"s3://{s3_bucket}/{PREFIX}", options, log=logs.append, **kwargs)
        made.append(rc)
        return rc, logs

    yield make
    for rc in made:
        rc.close(drain=False)


# -- tests ---------------------------------------------------------------------------------


def test_upload_then_restore_on_fresh_machine(
    remote: Callable[..., tuple[RemoteCheckpoints, list[str]]],
    s3_client: Any,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    rc, logs = remote()
    watcher = LatestWatcher(s3_client, s3_bucket)
    state = make_state(7)
    ckpt.save(root, 7, state)
    assert raw_latest(s3_client, s3_bucket) is None
    rc.submit(root, 7)
    # Local retention may delete the checkpoint right away: the upload reads its snapshot.
    shutil.rmtree(root / ckpt.step_name(7))
    rc.wait(timeout=30)
    watcher.stop()

    assert raw_latest(s3_client, s3_bucket) == "step-00000007"
    assert watcher.violations == []
    assert rc.status["uploaded"] == [7] and rc.status["consecutive_failures"] == 0
    assert rc.remote_steps() == [7]
    assert not any((root / STAGING).iterdir())  # staging cleaned after the upload
    assert any("uploaded" in line and "step-00000007" in line for line in logs)

    fresh = tmp_path / "fresh"  # a new machine: empty directory, new instance
    rc2, _ = remote()
    assert rc2.restore_latest(fresh) == 7
    assert ckpt.latest_step(fresh) == 7
    assert_state_equal(ckpt.load(fresh, 7), state)
    assert sorted(p.name for p in fresh.iterdir()) == ["latest", "step-00000007"]


@pytest.mark.parametrize("damage", ["missing", "truncated", "bitflip", "no-meta"])
def test_restore_skips_partial_or_corrupt(
    damage: str,
    remote: Callable[..., tuple[RemoteCheckpoints, list[str]]],
    s3_client: Any,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    rc, _ = remote()
    states = {s: make_state(s) for s in (1, 2)}
    for s, state in states.items():
        ckpt.save(root, s, state)
        rc.submit(root, s)
        rc.wait(timeout=30)
    assert raw_latest(s3_client, s3_bucket) == "step-00000002"

    key = f"{PREFIX}/step-00000002/state.pt"
    if damage == "missing":
        s3_client.delete_object(Bucket=s3_bucket, Key=key)
    elif damage == "truncated":  # a raw overwrite: other size, no sha256 metadata
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=b"not a checkpoint")
    elif damage == "bitflip":  # same size and the original sha256 metadata: only content differs
        obj = s3_client.get_object(Bucket=s3_bucket, Key=key)
        body = bytearray(obj["Body"].read())
        body[len(body) // 2] ^= 0xFF
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body), Metadata=obj["Metadata"])
    else:
        s3_client.delete_object(Bucket=s3_bucket, Key=f"{PREFIX}/step-00000002/meta.json")

    fresh = tmp_path / "fresh"
    rc2, logs = remote()
    assert rc2.restore_latest(fresh) == 1
    warnings = [line for line in logs if "WARNING" in line and "step-00000002" in line]
    assert warnings, logs
    assert ckpt.latest_step(fresh) == 1
    assert_state_equal(ckpt.load(fresh, 1), states[1])
    # Nothing of the bad checkpoint (or a temporary download directory) is left behind.
    assert sorted(p.name for p in fresh.iterdir()) == ["latest", "step-00000001"]


def test_restore_from_empty_remote_returns_none(
    remote: Callable[..., tuple[RemoteCheckpoints, list[str]]], tmp_path: Path
) -> None:
    rc, _ = remote()
    assert rc.restore_latest(tmp_path / "fresh") is None
    assert rc.remote_steps() == []


def test_network_outage_mid_upload_is_retried(
    remote: Callable[..., tuple[RemoteCheckpoints, list[str]]],
    proxy: TcpProxy,
    s3_client: Any,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    # botocore gives up at once (max_attempts=1); our own retry/backoff does the retrying.
    rc, logs = remote(proxy.endpoint, max_attempts=1, retries=8, backoff_s=0.1)
    ckpt.save(root, 1, make_state(1))
    rc.submit(root, 1)
    rc.wait(timeout=30)
    assert raw_latest(s3_client, s3_bucket) == "step-00000001"

    watcher = LatestWatcher(s3_client, s3_bucket)
    big = make_state(2, big=True)
    ckpt.save(root, 2, big)
    assert (root / "step-00000002" / "state.pt").stat().st_size > 12 * MIB
    proxy.pause_after(6 * MIB)  # about half-way through the multipart upload of state.pt
    rc.submit(root, 2)
    assert proxy.paused.wait(timeout=30), "the upload never reached the cut-off point"

    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert raw_latest(s3_client, s3_bucket) == "step-00000001"
        time.sleep(0.05)
    assert rc.status["in_flight"] == 2 and 2 not in rc.status["uploaded"]
    proxy.resume()
    rc.wait(timeout=40)
    watcher.stop()

    assert raw_latest(s3_client, s3_bucket) == "step-00000002"
    assert rc.status["uploaded"] == [1, 2] and rc.status["failed"] == []
    assert any("retrying" in line for line in logs), logs
    assert watcher.seen == [1, 2] and watcher.violations == []
    assert_remote_verifies(s3_client, s3_bucket, root, 2)
    rc2, _ = remote()
    assert rc2.restore_latest(tmp_path / "fresh") == 2
    assert_state_equal(ckpt.load(tmp_path / "fresh", 2), big)


def test_repeated_failures_raise_without_leaking_credentials(
    remote: Callable[..., tuple[RemoteCheckpoints, list[str]]],
    fake_credentials: tuple[str, str],
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    rc, logs = remote(
        closed_endpoint(), max_attempts=1, retries=1, backoff_s=0.01, max_consecutive_failures=3
    )
    for s in (1, 2, 3):
        ckpt.save(root, s, make_state(s))
        rc.submit(root, s)  # does not raise: fewer than 3 failures so far
        rc.wait(timeout=30)
        assert rc.status["consecutive_failures"] == s
    ckpt.save(root, 4, make_state(4))
    with pytest.raises(RemoteCheckpointError) as info:
        rc.submit(root, 4)

    for s in (1, 2, 3):
        name = ckpt.step_name(s)
        assert any("UPLOAD FAILED" in line and name in line for line in logs), name
        assert name in str(info.value)
    assert rc.status["failed"][:3] == [1, 2, 3] and rc.status["uploaded"] == []
    # Unreachable storage on restore is an error, never "nothing to resume from".
    with pytest.raises(StorageError) as restore_info:
        rc.restore_latest(tmp_path / "fresh")
    texts = [
        *logs,
        str(info.value),
        repr(info.value),
        str(rc.status),
        str(restore_info.value),
        "".join(traceback.format_exception(info.value)),
    ]
    for secret in fake_credentials:
        assert not any(secret in t for t in texts)


def test_success_resets_failure_count(
    remote: Callable[..., tuple[RemoteCheckpoints, list[str]]],
    proxy: TcpProxy,
    s3_client: Any,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    rc, _ = remote(proxy.endpoint, max_attempts=1, retries=0, max_consecutive_failures=2)
    proxy.pause()
    for s in (1, 2):
        ckpt.save(root, s, make_state(s))
        rc.submit(root, s)
        rc.wait(timeout=30)
    proxy.resume()
    ckpt.save(root, 3, make_state(3))
    with pytest.raises(RemoteCheckpointError):
        rc.submit(root, 3)  # two in a row failed: raises, but step 3 is queued anyway
    rc.wait(timeout=30)
    assert rc.status["uploaded"] == [3] and rc.status["consecutive_failures"] == 0
    ckpt.save(root, 4, make_state(4))
    rc.submit(root, 4)  # no raise after a success
    rc.wait(timeout=30)
    assert raw_latest(s3_client, s3_bucket) == "step-00000004"


def test_superseded_upload_is_skipped(
    remote: Callable[..., tuple[RemoteCheckpoints, list[str]]],
    proxy: TcpProxy,
    s3_client: Any,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    rc, logs = remote(proxy.endpoint, max_attempts=1, retries=20, backoff_s=0.05)
    for s in (10, 11, 12):
        ckpt.save(root, s, make_state(s))
    proxy.pause()
    rc.submit(root, 10)
    deadline = time.monotonic() + 10
    while rc.status["in_flight"] != 10:  # the worker holds 10 (stuck on the outage)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    rc.submit(root, 11)
    rc.submit(root, 12)
    time.sleep(0.2)
    proxy.resume()
    rc.wait(timeout=30)
    assert rc.status["uploaded"] == [10, 12] and rc.status["skipped"] == [11]
    assert any("skipping step-00000011" in line for line in logs)
    assert raw_latest(s3_client, s3_bucket) == "step-00000012"
    assert 11 not in raw_steps(s3_client, s3_bucket)


def test_latest_never_moves_backwards(
    remote: Callable[..., tuple[RemoteCheckpoints, list[str]]],
    s3_client: Any,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    watcher = LatestWatcher(s3_client, s3_bucket)
    rc, logs = remote(keep_last=5)
    for s in (3, 4, 5, 6):
        ckpt.save(root, s, make_state(s))
    rc.submit(root, 5)
    rc.wait(timeout=30)
    rc.submit(root, 3)  # an older checkpoint finishing after a newer one
    rc.wait(timeout=30)
    assert raw_latest(s3_client, s3_bucket) == "step-00000005"
    assert rc.status["uploaded"] == [5, 3]
    assert any("not moving latest back" in line for line in logs), logs

    # Another writer that never saw step 5 (fresh memory) reads the remote latest first.
    other, other_logs = remote(keep_last=5)
    other.submit(root, 4)
    other.wait(timeout=30)
    assert raw_latest(s3_client, s3_bucket) == "step-00000005"
    assert any("already names step-00000005" in line for line in other_logs), other_logs
    other.submit(root, 6)
    other.wait(timeout=30)
    assert raw_latest(s3_client, s3_bucket) == "step-00000006"
    watcher.stop()
    assert watcher.seen == [5, 6] and watcher.violations == []
    assert raw_steps(s3_client, s3_bucket) == [3, 4, 5, 6]


def test_remote_retention(
    remote: Callable[..., tuple[RemoteCheckpoints, list[str]]],
    s3_client: Any,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    # Debris: a partial upload older than everything (deleted) and a partial newer one,
    # possibly another writer's upload in progress (kept).
    s3_client.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/step-00000000/state.pt", Body=b"x")
    s3_client.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/step-00000099/state.pt", Body=b"x")
    rc, logs = remote(keep_last=2, keep_every=4, skip_superseded=False)
    for s in range(1, 10):
        ckpt.save(root, s, make_state(s))
        rc.submit(root, s)
    rc.wait(timeout=60)
    assert rc.status["uploaded"] == list(range(1, 10))
    assert rc.remote_steps() == [4, 8, 9]
    assert raw_steps(s3_client, s3_bucket) == [4, 8, 9, 99]
    assert raw_latest(s3_client, s3_bucket) == "step-00000009"
    assert any("retention deleted" in line for line in logs)
    for s in (4, 8, 9):
        assert_remote_verifies(s3_client, s3_bucket, root, s)

    # `latest` is never deleted, even outside keep_last: complete checkpoints newer than
    # latest can exist (a writer that died between meta.json and latest).
    for s in (20, 21):
        for fname in ("state.pt", "meta.json"):
            s3_client.copy_object(
                Bucket=s3_bucket,
                Key=f"{PREFIX}/{ckpt.step_name(s)}/{fname}",
                CopySource={"Bucket": s3_bucket, "Key": f"{PREFIX}/step-00000009/{fname}"},
            )
    ckpt.save(root, 5, make_state(5))
    rc.submit(root, 5)  # older than latest: uploaded, then beyond keep_last and deleted
    rc.wait(timeout=30)
    assert rc.status["uploaded"][-1] == 5
    assert raw_latest(s3_client, s3_bucket) == "step-00000009"
    assert rc.remote_steps() == [4, 8, 9, 20, 21]


def test_claim_writes_and_enforces_the_ownership_record(
    remote: Callable[..., tuple[RemoteCheckpoints, list[str]]],
    s3_client: Any,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    """An empty prefix is claimed (RUN.json); the same run claims it again; another run name
    or config fingerprint is refused with one line naming both, and nothing changes."""
    rc, logs = remote()
    rc.claim("r1", "0123456789abcdef")
    record = json.loads(
        s3_client.get_object(Bucket=s3_bucket, Key=f"{PREFIX}/{RUN_RECORD}")["Body"].read()
    )
    assert (record["run_name"], record["config_fingerprint"]) == ("r1", "0123456789abcdef")
    assert record["created"].endswith("Z")
    assert not any("WARNING" in line for line in logs)
    root = tmp_path / "ckpt"
    ckpt.save(root, 3, make_state(3))
    rc.submit(root, 3)
    rc.wait(timeout=30)
    before = {
        k: s3_client.get_object(Bucket=s3_bucket, Key=f"{PREFIX}/{k}")["Body"].read()
        for k in raw_keys(s3_client, s3_bucket)
    }
    assert RUN_RECORD in before and "latest" in before

    rc2, _ = remote()
    rc2.claim("r1", "0123456789abcdef")  # the same run on a fresh machine
    for name, fp in [("r1", "fedcba9876543210"), ("other", "0123456789abcdef")]:
        with pytest.raises(RemoteOwnershipError) as e:
            rc2.claim(name, fp)
        msg = str(e.value)
        assert "\n" not in msg
        assert f"s3://{s3_bucket}/{PREFIX}" in msg and "'r1'" in msg and repr(name) in msg
        assert "0123456789abcdef" in msg and fp in msg
        assert "checkpoint.run_name" in msg and "delete" in msg
    after = {
        k: s3_client.get_object(Bucket=s3_bucket, Key=f"{PREFIX}/{k}")["Body"].read()
        for k in raw_keys(s3_client, s3_bucket)
    }
    assert after == before


def test_claim_adopts_a_prefix_from_before_ownership_records(
    remote: Callable[..., tuple[RemoteCheckpoints, list[str]]],
    s3_client: Any,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    rc, _ = remote()
    ckpt.save(root, 5, make_state(5))
    rc.submit(root, 5)  # no claim: what an older Ballast left behind
    rc.wait(timeout=30)
    assert RUN_RECORD not in raw_keys(s3_client, s3_bucket)

    rc2, logs = remote()
    rc2.claim("r1", "0123456789abcdef")
    warnings = [line for line in logs if "WARNING" in line]
    assert len(warnings) == 1 and "older Ballast" in warnings[0] and "'r1'" in warnings[0]
    assert RUN_RECORD in raw_keys(s3_client, s3_bucket)
    assert rc2.restore_latest(tmp_path / "fresh") == 5  # adopted, not refused

    # A RUN.json that is not a record: which run owns the prefix is unknown, so refuse.
    s3_client.put_object(Bucket=s3_bucket, Key=f"{PREFIX}/{RUN_RECORD}", Body=b"{not json")
    with pytest.raises(RemoteOwnershipError, match="not a valid ownership record"):
        rc2.claim("r1", "0123456789abcdef")


@pytest.mark.parametrize("where", ["s3", "local"])
def test_claim_race_on_an_empty_prefix_has_one_winner(
    where: str,
    remote: Callable[..., tuple[RemoteCheckpoints, list[str]]],
    s3_client: Any,
    s3_bucket: str,
    tmp_path: Path,
) -> None:
    """Two runs claim an empty prefix at once: both find no RUN.json, and the conditional
    create lets only the first one write it; the second reads the winner's record and is
    refused, and the record stays the winner's."""

    def make() -> RemoteCheckpoints:
        if where == "s3":
            return remote()[0]
        rc = RemoteCheckpoints(str(tmp_path / "mirror"), log=lambda line: None)
        closers.append(rc)
        return rc

    closers: list[RemoteCheckpoints] = []
    try:
        first, second = make(), make()
        real_get = second._remote.get_or_none
        reads: list[str] = []

        def get_before_the_winner(key: str) -> bytes | None:
            reads.append(key)
            if len(reads) == 1:  # second's first look: before first's record existed
                first.claim("r1", "0123456789abcdef")
                return None
            return real_get(key)

        second._remote.get_or_none = get_before_the_winner  # type: ignore[method-assign]
        with pytest.raises(RemoteOwnershipError, match="belongs to run 'r1'"):
            second.claim("r2", "0123456789abcdef")
        second._remote.get_or_none = real_get  # type: ignore[method-assign]
        first.claim("r1", "0123456789abcdef")  # still the winner's
    finally:
        for rc in closers:
            rc.close()


def test_local_directory_store(tmp_path: Path) -> None:
    """The same protocol over a plain directory (e.g. a shared filesystem mount)."""
    root, target = tmp_path / "ckpt", tmp_path / "mirror"
    rc = RemoteCheckpoints(str(target), keep_last=1, log=lambda line: None)
    try:
        for s in (1, 2):
            ckpt.save(root, s, make_state(s))
            rc.submit(root, s)
            rc.wait(timeout=30)
        assert (target / "latest").read_text() == "step-00000002\n"
        assert rc.remote_steps() == [2]
        assert rc.restore_latest(tmp_path / "fresh") == 2
        assert_state_equal(ckpt.load(tmp_path / "fresh", 2), make_state(2))
    finally:
        rc.close()
