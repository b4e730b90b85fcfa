"""The `classifier` quality rule and `ballast quality train`: a fastText model trained on
labelled pages, its validation report, and the rule applying it by threshold."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from cli.main import main
from dataprep.quality import filter_document, filter_documents, parse_rules
from dataprep.quality.classifier import report_path
from dataprep.quality.train_classifier import (
    ClassifierTrainConfig,
    TrainError,
    load_examples,
    train,
)
from tests.support.helpers import SHARED

LABELLED = SHARED / "web_dclm_quality_labels_train.jsonl"
# Small and fast: the mechanism, not the accuracy, is under test here.
FAST = ClassifierTrainConfig(dim=16, bucket=20_000, epoch=10, folds=3, holdout=0.25)

_PROSE = (
    "The committee met on Tuesday to discuss the new budget, and most members agreed "
    "that the proposal was sensible. It will be published next week."
)
_MENU = "Home | About | Contact\nLogin\nCart (0)\nShop now\nPrivacy | Terms"


def _synthetic() -> list[dict[str, object]]:
    rng = random.Random(0)
    rows: list[dict[str, object]] = []
    for i in range(20):
        words = _PROSE.split()
        rng.shuffle(words[5:])
        rows.append({"text": " ".join(words) + f" Item {i}.", "label": 1})
        rows.append({"text": _MENU + f"\nPage {i}", "label": 0})
    return rows


@pytest.fixture(scope="module")
def labelled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 good + 24 bad pages from the shared DCLM file, or a synthetic set without it."""
    path = tmp_path_factory.mktemp("data") / "labelled.jsonl"
    if LABELLED.exists():
        rows = [json.loads(s) for s in LABELLED.read_text(encoding="utf-8").splitlines()]
        rows = [r for r in rows if r["label"] == 1][:24] + [r for r in rows if r["label"] == 0][:24]
    else:
        rows = _synthetic()
    path.write_text(
        "".join(json.dumps({"text": r["text"], "label": r["label"]}) + "\n" for r in rows),
        encoding="utf-8",
    )
    return path


