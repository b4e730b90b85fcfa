"""The language rule: English web text is kept as `en`, real sentences in six other
languages are identified and dropped by `keep: [en]`, `min_score` drops uncertain
documents, the language reaches the kept rows' meta in a real prep run (and meta keeps its
bytes without the rule), and config errors name the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dataprep.quality import FilterResult, filter_document, parse_rules
from dataprep.quality.language import LANGUAGES, model
from tests.support.helpers import read_jsonl, shared_file


def run(spec: list[Any], text: str) -> FilterResult:
    return filter_document(parse_rules(spec), text)


SENTENCES = {
    "de": [
        "Die Stadtverwaltung hat am Montag angekündigt, dass die Brücke über den Fluss im "
        "nächsten Frühjahr für mehrere Wochen gesperrt wird.",
        "Wir haben uns im Urlaub ein kleines Haus am See gemietet und sind jeden Morgen vor "
        "dem Frühstück schwimmen gegangen.",
        "Bitte speichern Sie Ihre Arbeit, bevor Sie das Programm schließen, sonst gehen alle "
        "Änderungen verloren.",
    ],
    "fr": [
        "Le gouvernement a présenté mercredi un projet de loi visant à réduire la consommation "
        "d'énergie des bâtiments publics.",
        "Nous sommes allés au marché samedi matin pour acheter des légumes frais et du fromage "
        "de la région.",
        "Si vous fermez cette fenêtre, les modifications non enregistrées seront perdues.",
    ],
    "es": [
        "El ayuntamiento anunció ayer que la biblioteca municipal ampliará su horario durante "
        "el periodo de exámenes.",
        "Mi abuela siempre preparaba una tortilla de patatas cuando veníamos a visitarla los "
        "domingos.",
        "No se pudo conectar con el servidor; compruebe su conexión a internet e inténtelo de "
        "nuevo.",
    ],
    "ru": [
        "В понедельник правительство объявило о новых мерах поддержки малого бизнеса в "
        "регионах страны.",
        "Мы долго гуляли по парку, а потом зашли в маленькое кафе, чтобы выпить горячего чая.",
        "Не удалось открыть файл, потому что у вас нет прав на чтение этого каталога.",
    ],
    "zh": [
        "市政府周一宣布，明年春天将对市中心的主要道路进行为期三个月的维修。",
        "我们周末去了山上的一个小村庄，那里的空气很新鲜，风景也非常美丽。",
        "无法连接到服务器，请检查您的网络设置后再试一次。",
    ],
    "ja": [
        "政府は月曜日、地方の中小企業を支援するための新しい対策を発表しました。",
        "週末は家族と一緒に海へ行って、夕方まで砂浜でのんびり過ごしました。",
        "ファイルを保存できませんでした。ディスクの空き容量を確認してください。",
    ],
}
NON_ENGLISH = [(lang, s) for lang, texts in SENTENCES.items() for s in texts]


@pytest.mark.parametrize("corpus", ["web_openwebtext_1k.jsonl", "web_c4_olmo_fixtures.jsonl"])
def test_english_web_text_is_kept_as_en(corpus: str):
    rows = read_jsonl(shared_file(corpus))
    rules = parse_rules([{"language": {"keep": ["en"]}}])
    outcomes = [filter_document(rules, r["text"]) for r in rows if r["text"].strip()]
    kept = [o for o in outcomes if o.reason is None]
    assert len(kept) / len(outcomes) >= 0.95, (len(kept), len(outcomes))
    assert all(o.annotations["language"] == "en" for o in kept)
    assert all(0.65 <= o.annotations["language_score"] <= 1 for o in kept)


@pytest.mark.parametrize(("lang", "text"), NON_ENGLISH)
def test_other_languages_are_identified_and_dropped(lang: str, text: str):
    annotated = run(["language"], text)  # no `keep`: annotate only
    assert annotated.reason is None and annotated.text == text
    assert annotated.annotations["language"] == lang
    out = run([{"language": {"keep": ["en"]}}], text)
    assert out.reason == "language:not_kept"
    assert out.detail.startswith(f"{lang} (score ")
    assert dict(out.annotations) == {}  # a dropped document carries nothing
    assert run([{"language": {"keep": ["en", lang]}}], text).reason is None


def test_min_score_drops_uncertain_documents():
    mixed = "Hello and welcome. Bonjour et bienvenue. Hola y bienvenidos. Hallo und willkommen."
    out = run(["language"], mixed)
    lang, score = out.annotations["language"], out.annotations["language_score"]
    assert score < 0.65, out.annotations
    low = run([{"language": {"keep": [lang]}}], mixed)
    assert low.reason == "language:low_score"
    assert low.detail.startswith(f"{lang} score 0.") and low.detail.endswith(" < 0.65")
    assert run([{"language": {"keep": [lang], "min_score": score - 0.01}}], mixed).reason is None
    # a clear sentence clears even a strict threshold; 1.0 keeps only certainty
    clear = SENTENCES["de"][0]
    assert run([{"language": {"keep": ["de"], "min_score": 0.9}}], clear).reason is None
    assert (
        run([{"language": {"keep": ["de"], "min_score": 1.0}}], clear).reason
        == "language:low_score"
    )


def test_annotations_survive_edits_by_other_rules():
    text = SENTENCES["fr"][1] + " Écrivez à marie.dupont@exemple.fr pour réserver."
    for chain in (["language", "pii"], ["pii", "language"]):
        out = run(chain, text)
        assert "email@example.com" in (out.text or "") and dict(out.redacted) == {"email": 1}
        assert out.annotations["language"] == "fr"


def test_odd_text_is_identified_not_raised():
    assert (
        run(
            ["language"], "Ein Satz\ud800 auf Deutsch, mit einem kaputten Zeichen darin."
        ).annotations["language"]
        == "de"
    )
    empty = run([{"language": {"keep": ["en"]}}], "")
    assert empty.reason == "language:low_score"  # as datatrove: nothing scores high


def test_language_codes_are_the_models_labels():
    labels, _ = model().predict("x", k=-1, threshold=-1.0)
    assert {label.removeprefix("__label__") for label in labels} == LANGUAGES
    assert len(LANGUAGES) == 176


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"min_score": 1.5, "keep": ["en"]},
            "quality[0] language.min_score: Input should be less than or equal to 1 (got 1.5)",
        ),
        (
            {"min_score": -0.1, "keep": ["en"]},
            "quality[0] language.min_score: Input should be greater than or equal to 0 (got -0.1)",
        ),
        (
            {"keep": ["EN", "english"]},
            "quality[0] language.keep: not a lid.176 language code: 'EN', 'english'",
        ),
        ({"keep": []}, "quality[0] language.keep: empty list keeps nothing"),
        ({"min_score": 0.5}, "quality[0] language: min_score is set but keep is not"),
        ({"keep": ["en"], "threshold": 0.5}, "quality[0] language.threshold: unknown parameter"),
    ],
)
def test_config_errors_name_the_key(spec: dict, message: str):
    with pytest.raises(ValueError) as err:
        parse_rules([{"language": spec}])
    assert message in str(err.value)


# --- a real prep run ---------------------------------------------------------------------


def _prep(tmp_path: Path, name: str, rows: list[dict], quality: list[Any]) -> Path:
    from dataprep.config import parse_config
    from dataprep.pipeline import run_prep

    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    out = tmp_path / f"out-{name}"
    cfg = parse_config(
        {
            "output": str(out),
            "workers": 1,
            "sources": [
                {"name": "web", "paths": [str(data)], "id_field": "id", "quality": quality}
            ],
            "dedup": {"exact": False, "near": False},
        }
    )
    run_prep(cfg, until="quality", progress=False)
    return out


def _metas(out: Path, stage: str) -> dict[str, str]:
    import pyarrow.parquet as pq

    return {
        r["id"]: r["meta"]
        for f in sorted(out.rglob(f"docs/{stage}/*.parquet"))
        for r in pq.read_table(f).to_pylist()
    }


def test_language_in_the_meta_of_a_real_prep_run(tmp_path: Path):
    english = read_jsonl(shared_file("web_openwebtext_1k.jsonl"), limit=6)
    rows = [
        {"id": r["id"], "text": r["text"], "url": f"https://example.org/{i}"}
        for i, r in enumerate(english)
    ]
    rows += [
        {"id": f"{lang}-{i}", "text": s, "url": "https://example.org/x"}
        for i, (lang, s) in enumerate(NON_ENGLISH[::3])
    ]
    out = _prep(tmp_path, "lang", rows, [{"language": {"keep": ["en"]}}])
    ingested, kept = _metas(out, "ingest"), _metas(out, "quality")
    assert set(kept) == {r["id"] for r in rows[:6]}  # English kept, the rest dropped
    for doc_id, meta in kept.items():
        fields = json.loads(meta)
        assert fields["language"] == "en" and fields["language_score"] >= 0.65
        del fields["language"], fields["language_score"]
        assert fields == json.loads(ingested[doc_id])  # the record's own fields untouched
    report = json.loads((out / "v0001" / "report.json").read_text())
    assert report["stages"]["quality"]["total"]["dropped"] == {"language:not_kept": len(rows) - 6}

    # without the rule, every kept row's meta is the very string ingest wrote
    plain = _prep(tmp_path, "plain", rows, ["length"])
    ingested, kept = _metas(plain, "ingest"), _metas(plain, "quality")
    assert len(kept) == len(rows) and all(kept[i] == ingested[i] for i in kept)
    assert not any("language" in json.loads(m) for m in kept.values())
