"""`ballast quality train` with labelled pages and extra good pages (issue 27, defect 7): the
extra pages are trained on, but the held-out split and the threshold come from the labelled
pages only; calibrated on the mixed positives, the threshold kept 62.5% of unseen labelled
good pages instead of 85%."""

from __future__ import annotations

import json
from pathlib import Path

from cli.main import main
from dataprep.quality.train_classifier import ClassifierTrainConfig, load_calibrated, train
from tests.support.helpers import shared_file

FAST = ClassifierTrainConfig(dim=16, bucket=20_000, epoch=10, folds=3, holdout=0.25)


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_extra_positives_train_but_do_not_calibrate(tmp_path):
    rows = [
        json.loads(s)
        for s in shared_file("web_dclm_quality_labels_train.jsonl")
        .read_text(encoding="utf-8")
        .splitlines()
    ]
    labelled = _write(
        tmp_path / "labelled.jsonl",
        [r for r in rows if r["label"] == 1][:30] + [r for r in rows if r["label"] == 0][:30],
    )
    extra = _write(
        tmp_path / "extra.jsonl",
        [
            {"text": json.loads(s)["text"]}
            for s in shared_file("web_openwebtext_1k.jsonl")
            .read_text(encoding="utf-8")
            .splitlines()[:90]
        ],
    )
    texts, labels, calibrate = load_calibrated(positive=[str(extra)], labelled=[str(labelled)])
    assert calibrate == [False] * 90 + [True] * 60 and labels[:90] == [1] * 90

    report = train(texts, labels, tmp_path / "cal.bin", FAST, calibrate=calibrate)
    held = report["held_out"]
    # The held-out pages are a quarter of the labelled ones: no extra page among them.
    assert (held["good"], held["bad"]) == (8, 8)
    # The threshold keeps at least 85% of the labelled good training pages (out of fold).
    assert report["training"]["good"] == 22 and report["training"]["good_kept"] >= 0.85
    assert report["calibration"] == {"pages": "labelled", "labelled": 60, "extra_trained_on": 90}
    assert "of the good labelled training pages" in report["threshold_rule"]

    mixed = train(texts, labels, tmp_path / "mixed.bin", FAST)  # the old calibration
    assert mixed["held_out"]["good"] > 8 and "calibration" not in mixed

    # The command line calibrates on the labelled pages when both are given.
    assert (
        main(
            [
                "quality",
                "train",
                "--positive",
                str(extra),
                "--labelled",
                str(labelled),
                "--out",
                str(tmp_path / "cli.bin"),
                "--epoch",
                "10",
            ]
        )
        == 0
    )
    cli = json.loads((tmp_path / "cli.report.json").read_text())
    assert cli["calibration"]["labelled"] == 60
    assert cli["held_out"]["good"] + cli["held_out"]["bad"] <= 60 // 4 + 2