@pytest.fixture(scope="module")
def trained(labelled: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    texts, labels = load_examples(labelled=[str(labelled)])
    out = tmp_path_factory.mktemp("model") / "quality.bin"
    train(texts, labels, out, FAST)
    return out


def test_training_writes_a_loadable_model_and_report(trained: Path) -> None:
    import fasttext

    report = json.loads(report_path(trained).read_text())
    assert trained.is_file() and report["model"] == "quality.bin"
    assert 0 <= report["threshold"] <= 1
    held = report["held_out"]
    assert held["good"] + held["bad"] == held["pages"] > 0
    assert 0 <= held["precision"] <= 1 and held["recall"] == held["good_kept"]
    # The threshold keeps at least keep_good of the good training pages (out-of-fold).
    assert report["training"]["good_kept"] >= FAST.keep_good
    assert set(report["features"]["stat_edges"]) >= {"words", "line_punct_ratio"}
    labels = set(fasttext.load_model(str(trained)).get_labels())
    assert labels == {"__label__hq", "__label__cc"}


def test_rule_keeps_and_drops_by_threshold_and_records_the_score(
    trained: Path, labelled: Path
) -> None:
    texts = [json.loads(s)["text"] for s in labelled.read_text().splitlines()][:10]
    keep_all = parse_rules([{"classifier": {"model": str(trained), "threshold": 0.0}}])
    outcomes = filter_documents(keep_all, texts, [None] * len(texts))
    scores = [o.annotations["quality_score"] for o in outcomes]
    assert all(o.reason is None for o in outcomes) and all(0 <= s <= 1 for s in scores)
    # A threshold between two scores splits the pages there.
    cut = sorted(scores)[len(scores) // 2]
    if cut == min(scores):
        pytest.skip("every page scored the same; no threshold splits them")
    rule = parse_rules([{"classifier": {"model": str(trained), "threshold": cut, "key": "q"}}])
    for text, s in zip(texts, scores, strict=True):
        o = filter_document(rule, text)
        if s >= cut + 1e-4:
            assert o.reason is None and o.annotations["q"] == pytest.approx(s, abs=1e-4)
        elif s < cut - 1e-4:
            assert o.reason == "classifier:below_threshold" and "score=" in o.detail


def test_rule_defaults_to_the_reported_threshold(trained: Path) -> None:
    (rule,) = parse_rules([{"classifier": {"model": str(trained)}}])
    assert rule.threshold == pytest.approx(
        json.loads(report_path(trained).read_text())["threshold"]
    )  # type: ignore[attr-defined]


def test_bad_config_is_one_line_naming_the_key(trained: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"classifier\.model: .*no such model file") as e:
        parse_rules([{"classifier": {"model": str(tmp_path / "missing.bin")}}])
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"classifier\.threshold") as e:
        parse_rules([{"classifier": {"model": str(trained), "threshold": 1.5}}])
    assert "\n" not in str(e.value)
    bare = tmp_path / "bare.bin"  # a model from elsewhere: no report, so no threshold
    bare.write_bytes(trained.read_bytes())
    with pytest.raises(ValueError, match=r"classifier: threshold: required"):
        parse_rules([{"classifier": {"model": str(bare)}}])


def test_a_model_that_is_not_fasttext_is_refused_by_the_config_check(tmp_path: Path) -> None:
    """Issue 27, defect 7: it passed the check and failed mid-run without naming the key."""
    for name, body in (("model.bin", b"PK\x03\x04 a zip, not fastText"), ("empty.bin", b"")):
        p = tmp_path / name
        p.write_bytes(body)
        with pytest.raises(ValueError, match=r"classifier\.model: .*not a fastText model") as e:
            parse_rules([{"classifier": {"model": str(p), "threshold": 0.5}}])
        assert "\n" not in str(e.value)


def test_labels_must_be_zero_or_one(tmp_path: Path) -> None:
    p = tmp_path / "l.jsonl"
    p.write_text('{"text": "a", "label": "good"}\n')
    with pytest.raises(TrainError, match=r"record 1: field 'label' must be 1"):
        load_examples(labelled=[str(p)])


def test_cli_missing_input_exits_1_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.jsonl"
    rc = main(
        [
            "quality",
            "train",
            "--positive",
            str(missing),
            "--negative",
            str(missing),
            "--out",
            str(tmp_path / "m.bin"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and "nope.jsonl: no such file" in err


def test_a_model_from_elsewhere_works_with_a_threshold(trained: Path, tmp_path: Path) -> None:
    # A fastText binary without a Ballast report (DCLM's, say) is read as DCLM reads it.
    bare = tmp_path / "brought.bin"
    bare.write_bytes(trained.read_bytes())
    rule = parse_rules([{"classifier": {"model": str(bare), "threshold": 0.0}}])
    o = filter_document(rule, "Line one.\nLine two of a page.")
    assert o.reason is None and 0 <= o.annotations["quality_score"] <= 1


def test_prep_with_the_classifier_rule(trained: Path, labelled: Path, tmp_path: Path) -> None:
    """The rule in a `ballast prep` quality chain: every document kept or dropped as
    `classifier:below_threshold`, the score in each kept document's meta, the counts in
    the report."""
    import pyarrow.parquet as pq

    from dataprep.config import parse_config
    from dataprep.pipeline import run_prep

    threshold = json.loads(report_path(trained).read_text())["threshold"]
    out = tmp_path / "out"
    run_prep(
        parse_config(
            {
                "output": str(out),
                "workers": 1,
                "sources": [{"name": "web", "paths": [str(labelled)]}],
                "dedup": {"exact": False, "near": False},
                "quality": [{"classifier": {"model": str(trained)}}],
                "pack": {"seq_len": 256},
                "dataset": {"validation_fraction": 0.0},
            }
        ),
        until="quality",
        progress=False,
    )
    report = json.loads((out / "v0001" / "report.json").read_text())
    q = report["stages"]["quality"]["sources"]["web"]
    n = sum(1 for line in labelled.read_text().splitlines() if line.strip())
    assert q["docs_in"] == n == q["kept"] + sum(q["dropped"].values())
    assert set(q["dropped"]) <= {"classifier:below_threshold"}
    kept = pq.read_table(out / "docs" / "quality").column("meta").to_pylist()
    scores = [json.loads(m)["quality_score"] for m in kept]
    assert len(scores) == q["kept"] and all(s >= threshold for s in scores)
    dropped = pq.read_table(out / "dropped" / "quality").to_pylist()
    assert len(dropped) == q["dropped"].get("classifier:below_threshold", 0)
    for d in dropped:  # "score=0.21 < 0.58": the score under the threshold
        score, limit = (float(x) for x in d["detail"].removeprefix("score=").split(" < "))
        assert score < limit == pytest.approx(threshold, abs=1e-4)
