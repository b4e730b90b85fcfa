"""Shared fixtures: a real moto S3 server over HTTP on loopback and a fresh bucket per test,
the tiny training dataset, a temporary Prefect API and a loopback Kubernetes API. What the
tests share besides fixtures is in tests/support/."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.moto import FAKE_ACCESS_KEY_ID, FAKE_SECRET_ACCESS_KEY, start_moto, stop

# The project is not necessarily pip-installed into the venv and pyproject sets no pytest
# `pythonpath`, so make the repository root importable (infra, flows, ...) for all tests.
_REPO_ROOT = str(Path(__file__).resolve().parents[1])
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

# One compute thread per process (torch's intra-op pool, OpenMP, BLAS), set before torch is
# imported and inherited by every process a test starts: `make test` runs two workers on a
# two-core machine, and two torch processes of two threads each ran 3.6x slower than with
# one thread each (test_recipe beside test_recipe2: 47.5 s vs 13.0 s), OpenMP's threads
# spinning for cores the other worker held. torchrun does the same for its workers.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
if "torch" in sys.modules:  # imported before this file (a plugin): set its pool directly
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_TESTS = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "unit: a test under tests/unit (set here): in-process and fast, what make test-fast runs",
    )
    config.addinivalue_line(
        "markers", "e2e: a test under tests/e2e (set here): whole runs, processes and servers"
    )
    config.addinivalue_line(
        "markers",
        "parallel_matrix: the rest of the multi-process TP/PP parity and resharding matrix "
        "(set here, MATRIX): `make test-parallel` runs it, `make test` leaves it out",
    )


# The tensor/pipeline-parallel e2e cases beyond one of each kind. Each starts 2-4 torchrun
# processes plus a one-process reference on this 2-core machine: together they doubled
# `make test` (pytest 28.5 min with them, 2026-12-02). `make test` keeps one case per kind
# (tp2 parity, a dp x tp mesh, pp2 1f1b parity, pp2 x dp2, a resharding each way, guards)
# and `make test-parallel` runs these.
MATRIX = (
    "test_tensor_parallel.py::test_matches_one_process[tp2-learned]",
    "test_tensor_parallel.py::test_matches_one_process[tp2-depth]",
    "test_tensor_parallel_mesh.py::test_matches_one_process[dp2tp2-learned]",
    "test_tensor_parallel_mesh.py::test_matches_one_process[rep2tp2-rope]",
    "test_tensor_parallel_mesh.py::test_matches_one_process[rep2dp2-learned]",
    "test_tensor_parallel_resume.py::test_resumes_on_another_mesh[1_to_tp2]",
    "test_tensor_parallel_resume.py::test_rollback_as_in_one_process",
    "test_tensor_parallel_resume.py::test_fewer_validation_batches_than_ranks[parallel1]",
    "test_pipeline_parallel.py::test_matches_one_process[pp2-gpipe-learned]",
    "test_pipeline_parallel.py::test_matches_one_process[pp2-interleaved]",
    "test_pipeline_parallel_tp.py::test_pp2_tp2_matches_one_process",
    "test_pipeline_parallel_resume.py::test_resumes_on_another_mesh[fsdp2_to_pp2]",
    "test_pipeline_parallel_guards.py::test_rollback_as_in_one_process",
    # Remote checkpoints: make test keeps fsdp2 (the overlays' mesh; the same DCP upload).
    "test_parallel_remote_checkpoints.py::test_resumes_from_object_storage[tp2]",
    "test_parallel_remote_checkpoints.py::test_resumes_from_object_storage[pp2]",
    # Host reads: make test keeps both meshes' counts; this shows the count can fail.
    "test_host_sync_parallel.py::test_a_read_in_the_last_stage_loss_would_show",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test under tests/unit/ is marked `unit`, under tests/e2e/ `e2e`: `-m unit` selects
    what `make test-fast` runs (tests/unit), `-m "not e2e"` leaves out the slow ones."""
    for item in items:
        top = item.path.resolve().relative_to(_TESTS).parts[0]
        if top in ("unit", "e2e"):
            item.add_marker(top)
        if item.nodeid.endswith(MATRIX):
            item.add_marker("parallel_matrix")


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real `moto_server` subprocess on 127.0.0.1, shared by the session."""
    proc, endpoint = start_moto(tmp_path_factory.mktemp("moto") / "moto_server.log")
    try:
        yield endpoint
    finally:
        stop(proc)


@pytest.fixture
def fake_credentials() -> tuple[str, str]:
    """(access key id, secret access key) that aws_env puts in the environment."""
    return FAKE_ACCESS_KEY_ID, FAKE_SECRET_ACCESS_KEY


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fake credentials in the environment, isolated from the developer's ~/.aws and IMDS."""
    for name in (
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_ENDPOINT_URL",
        "AWS_ENDPOINT_URL_S3",
        "AWS_REGION",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET_ACCESS_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture(scope="session")
def s3_client(moto_endpoint: str) -> Any:
    """A raw boto3 client on the moto server, for setting up and tampering with objects.
    Session-scoped with explicit credentials: building a client costs ~0.2 s."""
    import boto3

    return boto3.session.Session(
        aws_access_key_id=FAKE_ACCESS_KEY_ID,
        aws_secret_access_key=FAKE_SECRET_ACCESS_KEY,
        region_name="us-east-1",
    ).client("s3", endpoint_url=moto_endpoint)


@pytest.fixture
def s3_bucket(s3_client: Any, aws_env: None) -> str:
    """A new, empty bucket on the moto server, unique to the test."""
    name = f"test-{uuid.uuid4().hex[:20]}"
    s3_client.create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def train_dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Byte-level tinyshakespeare excerpt, paragraphs as documents, packed to 64."""
    from dataprep.config import parse_config
    from dataprep.pipeline import run_prep
    from tests.support.helpers import shared_file

    root = tmp_path_factory.mktemp("train-data")
    text = shared_file("tinyshakespeare.txt").read_text(encoding="utf-8")[:120_000]
    (root / "shakespeare.txt").write_text(text, encoding="utf-8")
    out = root / "prep"
    run_prep(
        parse_config(
            {
                "output": str(out),
                "workers": 1,
                "sources": [
                    {
                        "name": "tiny",
                        "paths": [str(root / "shakespeare.txt")],
                        "txt_unit": "paragraph",
                    }
                ],
                "dedup": {"exact": False, "near": False},
                "quality": [],
                "pack": {"seq_len": 64},
                "dataset": {"validation_fraction": 0.1, "pack_partitions": 2},
            }
        ),
        progress=False,
    )
    return str(out / "dataset")


@pytest.fixture(scope="module")
def dataset(train_dataset: str) -> str:
    """train_dataset under the name the trainer's tests give it (a test module may define a
    `dataset` of its own, which then wins)."""
    return train_dataset


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[str]:
    """A real temporary Prefect API (SQLite, a server subprocess on loopback); yields its
    URL. One per session: it costs ~15 s to start."""
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    # No telemetry from the temporary server (no internet here; its first write can race
    # the migrations and print a traceback).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

    with prefect_test_harness(server_startup_timeout=120):
        yield str(PREFECT_API_URL.value())


@pytest.fixture
def kube() -> Iterator[Any]:
    """A loopback Kubernetes API serving recorded objects (tests/support/kube.py)."""
    from tests.support.kube import FakeKubeAPI

    api = FakeKubeAPI()
    try:
        yield api
    finally:
        api.close()
