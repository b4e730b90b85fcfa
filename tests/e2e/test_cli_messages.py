"""What the CLI says, through the real `ballast` command (issue 29, items 4 and 5): a
did-you-mean for unknown config keys, prep's output claim and training's remote prefix
claim naming the keys that differ, absolute paths in closing lines and path errors (with
what a relative path was resolved against), the hint for a prep output given where its
dataset is expected, and train's Ctrl-C saying how to resume."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support.helpers import ROOT, assert_one_line_error, cli_env, run_cli
from tests.support.tiny_run import write_configs

EXIT_INTERRUPTED = 130


def _corpus(root: Path) -> Path:
    (root / "data").mkdir(parents=True, exist_ok=True)
    words = [f"w{i}x{i * 7 % 13}" for i in range(400)]
    with open(root / "data" / "web.jsonl", "w", encoding="utf-8") as f:
        for i in range(30):
            text = " ".join(words[(i * 11 + j * 5) % 400] for j in range(40))
            f.write(json.dumps({"id": f"w{i}", "text": text}) + "\n")
    return root


def _prep_config(path: Path, **over: object) -> Path:
    cfg: dict[str, object] = {
        "output": "out",
        "workers": 1,
        "sources": [{"name": "web", "paths": ["data/web.jsonl"]}],
        "dedup": {"exact": True, "near": False},
        "quality": ["length"],
        "pack": {"seq_len": 64},
        **over,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def _ballast(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`ballast ARGS` run from `cwd` (not the repository root)."""
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**cli_env(), "PYTHONPATH": str(ROOT)},
    )


@pytest.fixture(scope="module")
def prepped(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, Path, subprocess.CompletedProcess[str]]:
    """A prep run started from another directory than its config's: (config dir, working
    dir, the finished run)."""
    root = tmp_path_factory.mktemp("prep")
    cfg_dir = _corpus(root / "configs")
    _prep_config(cfg_dir / "prep.yaml")
    work = root / "work"
    work.mkdir()
    r = _ballast("prep", str(cfg_dir / "prep.yaml"), "--no-progress", cwd=work)
    assert r.returncode == 0, r.stderr
    return cfg_dir, work, r


# -- did you mean ------------------------------------------------------------------------


def test_unknown_top_level_key_suggests_the_close_one(tmp_path: Path) -> None:
    cfg = _prep_config(_corpus(tmp_path) / "prep.yaml", workerz=1)
    r = run_cli("prep", str(cfg), "--no-progress")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert "workerz: unknown key; did you mean `workers`?" in r.stderr, r.stderr


def test_unknown_nested_key_suggests_the_close_one(tmp_path: Path) -> None:
    src = {"name": "web", "paths": ["data/web.jsonl"], "text_feild": "text"}
    cfg = _prep_config(_corpus(tmp_path) / "prep.yaml", sources=[src])
    r = run_cli("prep", str(cfg), "--no-progress")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert "sources[0].text_feild: unknown key; did you mean `text_field`?" in r.stderr, r.stderr


def test_unknown_quality_parameter_suggests_the_close_one(tmp_path: Path) -> None:
    cfg = _prep_config(_corpus(tmp_path) / "prep.yaml", quality=[{"length": {"min_charz": 5}}])
    r = run_cli("prep", str(cfg), "--no-progress")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert "quality[0] length.min_charz: unknown parameter" in r.stderr, r.stderr
    assert "did you mean `min_chars`?" in r.stderr, r.stderr
    assert "(got " not in r.stderr  # the list after a message that names the item is noise


def test_unknown_training_key_suggests_the_close_one(tmp_path: Path) -> None:
    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump({"dataset": "x", "model": {"d_modle": 32}}))
    r = run_cli("train", str(cfg))
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert "model.d_modle: unknown key; did you mean `d_model`?" in r.stderr, r.stderr


def test_no_suggestion_when_nothing_is_close(tmp_path: Path) -> None:
    cfg = _prep_config(_corpus(tmp_path) / "prep.yaml", zzzzzz=1)
    r = run_cli("prep", str(cfg), "--no-progress")
    assert r.returncode == 1
    assert "zzzzzz: unknown key" in r.stderr and "did you mean" not in r.stderr, r.stderr


# -- the output claim ------------------------------------------------------------------


def test_claim_refusal_names_the_keys_that_differ(prepped, tmp_path: Path) -> None:
    cfg_dir, work, _ = prepped
    other = _prep_config(cfg_dir / "other.yaml", seed=7, dedup={"exact": False, "near": False})
    r = _ballast("prep", str(other), "--no-progress", cwd=work)
    assert r.returncode == 1
    line = assert_one_line_error(r, "different config", f"{work / 'out'}")
    assert "changed: dedup.exact: True -> False, seed: 0 -> 7" in line, line
    assert "workers" not in line  # not part of what the output holds


