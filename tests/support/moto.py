"""A real moto S3 server over HTTP on loopback (conftest's `moto_endpoint` fixture starts one
per session; a test that must stop its store starts one of its own), and the fake
credentials every test uses."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

# Recognisable fake credentials: tests assert these strings never surface in errors.
FAKE_ACCESS_KEY_ID = "AKIABALLASTFAKE7Q2X"
FAKE_SECRET_ACCESS_KEY = "ballastFakeSecret/9vTq3LmZ+pW8rYx2Kd0NsEuHa"
MOTO_START_TIMEOUT_S = 30.0


def free_port() -> int:
    """A loopback port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _moto_command() -> list[str]:
    exe = Path(sys.executable).with_name("moto_server")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]


def _answers(endpoint: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP answer means the server is up
    except OSError:
        return False


def start_moto(log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A `moto_server` subprocess on 127.0.0.1 logging to `log_path`: (process, endpoint)."""
    # The port is picked before the server binds it, so another process can win the race;
    # the server then exits at once and we try a new port.
    for _ in range(3):
        port = free_port()
        endpoint = f"http://127.0.0.1:{port}"
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                [*_moto_command(), "-H", "127.0.0.1", "-p", str(port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + MOTO_START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if _answers(endpoint):
                return proc, endpoint
            time.sleep(0.05)
        stop(proc)
    tail = log_path.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"moto_server did not start; log tail:\n{tail}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate a server started here (killed if it does not exit in 5 s)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def set_aws_env(mp: Any, endpoint: str, root: Path) -> None:
    """The environment of a test's S3 client against `endpoint` (what conftest's per-test
    `aws_env` sets, for a module-scoped fixture: `mp` a pytest.MonkeyPatch context), with
    no AWS config or credentials of the machine's read (`root`: where they are not)."""
    mp.setenv("AWS_ACCESS_KEY_ID", FAKE_ACCESS_KEY_ID)
    mp.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET_ACCESS_KEY)
    mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
    mp.setenv("AWS_ENDPOINT_URL", endpoint)
    mp.setenv("AWS_CONFIG_FILE", str(root / "no-aws-config"))
    mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(root / "no-aws-credentials"))
    mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        mp.delenv(name, raising=False)
