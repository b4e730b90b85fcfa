"""Credentials inside `storage.endpoint_url` (issue 27, defect 3): configs are copied into
prep's _run.json, final.json, every checkpoint and MLflow, so a URL with userinfo is refused
when the config is read, naming the key and never echoing the value."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from core.errors import ConfigError
from tests.support.helpers import ROOT, run_cli
from training.config import TrainConfigError, parse_train_config

SECRET = "s3cr3t-Pa55"
URLS = [f"http://minio:{SECRET}@127.0.0.1:9000", f"https://{SECRET}@s3.example.com"]


@pytest.mark.parametrize("url", URLS)
def test_the_training_config_refuses_userinfo(url):
    with pytest.raises(TrainConfigError) as e:
        parse_train_config({"dataset": "d", "storage": {"endpoint_url": url}}, "t.yaml")
    assert "storage.endpoint_url: credentials in the URL" in str(e.value)
    assert SECRET not in str(e.value)


def test_the_prep_config_refuses_userinfo():
    from dataprep.config import parse_config

    with pytest.raises(ConfigError) as e:
        parse_config(
            {
                "output": "o",
                "sources": [{"name": "a", "paths": ["x"]}],
                "storage": {"endpoint_url": URLS[0]},
            },
            "p.yaml",
        )
    assert "storage.endpoint_url: credentials in the URL" in str(e.value)
    assert SECRET not in str(e.value)


def test_an_endpoint_without_userinfo_is_kept():
    cfg = parse_train_config({"dataset": "d", "storage": {"endpoint_url": "http://127.0.0.1:9000"}})
    assert cfg.storage.endpoint_url == "http://127.0.0.1:9000"


def test_commands_exit_1_without_echoing_the_secret(tmp_path):
    prep = tmp_path / "prep.yaml"
    prep.write_text(
        yaml.safe_dump(
            {
                "output": str(tmp_path / "out"),
                "sources": [{"name": "a", "paths": [str(tmp_path)]}],
                "storage": {"endpoint_url": URLS[0]},
            }
        )
    )
    r = run_cli("prep", str(prep))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "storage.endpoint_url" in r.stderr and SECRET not in r.stdout + r.stderr
    assert not (tmp_path / "out").exists()  # nothing written, _run.json included

    train = tmp_path / "train.yaml"
    train.write_text(
        yaml.safe_dump(
            {
                "dataset": str(tmp_path),
                "run_dir": str(tmp_path / "r"),
                "storage": {"endpoint_url": URLS[0]},
            }
        )
    )
    t = subprocess.run(
        [sys.executable, "-m", "training.train", "--config", str(train)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert t.returncode == 1 and "Traceback" not in t.stderr, t.stderr
    assert "storage.endpoint_url" in t.stderr and SECRET not in t.stdout + t.stderr
    assert not (tmp_path / "r").exists()
