"""Check, in a real browser, what a Prefect user sees of a `pipeline` run: the train flow
run's logs (the human progress lines: step, loss, tokens/s, ETA), its artifacts (one
attempts table, updated in place, no wider than the page; the progress bar with step and
loss; the loss curve as a picture with its legend and no data URL printed as text; the
training summary) and the pipeline summary.

    python -m benchmarks.ui_check [--out benchmarks/results/ui] [--steps 60]

Needs headless Chromium from Debian's packages (`apt-get install chromium`) and Playwright
in the venv (`.venv/bin/pip install playwright`: the Python package only; its own browser
download is never used, the script points it at /usr/bin/chromium). Without either, it says
so and exits 0 (nothing checked). It starts a temporary Prefect server (SQLite in a temp
dir, loopback), runs `flows.pipeline` on a small corpus that ships with Python, with its
configs, prep output and training run under `--out`/run, opens each page, and writes
screenshots to `--out`/run/screenshots (for a person to look at) and `ui_check.json` to
--out. Exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, ROOT

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(api: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{api}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"prefect server not healthy after {timeout:.0f} s")


def api_post(api: str, path: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        f"{api}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


PROGRESS_LINE = re.compile(r"step \d+/\d+, loss \d+\.\d+, [\d,]+ tokens/s, ETA \d+m\d\ds")


def flow_run_id(api: str, flow_name: str) -> str:
    runs = api_post(api, "/flow_runs/filter", {"flows": {"name": {"any_": [flow_name]}}})
    if len(runs) != 1:
        raise RuntimeError(f"{len(runs)} flow runs of {flow_name!r}, expected 1")
    return str(runs[0]["id"])


def run_artifacts(api: str, run_id: str) -> list[dict[str, Any]]:
    return api_post(api, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})


# In the page: does the table fit? Its right edge against the window's, and no element from
# the table up to the page scrolls sideways (a table cut off at its wrapper's edge).
TABLE_FITS = """() => {
  const t = document.querySelector('table');
  if (!t) return null;
  const overflow = [];
  for (let e = t; e && e !== document.documentElement; e = e.parentElement) {
    if (e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX !== 'visible')
      overflow.push([e.tagName, e.className, e.scrollWidth, e.clientWidth]);
  }
  const r = t.getBoundingClientRect();
  return {right: Math.round(r.right), width: Math.round(r.width),
          window: window.innerWidth, overflow: overflow,
          columns: Array.from(t.querySelectorAll('th')).map(th => th.innerText.trim())};
}"""

IMAGES = """els => els.map(e => [e.naturalWidth, e.naturalHeight, e.src.slice(0, 22)])"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "ui"))
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    browser = next((p for p in CHROMIUM if Path(p).is_file()), None)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None  # type: ignore[assignment]
    if browser is None or sync_playwright is None:
        print(
            "ui_check: skipped: needs Chromium (apt-get install chromium) and Playwright "
            "(.venv/bin/pip install playwright)"
        )
        return 0
    out = Path(args.out).resolve()
    run_root = out / "run"  # configs, prep output, the training run and the screenshots
    shutil.rmtree(run_root, ignore_errors=True)
    shots = run_root / "screenshots"
    shots.mkdir(parents=True)
    tmp = Path(tempfile.mkdtemp(prefix="ballast-ui-"))  # the Prefect server's home only
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(tmp / "prefect"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_API_URL": api,
    }
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefect",
            "server",
            "start",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ui = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {"prefect_ui": ui, "run": str(run_root), "checks": {}}
    checks = results["checks"]
    try:
        wait_healthy(api, server)
        from tests.tiny_run import write_configs

        prep, train = write_configs(
            run_root, args.steps, train_name="ui-check.yaml", eval_every=20, checkpoint_every=20
        )
        t0 = time.monotonic()
        run = subprocess.run(
            [sys.executable, "-m", "flows.pipeline", str(prep), str(train)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        results["pipeline_seconds"] = round(time.monotonic() - t0, 1)
        if run.returncode != 0:
            print(run.stdout[-3000:] + run.stderr[-3000:])
            raise RuntimeError(f"flows.pipeline exited {run.returncode}")
        train_run = flow_run_id(api, "train")
        arts = run_artifacts(api, train_run) + run_artifacts(api, flow_run_id(api, "pipeline"))
        by_key: dict[str, list[dict[str, Any]]] = {}
        for a in arts:
            by_key.setdefault(a.get("key") or "", []).append(a)
        # One card per artifact: the attempts table and the progress bar were updated in
        # place, not posted again at each change.
        checks["one artifact per key"] = {
            k: len(v) for k, v in by_key.items() if k.startswith(("train-", "pipeline-"))
        }
        ok = all(n == 1 for n in checks["one artifact per key"].values())
        ok &= "train-attempts" in by_key
        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path=browser, headless=True, args=["--no-sandbox"])
            page = b.new_page(viewport={"width": 1400, "height": 1000})

            def visit(name: str, url: str) -> str:
                page.goto(url, wait_until="networkidle")
                page.wait_for_timeout(1500)  # the UI renders after its API calls return
                shot = shots / f"{name}.png"
                page.screenshot(path=str(shot), full_page=True)
                checks[name] = {"url": url, "screenshot": str(shot)}
                return page.inner_text("body")

            # The train flow run's logs: the human progress lines, not JSON events.
            body = visit("train-logs", f"{ui}/runs/flow-run/{train_run}")
            for _ in range(30):  # the log list loads more as it scrolls
                if PROGRESS_LINE.search(body):
                    break
                page.mouse.wheel(0, 2000)
                page.wait_for_timeout(300)
                body = page.inner_text("body")
            page.screenshot(path=checks["train-logs"]["screenshot"], full_page=True)
            found = PROGRESS_LINE.search(body)
            checks["train-logs"].update(
                progress_line=found.group(0) if found else None,
                json_events='{"event"' in body,
            )
            ok &= bool(found) and '{"event"' not in body

            def artifact(key: str) -> str | None:
                if key not in by_key:
                    checks[key] = {"found": False}
                    return None
                return visit(key, f"{ui}/artifacts/artifact/{by_key[key][0]['id']}")

            if (body := artifact("train-attempts")) is not None:
                fits = page.evaluate(TABLE_FITS)
                checks["train-attempts"]["table"] = fits
                checks["train-attempts"]["done"] = "done" in body
                ok &= bool(fits and not fits["overflow"] and fits["right"] <= fits["window"]) and (
                    "done" in body
                )
            if (body := artifact("train-progress")) is not None:
                has = bool(re.search(r"done\W+at step \d+, loss \d", body))
                checks["train-progress"].update(step_and_loss=has, full="100" in body)
                ok &= has and "100" in body
            for key, text in (
                ("train-loss-curve", "blue: train loss; green: validation loss"),
                ("train-summary", "validation loss"),
            ):
                if (body := artifact(key)) is None:
                    ok = False
                    continue
                drawn = [
                    s
                    for s in page.eval_on_selector_all("img", IMAGES)
                    if s[0] > 0 and s[2] == "data:image/png;base64,"
                ]
                checks[key].update(
                    image=drawn[0][:2] if drawn else None,
                    legend=text in body,
                    data_url_as_text="data:image" in body,
                )
                ok &= bool(drawn) and text in body and "data:image" not in body
            if (body := artifact("pipeline-summary")) is not None:
                checks["pipeline-summary"]["text"] = "final validation loss" in body
                ok &= "final validation loss" in body
            else:
                ok = False
            b.close()
        results["ok"] = bool(ok)
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    (out / "ui_check.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0 if results.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