def test_training_claim_refusal_names_the_keys_that_differ(prepped, tmp_path: Path) -> None:
    """Training's remote prefix (RUN.json) is claimed by a run of another model: the
    refusal says which config keys differ, as prep's does for its output."""
    from tests.support.factories import train_config

    _, work, _ = prepped
    store = tmp_path / "store"

    def config(name: str, run_dir: str, **model: int) -> Path:
        cfg = train_config(
            str(work / "out" / "dataset"),
            tmp_path / run_dir,
            steps=1,
            eval_every=100,
            eval_batches=1,
            model=model,
            checkpoint={"every": 1, "remote": str(store), "run_name": "shared"},
        )
        (tmp_path / name).write_text(yaml.safe_dump(cfg))
        return tmp_path / name

    first = _ballast("train", str(config("a.yaml", "a")), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    record = json.loads((store / "shared" / "RUN.json").read_text())
    assert record["config"]["model"]["d_model"] == 32
    r = _ballast("train", str(config("b.yaml", "b", d_model=64, n_head=4)), cwd=tmp_path)
    assert r.returncode == 1
    line = assert_one_line_error(r, f"{store / 'shared'}", "belongs to run 'shared'")
    assert "changed: model.d_model: 32 -> 64, model.n_head: 2 -> 4" in line, line


# -- paths -----------------------------------------------------------------------------


def test_prep_closing_lines_print_absolute_paths(prepped) -> None:
    cfg_dir, work, r = prepped
    out = work / "out"  # `output` is taken from the working directory
    assert out.is_dir() and not (cfg_dir / "out").exists()
    lines = r.stdout.splitlines()
    dataset = next(ln for ln in lines if ln.startswith("dataset: "))
    assert dataset.startswith(f"dataset: {out}/dataset/v0001  "), dataset
    assert f"`ballast verify {out}/dataset/v0001`" in dataset
    output = next(ln for ln in lines if ln.startswith("output: "))
    assert output.startswith(f"output: {out}  ("), output
    assert "taken from the working directory" in output, output
    assert f"report: {out}/v0001/report.json" in output, output


def test_missing_source_says_what_it_was_resolved_against(tmp_path: Path) -> None:
    cfg_dir = _corpus(tmp_path / "configs")
    src = {"name": "web", "paths": ["data/nope.jsonl"]}
    cfg = _prep_config(cfg_dir / "prep.yaml", sources=[src])
    r = run_cli("prep", str(cfg), "--no-progress")
    assert r.returncode == 1
    assert_one_line_error(
        r,
        f"{cfg_dir / 'data' / 'nope.jsonl'}",
        f"resolved against the config's directory, {cfg_dir}",
    )


def test_verify_missing_directory_names_the_absolute_path(tmp_path: Path) -> None:
    r = _ballast("verify", "no/such/dataset", cwd=tmp_path)
    assert r.returncode == 1
    assert_one_line_error(
        r,
        f"{tmp_path / 'no' / 'such' / 'dataset'}: no such directory",
        f"(resolved against {tmp_path})",
    )


def test_verify_on_a_prep_output_suggests_its_dataset(prepped) -> None:
    _, work, _ = prepped
    r = _ballast("verify", "out", cwd=work)
    assert r.returncode == 1
    assert_one_line_error(
        r, f"{work / 'out'}: no manifest.json", f"its dataset is {work / 'out'}/dataset"
    )


def test_verify_closing_line_is_absolute(prepped) -> None:
    _, work, _ = prepped
    r = _ballast("verify", "out/dataset", cwd=work)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{work / 'out'}/dataset/v0001: every file matches its manifest"


def test_train_on_a_prep_output_suggests_its_dataset(prepped, tmp_path: Path) -> None:
    _, work, _ = prepped
    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump({"dataset": "out", "run_dir": str(tmp_path / "run")}))
    r = _ballast("train", str(cfg), cwd=work)
    assert r.returncode == 1
    assert_one_line_error(
        r, f"{work / 'out'}: no manifest.json", f"its dataset is {work / 'out'}/dataset"
    )


def test_train_on_a_missing_dataset_names_where_it_looked(tmp_path: Path) -> None:
    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump({"dataset": "gone/dataset", "run_dir": "run"}))
    r = _ballast("train", str(cfg), cwd=tmp_path)
    assert r.returncode == 1
    assert_one_line_error(
        r, f"{tmp_path / 'gone' / 'dataset'}: no such directory", f"(resolved against {tmp_path})"
    )


# -- Ctrl-C ----------------------------------------------------------------------------


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_train_ctrl_c_says_how_to_resume(tmp_path: Path) -> None:
    prep, train = write_configs(tmp_path, steps=100_000, checkpoint_every=2)
    assert run_cli("prep", str(prep), "--no-progress").returncode == 0
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli.main", "train", str(train)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=cli_env(),
            preexec_fn=_default_sigint,
        )
        try:
            deadline = time.monotonic() + 120
            while "checkpoint at step 2" not in err_path.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, err_path.read_text()
                time.sleep(0.1)
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    stderr = err_path.read_text()
    assert rc == EXIT_INTERRUPTED, stderr
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("interrupted at step "), last
    assert "run the same command again to resume from the checkpoint at step" in last, last
    assert f"({tmp_path / 'run' / 'checkpoints'}/step-" in last, last


# -- the Prefect UI ----------------------------------------------------------------------


def test_flow_run_logs_a_clean_error_without_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What Prefect's engine does with a flow's exception (logger.exception on the flow-run
    logger), checked on the logger itself: a config error is one line, a bug keeps its
    traceback."""
    from core.errors import ConfigError
    from flows.errors import register

    register()
    logger = logging.getLogger("prefect.flow_runs")
    with caplog.at_level(logging.ERROR, logger="prefect.flow_runs"):
        for exc in (ConfigError("invalid config x.yaml:\n  workerz: unknown key"), KeyError("bug")):
            try:
                raise exc
            except Exception as e:
                logger.exception("Encountered exception during execution: %r", e)
    clean, bug = caplog.records
    assert clean.getMessage() == "error: invalid config x.yaml: workerz: unknown key"
    assert clean.exc_info is None
    assert bug.exc_info is not None and "KeyError" in bug.getMessage()
