"""The `local` JobBackend: the pod entrypoint (training.entrypoint, i.e. torchrun) as a
subprocess on this machine. The default backend, and the one the supervisor's restart
logic is tested with for real.

Each attempt gets a directory `<root>/<attempt name>/` with `log.txt` (stdout and stderr),
`job.json` (the command and pid) and, once it ends, `exit_code`. A small wrapper process
(`python -m infra.local_backend wrap`) writes the exit code, so the status of an attempt
can be read by any process (the flow's cancellation hook, a restarted supervisor), not only
by the parent.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from core.files import pid_alive, run_forwarding_signals, write_atomic
from infra.jobs import JobHandle, JobSpec, JobStatus, ending_from_exit_code

LOG, JOB, EXIT, CANCELLED = "log.txt", "job.json", "exit_code", "cancelled"


def _alive(pid: int) -> bool:
    if not pid_alive(pid):
        return False
    # A zombie is dead for our purposes: it exited and waits to be reaped.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


class LocalBackend:
    name = "local"

    def __init__(
        self,
        root: str | Path,
        cwd: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
        cancel_grace_s: float = 20.0,
    ) -> None:
        self.root = Path(root)
        self.cwd = Path(cwd) if cwd else Path(__file__).resolve().parents[1]
        self.env = dict(env or {})
        self.python = python
        self.cancel_grace_s = cancel_grace_s
        self._procs: dict[int, subprocess.Popen[bytes]] = {}

    def submit(self, spec: JobSpec) -> JobHandle:
        d = self.root / spec.attempt_name
        if (d / JOB).is_file():
            raise RuntimeError(f"attempt {spec.attempt_name} was already submitted ({d})")
        d.mkdir(parents=True, exist_ok=True)
        cmd = [self.python, "-m", "training.entrypoint", *spec.entrypoint_argv()]
        wrapper = [self.python, "-m", "infra.local_backend", "wrap", str(d / EXIT), "--", *cmd]
        env = {**os.environ, **self.env, **spec.env, "PYTHONUNBUFFERED": "1"}
        with open(d / LOG, "ab") as log:
            # A session of its own: cancel() signals the whole tree (torchrun, workers).
            proc = subprocess.Popen(
                wrapper,
                cwd=self.cwd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._procs[proc.pid] = proc
        (d / JOB).write_text(
            json.dumps(
                {"cmd": cmd, "pid": proc.pid, "cwd": str(self.cwd), "submitted": time.time()},
                indent=2,
            )
        )
        return JobHandle(self.name, spec.attempt_name, None, {"dir": str(d), "pid": proc.pid})

    def _poll(self, pid: int) -> bool:
        """True while the wrapper runs (reaps it when it is our child)."""
        proc = self._procs.get(pid)
        if proc is not None:
            return proc.poll() is None
        return _alive(pid)

    def status(self, handle: JobHandle) -> JobStatus:
        d, pid = Path(handle.data["dir"]), int(handle.data["pid"])
        if self._poll(pid):
            return JobStatus("running", detail=f"pid {pid}")
        if (d / CANCELLED).is_file():
            return JobStatus("finished", "cancelled", None, "cancelled")
        try:
            code = int((d / EXIT).read_text())
        except (OSError, ValueError):
            # The wrapper itself was killed (SIGKILL of the process group, the machine's
            # OOM killer): no exit code to go on.
            return JobStatus(
                "finished", "crashed", None, f"pid {pid} ended without an exit code (killed)"
            )
        ending = ending_from_exit_code(code)
        if code < 0:
            detail = f"killed by {signal.Signals(-code).name}"
        else:
            detail = {
                "done": "exit 0",
                "bad_input": "exit 1: bad config or data",
                "diverged": "exit 3: diverged beyond the rollback budget",
            }.get(ending, f"exit {code}: crashed")
        return JobStatus("finished", ending, code, detail)

    def logs(self, handle: JobHandle, tail: int | None = None) -> str:
        p = Path(handle.data["dir"]) / LOG
        try:
            text = p.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        if tail is not None:
            text = "\n".join(text.splitlines()[-tail:])
        return text

    def cancel(self, handle: JobHandle) -> None:
        d, pid = Path(handle.data["dir"]), int(handle.data["pid"])
        if not self._poll(pid):
            return
        (d / CANCELLED).write_text(str(time.time()))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)  # the trainer's checkpoint in flight completes
        deadline = time.monotonic() + self.cancel_grace_s
        while time.monotonic() < deadline and self._poll(pid):
            time.sleep(0.1)
        if self._poll(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            while self._poll(pid):
                time.sleep(0.05)


def _wrap(exit_file: Path, cmd: list[str]) -> int:
    """Run `cmd`, forward SIGTERM/SIGINT to it, write its exit code atomically."""
    write_atomic(exit_file, str(run_forwarding_signals(cmd)))
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 4 or args[0] != "wrap" or args[2] != "--":
        print("usage: python -m infra.local_backend wrap EXIT_FILE -- CMD...", file=sys.stderr)
        sys.exit(2)
    sys.exit(_wrap(Path(args[1]), args[3:]))
