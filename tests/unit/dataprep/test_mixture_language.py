"""A source mixed per language (sources[].languages): the `language` rule labels each
document, the tokenize stage carries the label, and the mixture plans every language of
the source as a component of its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dataprep.config import parse_config
from dataprep.pipeline import run_prep
from tests.support.helpers import read_jsonl, shared_file

# Sentences written for this test; a document is several of them, so that fastText's
# lid.176 labels it with confidence.
DE = [
    "Der Zug nach Hamburg fährt heute eine Stunde später ab.",
    "Im Garten blühen die ersten Rosen, und die Kinder spielen draußen.",
    "Wir haben am Wochenende einen langen Spaziergang am Fluss gemacht.",
    "Die Bibliothek ist montags geschlossen, aber dienstags bis abends geöffnet.",
    "Meine Großmutter backt jeden Sonntag einen Apfelkuchen für die ganze Familie.",
]
FR = [
    "Le train pour Lyon part avec une heure de retard aujourd'hui.",
    "Dans le jardin, les premières roses fleurissent et les enfants jouent dehors.",
    "Nous avons fait une longue promenade au bord de la rivière ce week-end.",
    "La bibliothèque est fermée le lundi, mais ouverte le mardi jusqu'au soir.",
    "Ma grand-mère prépare une tarte aux pommes chaque dimanche pour toute la famille.",
]


def docs(sentences: list[str], n: int) -> list[str]:
    # Each document a different rotation and length of the sentences (no exact duplicates).
    return [
        " ".join(sentences[(i + k) % len(sentences)] for k in range(2 + i % 4)) + f" ({i})"
        for i in range(n)
    ]


def prep(tmp: Path, languages: Any, **mixture: Any) -> dict[str, Any]:
    english = [r["text"] for r in read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 40)]
    rows = (
        [{"text": t} for t in english]
        + [{"text": t} for t in docs(DE, 60)]
        + [{"text": t} for t in docs(FR, 60)]
    )
    (tmp / "web.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "books.txt").write_text(shared_file("tinyshakespeare.txt").read_text()[:30_000])
    out = tmp / "out"
    run_prep(
        parse_config(
            {
                "output": str(out),
                "workers": 1,
                "sources": [
                    {
                        "name": "web",
                        "paths": [str(tmp / "web.jsonl")],
                        "languages": languages,
                        "quality": ["language"],
                    },
                    {
                        "name": "books",
                        "paths": [str(tmp / "books.txt")],
                        "txt_unit": "paragraph",
                        "quality": [],
                    },
                ],
                "dedup": {"exact": True, "near": False},
                "quality": [],
                "mixture": mixture,
                "pack": {"seq_len": 128},
                "dataset": {"validation_fraction": 0.0},
            }
        ),
        progress=False,
    )
    return json.loads((out / "v0001" / "report.json").read_text())


def test_languages_are_components_with_their_weights(tmp_path: Path) -> None:
    report = prep(tmp_path, {"en": 1.0, "de": 1.0})
    m = report["mixture"]["sources"]
    assert set(m) == {"web/de", "web/en", "web/fr", "books"}
    # French is not named: left out whole, every document of it downsampled.
    assert m["web/fr"]["available_tokens"] > 0 and m["web/fr"]["realised_tokens"] == 0
    # English and German: equal planned tokens, realised within one document of the plan.
    assert m["web/en"]["planned_tokens"] == m["web/de"]["planned_tokens"] > 0
    for c in ("web/en", "web/de"):
        assert abs(m[c]["realised_tokens"] - m[c]["planned_tokens"]) < 2_000
    # German binds (it has fewer tokens): used whole, English downsampled to match.
    assert m["web/de"]["realised_tokens"] == m["web/de"]["available_tokens"]
    assert m["web/en"]["realised_tokens"] < m["web/en"]["available_tokens"]
    mix = report["stages"]["mixture"]["sources"]["web"]
    assert mix["docs_in"] == mix["kept"] + sum(mix["dropped"].values())
    assert mix["dropped"]["downsampled"] >= 60  # every French document, and some English


def test_alpha_samples_languages_by_temperature(tmp_path: Path) -> None:
    report = prep(tmp_path, "all", alpha=0.3)
    m = report["mixture"]["sources"]
    raw = {c: m[c]["available_tokens"] ** 0.3 for c in m}
    for c in m:
        assert m[c]["target_share"] == pytest.approx(raw[c] / sum(raw.values()), rel=1e-9)
    assert {"web/en", "web/de", "web/fr"} <= set(m)


def test_bad_languages_config_names_the_key() -> None:
    from core.errors import ConfigError

    base = {"output": "/tmp/x", "sources": [{"name": "web", "paths": ["/tmp/x.jsonl"]}]}
    for bad in ({}, {"en": -1.0}, {"en": 0.0}, "some"):
        cfg = json.loads(json.dumps(base))
        cfg["sources"][0]["languages"] = bad
        with pytest.raises(ConfigError, match=r"sources\[0\]\.languages"):
            parse_config(cfg)
