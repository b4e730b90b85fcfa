"""The pii and decontaminate rules: what is replaced and what is left, the replacement
counts in the report of a real prep run, n-gram overlap with an evaluation set built from
real text (13 shared words drop a document, 12 do not), and config errors naming the key
and the path."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from core.errors import ConfigError
from dataprep.config import parse_config
from dataprep.quality import FilterResult, filter_document, parse_rules
from dataprep.quality.decontam import normalise
from tests.support.helpers import read_jsonl, shared_file


def run(spec: list[Any], text: str) -> FilterResult:
    return filter_document(parse_rules(spec), text)


def config_error(spec: Any) -> str:
    with pytest.raises(ValueError) as err:
        parse_rules(spec)
    return str(err.value)


# --- pii -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected", "counts"),
    [
        (
            "Write to jane.doe@mail.example.net today.",
            "Write to email@example.com today.",
            {"email": 1},
        ),
        (
            "Contact John.Smith+news@Example.COM or ops@host-1.io.",
            "Contact email@example.com or email@example.com.",
            {"email": 2},
        ),
        (
            "The server at 8.8.8.8 answered; so did 163.36.107.25.",
            "The server at 22.214.171.124 answered; so did 22.214.171.124.",
            {"ip": 2},
        ),
        (
            "Cloudflare's resolver is 2606:4700:4700::1111 on IPv6.",
            "Cloudflare's resolver is 22.214.171.124 on IPv6.",
            {"ip": 1},
        ),
        (
            "Mail me@uni.edu from 35.88.121.75",
            "Mail email@example.com from 22.214.171.124",
            {"email": 1, "ip": 1},
        ),
    ],
)
def test_pii_replaces_emails_and_public_ips(text: str, expected: str, counts: dict):
    out = run(["pii"], text)
    assert (out.text, dict(out.redacted), out.reason) == (expected, counts, None)


@pytest.mark.parametrize(
    "text",
    [
        "The router is 192.168.0.1 and the NAS 10.0.0.5; localhost is 127.0.0.1.",
        "Requires Python 3.11.4 or v2.0.1; see release v1.2.3.4 and build 1.2.3.4.5.",
        "Invalid: 999.999.999.999, 108.0.0.01, 192.168.l.1; docs use 192.0.2.7.",
        "At 12:30:45 we ran std::vector and add::be; loopback ::1, docs 2001:db8::1.",
        "No addresses here, only an @mention and a user@localhost-less sentence.",
    ],
)
def test_pii_keeps_private_ips_versions_and_lookalikes(text: str):
    out = run(["pii"], text)
    assert (out.text, dict(out.redacted)) == (text, {})


def test_pii_replacements_and_switches_are_configurable():
    text = "Ask bob@corp.example.org at 8.8.4.4."
    out = run([{"pii": {"email_replacement": "<EMAIL>", "ip_replacement": "<IP>"}}], text)
    assert (out.text, dict(out.redacted)) == ("Ask <EMAIL> at <IP>.", {"email": 1, "ip": 1})
    assert run([{"pii": {"ips": False}}], text).text == "Ask email@example.com at 8.8.4.4."
    assert (
        run([{"pii": {"emails": False}}], text).text == "Ask bob@corp.example.org at "
        "22.214.171.124."
    )


def test_pii_twice_counts_nothing_the_second_time():
    once = run(["pii"], "a@b.com and 8.8.8.8")
    twice = run(["pii"], once.text or "")
    assert dict(once.redacted) == {"email": 1, "ip": 1}
    assert (twice.text, dict(twice.redacted)) == (once.text, {})


def test_counts_survive_later_edits_and_vanish_with_a_drop():
    prose = (
        "Reach the desk at news@paper.example.com for corrections. " * 3
        + "\nshort line\n"
        + "Our mirror at 8.8.8.8 serves the archive every day. " * 3
    )
    out = run(["pii", {"c4": {"min_num_sentences": 1}}], prose)
    assert out.reason is None and "short line" not in (out.text or "")  # C4 edited it
    assert dict(out.redacted) == {"email": 3, "ip": 3}
    dropped = run(["pii", {"length": {"min_chars": 10_000}}], prose)
    assert dropped.reason == "length:min_chars" and dict(dropped.redacted) == {}


# --- decontaminate ---------------------------------------------------------------------


def _span(text: str, start: int, n: int) -> list[str]:
    """n consecutive whitespace tokens of `text` from token `start` that normalise to one
    word each (ASCII letters/digits with at most inner punctuation)."""
    toks = text.split()
    for i in range(start, len(toks) - n):
        span = toks[i : i + n]
        if all(t.isascii() and len(normalise(t)) == 1 for t in span):
            return span
    raise AssertionError("no clean span")


@pytest.fixture
def eval_set(tmp_path: Path) -> tuple[Path, list[dict], list[dict]]:
    rows = read_jsonl(shared_file("web_openwebtext_1k.jsonl"), 60)
    evals, others = rows[:20], rows[20:]
    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"question": r["text"]}) + "\n" for r in evals))
    return path, evals, others


def _planted(host: str, span: list[str]) -> str:
    # Other case and punctuation than the eval example: the overlap must still be found.
    shouted = ", ".join(w.upper() for w in span)
    half = len(host) // 2
    cut = host.index(" ", half)
    return f"{host[:cut]} ({shouted}!) {host[cut:]}"


def test_decontaminate_drops_13_shared_words_and_keeps_12(eval_set):
    path, evals, others = eval_set
    rules = parse_rules([{"decontaminate": {"files": [str(path)], "field": "question"}}])
    host = others[0]["text"]
    assert filter_document(rules, host).reason is None  # unrelated real text is kept
    example = 7
    span = _span(evals[example]["text"], 40, 13)
    out = filter_document(rules, _planted(host, span))
    assert out.reason == "decontaminate:ngram_overlap"
    ngram = " ".join(normalise(" ".join(span)))[:80]
    assert out.detail == f"13-gram {ngram!r} of {path} line {example + 1}"
    assert filter_document(rules, _planted(host, span[:12])).reason is None
    # every real document outside the eval set is kept, every one inside it dropped
    assert all(filter_document(rules, r["text"]).reason is None for r in others)
    assert all(
        filter_document(rules, r["text"]).reason for r in evals if len(normalise(r["text"])) >= 13
    )


def test_decontaminate_plain_text_file_and_ngram_size(tmp_path: Path):
    lines = [
        ln
        for ln in shared_file("tinyshakespeare.txt").read_text().splitlines()
        if len(normalise(ln)) >= 8
    ][:50]
    path = tmp_path / "eval.txt"
    path.write_text("\n".join(lines) + "\n")
    rules = parse_rules([{"decontaminate": {"files": [str(path)], "ngram": 8}}])
    words = lines[10].split()
    doc = "Prologue. " + " ".join(words).upper() + " Epilogue."
    out = filter_document(rules, doc)
    assert out.reason == "decontaminate:ngram_overlap"
    assert f"of {path} line " in out.detail
    assert filter_document(rules, "Prologue. " + " ".join(words[:7]) + " Epilogue.").reason is None


def test_decontaminate_rule_rebuilds_in_a_copy(eval_set):
    path, evals, _ = eval_set
    (rule,) = parse_rules([{"decontaminate": {"files": [str(path)], "field": "question"}}])
    copy = pickle.loads(pickle.dumps(rule))
    assert filter_document([copy], evals[3]["text"]).reason == "decontaminate:ngram_overlap"


def test_decontaminate_config_errors_name_the_key_and_path(tmp_path: Path):
    missing = tmp_path / "gone" / "eval.jsonl"
    assert config_error([{"decontaminate": {"files": [str(missing)]}}]) == (
        f"quality[0] decontaminate.files: cannot read {missing}: No such file or directory"
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"prompt": "no text field"}\n')
    assert config_error(["c4", {"decontaminate": {"files": [str(bad)]}}]) == (
        f"quality[1] decontaminate: {bad} line 2: not a JSON object with a string 'text' field"
    )
    short = tmp_path / "short.txt"
    short.write_text("too short to match\n")
    assert config_error([{"decontaminate": {"files": [str(short)]}}]) == (
        f"quality[0] decontaminate: no example in {short} has 13 words: nothing to match"
    )
    assert config_error(["decontaminate"]).startswith(
        "quality[0] decontaminate.files: Field required"
    )
    assert config_error([{"decontaminate": {"files": [str(short)], "ngram": 0}}]).startswith(
        "quality[0] decontaminate.ngram: Input should be greater than or equal to 1"
    )
    assert "quality[0] pii.email: unknown parameter (known: emails, ips" in (
        config_error([{"pii": {"email": False}}])
    )
    data = {
        "output": str(tmp_path / "out"),
        "sources": [
            {
                "name": "web",
                "paths": ["x.jsonl"],
                "quality": ["pii", {"decontaminate": {"files": [str(missing)]}}],
            }
        ],
    }
    with pytest.raises(ConfigError) as err:
        parse_config(data, where="t.yaml")
    lines = [ln for ln in str(err.value).splitlines() if "decontaminate.files" in ln]
    assert len(lines) == 1 and f"cannot read {missing}: No such file" in lines[0]


# --- the report ------------------------------------------------------------------------


def _prep(tmp_path: Path, name: str, rows: list[dict], quality: list[Any]) -> dict:
    from dataprep.pipeline import run_prep

    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = parse_config(
        {
            "output": str(tmp_path / f"out-{name}"),
            "workers": 1,
            "sources": [
                {"name": "web", "paths": [str(data)], "id_field": "id", "quality": quality}
            ],
            "dedup": {"exact": False, "near": False},
        }
    )
    return run_prep(cfg, until="quality", progress=False)


def test_replacements_and_contamination_in_a_real_prep_report(tmp_path: Path, eval_set):
    import pyarrow.parquet as pq

    path, evals, others = eval_set
    rows = [{"id": r["id"], "text": r["text"]} for r in others[:30]]
    rows[0]["text"] += "\n\nWrite to tips@newsroom.example.org or visit 93.184.216.34."
    rows[1]["text"] += "\n\nPress: press@agency.example.com, backup 10.1.2.3 (private)."
    rows[2]["text"] = _planted(rows[2]["text"], _span(evals[5]["text"], 10, 13))
    chain = ["pii", {"decontaminate": {"files": [str(path)], "field": "question"}}]
    report = _prep(tmp_path, "pii", rows, chain)
    quality = report["stages"]["quality"]
    assert quality["total"]["redacted"] == {"email": 2, "ip": 1}
    assert quality["sources"]["web"]["redacted"] == {"email": 2, "ip": 1}
    assert quality["total"]["dropped"] == {"decontaminate:ngram_overlap": 1}
    assert quality["total"]["kept"] == 29 and report["problems"] == []
    assert "redacted" not in report["stages"]["ingest"]["total"]  # no other stage redacts
    on_disk = json.loads((tmp_path / "out-pii" / "v0001" / "report.json").read_text())
    assert on_disk["stages"]["quality"]["total"]["redacted"] == {"email": 2, "ip": 1}
    kept = {
        r["id"]: r["text"]
        for f in (tmp_path / "out-pii").rglob("docs/quality/*.parquet")
        for r in pq.read_table(f).to_pylist()
    }
    assert kept[rows[0]["id"]].endswith("Write to email@example.com or visit 22.214.171.124.")
    assert "10.1.2.3" in kept[rows[1]["id"]] and rows[2]["id"] not in kept

    # a run without pii reports exactly the keys it reported before
    plain = _prep(tmp_path, "plain", rows[:5], ["length"])
    for stage in plain["stages"].values():
        for stats in (stage["total"], *stage["sources"].values()):
            assert set(stats) == {
                "docs_in",
                "bytes_in",
                "kept",
                "bytes_kept",
                "dropped",
                "bytes_dropped",
            }
