"""The prep flow's accounting artifact reads as `ballast prep` prints it (issue 29, item 2):
numbers with thousands separators, and every drop reason in a row of its own (the largest
eight per stage, the rest summed), none cut."""

from __future__ import annotations

from flows.prep import accounting_md


def _report() -> dict:
    reasons = {f"gopher_quality:rule_{i}": 1000 * (12 - i) for i in range(10)}
    return {
        "stage_seconds": {"ingest": 1.25, "quality": 12.5},
        "stages": {
            "ingest": {
                "total": {
                    "docs_in": 1234567,
                    "kept": 1234567,
                    "dropped": {},
                    "bytes_in": 5_432_100_000,
                    "bytes_kept": 5_432_100_000,
                }
            },
            "quality": {
                "total": {
                    "docs_in": 1234567,
                    "kept": 1234567 - sum(reasons.values()),
                    "dropped": reasons,
                    "bytes_in": 5_432_100_000,
                    "bytes_kept": 5_000_000_000,
                }
            },
        },
    }


def test_numbers_have_thousands_separators():
    md = accounting_md(_report())
    assert "| ingest | 1,234,567 | 1,234,567 | 0 | 5,432.10 | 5,432.10 | 1.2 |" in md
    assert "| quality | 1,234,567 | 1,159,567 | 75,000 |" in md


def test_every_reason_is_shown_whole():
    md = accounting_md(_report())
    for i in range(8):
        assert f"| quality | gopher_quality:rule_{i} | {1000 * (12 - i):,} |" in md
    assert "| quality | (2 more reasons) | 7,000 |" in md  # rule_8 and rule_9: 4,000 + 3,000
    assert "| ingest |" in md.split("Dropped, by reason")[0]
    assert "| ingest |" not in md.split("Dropped, by reason")[1]  # nothing dropped there
