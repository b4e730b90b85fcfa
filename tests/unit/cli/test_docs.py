"""The docs: docs/config.md is what the config models say, every config key has a
description, and the README's and docs/' links lead to files and headings that exist."""

from __future__ import annotations

import re
from pathlib import Path

from cli import config_docs
from tests.support.helpers import ROOT

PAGES = [ROOT / "README.md", ROOT / "k8s" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_config_md_is_current(capsys):
    assert config_docs.main(["check"]) == 0, capsys.readouterr().out


def test_check_names_a_stale_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "config.md").write_text("# Config reference\n(old)\n")
    monkeypatch.setattr(config_docs, "ROOT", tmp_path)
    monkeypatch.setattr(config_docs, "OUT", tmp_path / "docs" / "config.md")
    assert config_docs.main(["check"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("docs/config.md is stale")


def _undescribed(path: str, cls: type, seen: set[type]) -> list[str]:
    seen.add(cls)
    missing = []
    for key in config_docs.keys(cls):
        if not (key.info.description or "").strip():
            missing.append(f"{path}.{key.name}")
        for suffix, sub in config_docs.nested(key.annotation):
            if sub not in seen:
                missing += _undescribed(f"{path}.{key.name}{suffix}", sub, seen)
    return missing


def test_every_config_key_has_a_description():
    seen: set[type] = set()
    missing = []
    for root, cls in config_docs.models().items():
        missing += _undescribed(root, cls, seen)
    for name, rule in config_docs.rules().items():
        missing += _undescribed(f"quality.{name}", rule.Params, seen)
    assert not missing, "keys without Field(description=...): " + ", ".join(missing)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors (the same rule the generator uses for its own)."""
    r = config_docs.Renderer()
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {r.anchor(m.group(1).strip()) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_links_lead_somewhere():
    bad = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in LINK.findall(text):
            if "://" in target or target.startswith("mailto:"):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, "\n".join(bad)
