"""`ballast prep` when things go wrong around it (issue 11): a killed CLI leaves no
workers behind; Ctrl-C and operating-system errors (full disk, an output path that is a
file, permissions, read-only filesystems) end with one line on stderr, not a traceback,
and the documented exit codes."""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from tests.support.helpers import ROOT, assert_one_line_error, cli_env, run_cli

EXIT_INTERRUPTED = 130


def write_corpus(root: Path, docs_per_source: int, words: int = 100, seed: int = 0) -> Path:
    """Two sources of random-word documents (two sources: two ingest units, so even
    ingest runs in the worker pool)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(5000)]
    for src in ("web", "news"):
        (root / src).mkdir(parents=True, exist_ok=True)
        with open(root / src / f"{src}.jsonl", "w", encoding="utf-8") as f:
            for i in range(docs_per_source):
                text = " ".join(rng.choices(vocab, k=words))
                f.write(json.dumps({"id": f"{src}-{i}", "text": text}) + "\n")
    return root


def write_config(path: Path, data: Path, out: Path | str, workers: int = 2) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "output": str(out),
                "workers": workers,
                "sources": [
                    {"name": src, "paths": [str(data / src / f"{src}.jsonl")]}
                    for src in ("web", "news")
                ],
                "ingest": {"shard_docs": 1000},
                "quality": ["length"],
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Big enough that a 2-worker run is still busy many seconds after it starts."""
    return write_corpus(tmp_path_factory.mktemp("big"), docs_per_source=10_000)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("small"), docs_per_source=50, words=30)


