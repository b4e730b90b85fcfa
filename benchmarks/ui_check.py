"""Check, in a real browser, what a Prefect user sees of a `pipeline` run: the loss curve as
a picture, the training summary with the final validation loss, the pipeline summary, the
progress bar and the attempts table.

    python -m benchmarks.ui_check [--out benchmarks/results/ui] [--steps 60]

Needs headless Chromium from Debian's packages (`apt-get install chromium`) and Playwright
in the venv (`.venv/bin/pip install playwright`: the Python package only; its own browser
download is never used, the script points it at /usr/bin/chromium). Without either, it says
so and exits 0 (nothing checked). It starts a temporary Prefect server (SQLite in a temp
dir, loopback), runs `flows.pipeline` on a small corpus that ships with Python, opens each
artifact's page, checks that the picture is decoded (naturalWidth > 0) and the texts are
there, and writes screenshots plus `ui_check.json` to --out. Exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="ballast-ui-"))
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
    results: dict[str, Any] = {"prefect_ui": f"http://127.0.0.1:{port}", "checks": {}}
    try:
        wait_healthy(api, server)
        from tests.tiny_run import write_configs

        prep, train = write_configs(
            tmp, args.steps, train_name="ui-check.yaml", eval_every=20, checkpoint_every=20
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
        arts = {
            a["key"]: a
            for a in sorted(api_post(api, "/artifacts/filter", {}), key=lambda a: a["created"])
            if a.get("key")
        }
        pages = {
            "train-loss-curve": ("img", None),
            "train-summary": ("img", "validation loss"),
            "pipeline-summary": (None, "final validation loss"),
            "train-progress": (None, "100"),
            "train-attempts": (None, "done"),
        }
        ok = True
        with sync_playwright() as pw:
            b = pw.chromium.launch(executable_path=browser, headless=True, args=["--no-sandbox"])
            page = b.new_page(viewport={"width": 1400, "height": 1000})
            for key, (img, text) in pages.items():
                check: dict[str, Any] = {"found": key in arts}
                results["checks"][key] = check
                if key not in arts:
                    ok = False
                    continue
                url = f"http://127.0.0.1:{port}/artifacts/artifact/{arts[key]['id']}"
                page.goto(url, wait_until="networkidle")
                page.wait_for_timeout(1500)  # the UI renders after its API calls return
                shot = out / f"{key}.png"
                page.screenshot(path=str(shot), full_page=True)
                check.update(url=url, screenshot=str(shot))
                if img:
                    sizes = page.eval_on_selector_all(
                        "img",
                        "els => els.map(e => [e.naturalWidth, e.naturalHeight, "
                        "e.src.slice(0, 22)])",
                    )
                    drawn = [s for s in sizes if s[0] > 0 and s[2] == "data:image/png;base64,"]
                    check["image"] = drawn[0][:2] if drawn else None
                    ok &= bool(drawn)
                if text:
                    body = page.inner_text("body")
                    check["text"] = text in body
                    ok &= text in body
            b.close()
        results["ok"] = ok
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    (out / "ui_check.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0 if results.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
