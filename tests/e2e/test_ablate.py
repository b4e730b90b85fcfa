"""The `ablate` flow end to end on a real temporary Prefect API: three arms of a small prep
(the base quality rule, no filter, another sequence length), two seeds each of a tiny proxy
trained as jobs on the local backend. The arms share the base's finished stages, get the
same token budget, the table's numbers are the proxies' own eval records, and a repeated
run starts no job."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import yaml

from flows.ablation.config import AblationError, load_ablation_config
from tests.support.helpers import run_cli, shared_file
from training.metrics import read

pytestmark = pytest.mark.slow


def _data(root: Path) -> dict[str, str]:
    text = shared_file("tinyshakespeare.txt").read_text(encoding="utf-8")
    paras = [p.strip() for p in text[:60_000].split("\n\n") if len(p.strip()) > 40]
    rng = random.Random(0)
    alpha = "abcdefghijklmnopqrstuvwxyz"
    (root / "clean.jsonl").write_text(
        "".join(json.dumps({"id": f"c{i}", "text": p}) + "\n" for i, p in enumerate(paras))
    )
    noise = []
    for i in range(len(paras)):
        words = ["".join(rng.choices(alpha, k=rng.randint(1, 14))) for _ in range(40)]
        noise.append(json.dumps({"id": f"n{i}", "text": " ".join(words)}) + "\n")
    (root / "noise.jsonl").write_text("".join(noise))
    held = [p.strip() for p in text[300_000:320_000].split("\n\n") if len(p.strip()) > 40][:20]
    (root / "heldout.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in held))
    prep = {
        "output": str(root / "unused"),
        "workers": 1,
        "sources": [
            {"name": "clean", "paths": [str(root / "clean.jsonl")]},
            {"name": "noise", "paths": [str(root / "noise.jsonl")]},
        ],
        "dedup": {"exact": True, "near": False},
        "quality": ["gopher_quality"],
        "pack": {"seq_len": 64},
        "dataset": {"validation_fraction": 0.05},
    }
    (root / "prep.yaml").write_text(yaml.safe_dump(prep))
    proxy = {
        "dataset": "unused",
        "steps": 1,
        "micro_batch": 8,
        "eval_every": 100,
        "model": {"d_model": 32, "n_layer": 1, "n_head": 2},
        "optim": {"name": "adamw", "lr": 3e-3},
        "schedule": {"kind": "constant", "warmup_steps": 1},
        "checkpoint": {"every": 100, "keep_last": 1},
        "launch": {"backend": "local", "nproc_per_node": 1, "max_restarts": 0},
        # One MLflow run per proxy, in one store for the whole ablation.
        "tracking": {"uri": f"sqlite:///{root / 'mlflow.db'}", "tensorboard": False},
    }
    (root / "proxy.yaml").write_text(yaml.safe_dump(proxy))
    return {"prep": str(root / "prep.yaml"), "proxy": str(root / "proxy.yaml")}


def _config(root: Path, files: dict[str, str], **over: object) -> Path:
    cfg = {
        "base": files["prep"],
        "out": str(root / "out"),
        "arms": {"no_filter": {"quality": []}, "seq32": {"pack.seq_len": 32}},
        "proxy": {"config": files["proxy"], "tokens": 8 * 64 * 6, "seeds": [0, 1]},
        "evals": {
            "every": 1000,
            "texts": [{"name": "heldout", "path": str(root / "heldout.jsonl")}],
        },
        "parallel": 2,
        **over,
    }
    path = root / "ablate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_ablation_flow(prefect_api: str, tmp_path: Path) -> None:
    from flows.ablate import ablate

    files = _data(tmp_path)
    path = _config(tmp_path, files)
    r = ablate(str(path))
    out = tmp_path / "out" / "arms"

    # Stage reuse: no_filter changes only the quality rules, seq32 only the packing.
    assert r["arms"]["no_filter"]["reuse"]["stages"] == ["ingest", "exact"]
    assert r["arms"]["seq32"]["reuse"]["stages"] == ["ingest", "exact", "quality", "tokenize"]
    for arm, stages in (("no_filter", ["ingest", "exact"]), ("seq32", ["quality", "tokenize"])):
        for stage in stages:
            sub = "tokens" if stage == "tokenize" else f"docs/{stage}"
            mine = sorted((out / arm / "prep" / sub).glob("*.parquet"))
            assert mine
            for p in mine:  # still the base's files: the arm never wrote them
                assert os.stat(p).st_ino == os.stat(out / "base" / "prep" / sub / p.name).st_ino

    # The same token budget: seq_len 32 trains twice the steps of seq_len 64.
    assert set(r["tokens"].values()) == {8 * 64 * 6}
    steps = {
        arm: {
            json.loads((out / arm / f"seed-{s}" / "final.json").read_text())["step"] for s in (0, 1)
        }
        for arm in r["arms"]
    }
    assert steps == {"base": {6}, "no_filter": {6}, "seq32": {12}}

    # The table is the proxies' own records: mean and standard error over seeds.
    for arm in r["arms"]:
        last = []
        for s in (0, 1):
            down = [
                x
                for x in read(out / arm / f"seed-{s}" / "metrics.jsonl")
                if x["kind"] == "downstream"
            ]
            last.append(down[-1]["heldout/bpb"])
        cell = r["table"][arm]["heldout/bpb"]
        assert cell["mean"] == pytest.approx(np.mean(last))
        assert cell["stderr"] == pytest.approx(np.std(last, ddof=1) / np.sqrt(2))
        if arm != "base":
            assert cell["diff"] == pytest.approx(
                np.mean(last) - r["table"]["base"]["heldout/bpb"]["mean"]
            )
    # Each row gives the steps each seed's guard dropped and its rollbacks, as its run
    # record counts them.
    for row in r["rows"]:
        finals = [
            json.loads((out / row["arm"] / f"seed-{s}" / "final.json").read_text()) for s in (0, 1)
        ]
        assert row["skipped"] == "/".join(
            str((f.get("skipped_non_finite") or 0) + (f.get("skipped_spikes") or 0)) for f in finals
        )
        assert row["rollbacks"] == "/".join(str(len(f.get("rollbacks") or [])) for f in finals)
    assert (tmp_path / "out" / "ablation.png").stat().st_size > 1000
    saved = json.loads((tmp_path / "out" / "ablation.json").read_text())
    assert saved["table"] == json.loads(json.dumps(r["table"]))
    # The noise source is filtered out in the base (gopher_quality) and kept without filter.
    assert (
        r["arms"]["base"]["kept"].get("noise", {"docs": 0})["docs"]
        < r["arms"]["no_filter"]["kept"]["noise"]["docs"]
    )

    # MLflow: each proxy a run tagged with its arm and seed, its metrics the proxy's own.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("ballast")
    logged = client.search_runs([exp.experiment_id], "tags.`ballast.ablation` = 'ablate'")
    assert sorted((x.data.tags["ballast.arm"], x.data.tags["ballast.seed"]) for x in logged) == [
        (a, s) for a in ("base", "no_filter", "seq32") for s in ("0", "1")
    ]
    for x in logged:
        rd = out / x.data.tags["ballast.arm"] / f"seed-{x.data.tags['ballast.seed']}"
        down = [d for d in read(rd / "metrics.jsonl") if d["kind"] == "downstream"]
        assert x.data.metrics["downstream/heldout/bpb"] == pytest.approx(down[-1]["heldout/bpb"])

    # Run again: every proxy finished, no job starts; the same table.
    attempts = sorted(str(p) for p in out.rglob("supervisor/*"))
    again = ablate(str(path))
    assert again["jobs"] == {}
    assert sorted(str(p) for p in out.rglob("supervisor/*")) == attempts
    assert again["table"] == r["table"]


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    files = _data(tmp_path)
    bad = _config(tmp_path, files, arms={"x": {"quality": ["no_such_rule"]}})
    with pytest.raises(AblationError, match=r"arms\.x: .*no_such_rule"):
        load_ablation_config(bad)
    bad = _config(tmp_path, files, proxy={"config": files["proxy"], "steps": 5, "tokens": 9})
    with pytest.raises(AblationError, match=r"exactly one of proxy\.steps and proxy\.tokens"):
        load_ablation_config(bad)
    bad = _config(tmp_path, files, arms={"base": {}})
    with pytest.raises(AblationError, match="`base` is the base config's own arm"):
        load_ablation_config(bad)
    bad = _config(tmp_path, files, evals=None)
    with pytest.raises(AblationError, match="the proxies need an evals section"):
        load_ablation_config(bad)
    bad = _config(
        tmp_path,
        files,
        proxy={"config": files["proxy"], "steps": 5, "overrides": {"model.d_modle": 8}},
    )
    with pytest.raises(AblationError, match=r"proxy: .*d_modle"):
        load_ablation_config(bad)
    r = run_cli("ablate", str(bad))
    assert r.returncode == 1 and "d_modle" in r.stderr and "Traceback" not in r.stderr
    # the proxies' mesh is checked against their launch before any arm is prepared
    bad = _config(
        tmp_path,
        files,
        proxy={"config": files["proxy"], "steps": 5, "overrides": {"parallel": {"tp": 2}}},
    )
    with pytest.raises(AblationError, match=r"launch\.nproc_per_node 1 .* parallel\.tp 2"):
        load_ablation_config(bad)