def is_gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes still alive (zombies count as gone) after up to `timeout` s."""
    deadline = time.monotonic() + timeout
    alive = procs
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if not is_gone(p)]
        time.sleep(0.1)
    return [p for p in alive if not is_gone(p)]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def running_prep(
    cfg: Path, out_dir: Path, **popen: object
) -> Iterator[tuple[subprocess.Popen[bytes], list[psutil.Process]]]:
    """Start `ballast prep` with 2 workers; yield it once both workers are up, with its
    child processes (workers and multiprocessing's resource tracker). Afterwards, kill
    whatever of those this test started is still alive (by pid), so that a failing test
    leaks nothing either."""
    with open(out_dir / "stderr.txt", "wb") as err:  # a file: no pipe to fill and block
        # The CLI starts with SIGINT at its default, as from a terminal: an ignored
        # signal is inherited across exec, and in a full `pytest -n 2` run the worker
        # process had come to ignore it (the CLI then ran to the end, exit 0).
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "prep", str(cfg), "--no-progress"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=cli_env(),
            preexec_fn=_default_sigint,
            **popen,
        )  # type: ignore[call-overload]
        kids: list[psutil.Process] = []
        try:
            parent = psutil.Process(proc.pid)
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                assert proc.poll() is None, (out_dir / "stderr.txt").read_text()
                with contextlib.suppress(psutil.Error):
                    kids = parent.children(recursive=True)
                    workers = [k for k in kids if "spawn_main" in " ".join(k.cmdline())]
                    if len(workers) >= 2:
                        break
                time.sleep(0.1)
            else:
                pytest.fail("the workers did not start within 180 s")
            time.sleep(1.0)  # let them get going
            assert proc.poll() is None, "the run ended before the test could interrupt it"
            yield proc, kids
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for k in kids:
                with contextlib.suppress(psutil.Error):
                    k.kill()


def test_kill_9_of_prep_leaves_no_worker_behind(big_corpus, tmp_path):
    """kill -9 of `ballast prep` used to leak both pool workers and the resource tracker
    (blocked forever on pipes they hold themselves)."""
    cfg = write_config(tmp_path / "run.yaml", big_corpus, tmp_path / "out")
    with running_prep(cfg, tmp_path) as (proc, kids):
        names = [" ".join(k.cmdline()) for k in kids]
        assert len(kids) >= 2, names
        proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL
        alive = wait_gone(kids, timeout=15)
        assert alive == [], [" ".join(p.cmdline()) for p in alive]


@pytest.mark.parametrize("target", ["cli", "group"])
def test_ctrl_c_prints_one_line_exits_130_and_stops_workers(big_corpus, tmp_path, target):
    """SIGINT to the CLI alone (`kill -INT`), and to its whole process group (what Ctrl-C
    in a terminal does: the workers get it too)."""
    cfg = write_config(tmp_path / "run.yaml", big_corpus, tmp_path / "out")
    with running_prep(cfg, tmp_path, start_new_session=True) as (proc, kids):
        if target == "cli":
            proc.send_signal(signal.SIGINT)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=120)
        stderr = (tmp_path / "stderr.txt").read_text()
        assert rc == EXIT_INTERRUPTED, stderr
        assert "Traceback" not in stderr, stderr
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "interrupted" in lines[0], stderr
        alive = wait_gone(kids, timeout=15)
        assert alive == [], [" ".join(p.cmdline()) for p in alive]


def test_output_path_that_is_a_file(small_corpus, tmp_path):
    out = tmp_path / ("an-existing-file-with-a-long-name-" + "x" * 80 + ".txt")
    out.write_text("not a directory\n")
    cfg = write_config(tmp_path / "run.yaml", small_corpus, out, workers=1)
    r = run_cli("prep", str(cfg), "--no-progress")
    assert r.returncode == 1, r.stderr
    assert_one_line_error(r, str(out), "not a directory")
    assert out.read_text() == "not a directory\n"


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.parametrize(
    "case", ["permission_denied", "parent_is_a_file", "sysfs", "read_only_filesystem"]
)
def test_output_that_cannot_be_created(small_corpus, tmp_path, case):
    """Permissions are not enforced for root (the tests usually run as root), so the
    cases a root can meet run too: a parent that is a file, a path under /sys (EPERM),
    a read-only filesystem (EROFS)."""
    with contextlib.ExitStack() as stack:
        if case == "permission_denied":
            if os.geteuid() == 0:
                pytest.skip("root ignores file permissions")
            locked = tmp_path / "locked"
            locked.mkdir(mode=0o500)
            stack.callback(locked.chmod, 0o700)
            out, cause = locked / "out", "Permission denied"
        elif case == "parent_is_a_file":
            (tmp_path / "plain").write_text("x")
            out, cause = tmp_path / "plain" / "out", "Not a directory"
        elif case == "sysfs":
            if not Path("/sys/kernel").is_dir():
                pytest.skip("no sysfs")
            out, cause = Path(f"/sys/kernel/ballast-test-{os.getpid()}"), ""
        else:
            ro = stack.enter_context(tmpfs(tmp_path / "ro", "ro,size=1m"))
            out, cause = ro / "out", "Read-only file system"
        cfg = write_config(tmp_path / "run.yaml", small_corpus, out, workers=1)
        r = run_cli("prep", str(cfg), "--no-progress")
    assert r.returncode == 1, r.stderr
    assert_one_line_error(r, str(out), cause)


def test_full_disk(big_corpus, tmp_path):
    """A real full disk: the output on a 1 MB tmpfs (needs mount, so root). The first
    shards the workers write fill it."""
    with tmpfs(tmp_path / "small-disk", "size=1m") as disk:
        out = disk / "out"
        cfg = write_config(tmp_path / "run.yaml", big_corpus, out)
        r = run_cli("prep", str(cfg), "--no-progress")
        assert r.returncode == 1, r.stderr
        line = assert_one_line_error(r, str(out), "No space left on device", "free")
        assert "ingest" in line  # the step that failed


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write fails with EFBIG instead


def test_file_size_limit(big_corpus, tmp_path):
    """RLIMIT_FSIZE (`ulimit -f`): writes past it fail with EFBIG, in the workers too; a
    full disk without needing mount."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.yaml", big_corpus, out)
    r = run_cli("prep", str(cfg), "--no-progress", preexec_fn=_limit_file_size)
    assert r.returncode == 1, r.stderr
    assert_one_line_error(r, str(out), "File too large", "262144")


def test_long_error_stays_on_one_line_in_a_pipe(tmp_path):
    """rich wraps at 80 columns when stderr is not a terminal; an error message must stay
    one line there (logs, grep)."""
    missing = tmp_path / ("a-directory-with-a-rather-long-name-" + "y" * 60) / "run.yaml"
    r = run_cli("prep", str(missing))
    assert r.returncode == 1, r.stderr
    line = assert_one_line_error(r, str(missing), "does not exist")
    assert len(line) > 100
