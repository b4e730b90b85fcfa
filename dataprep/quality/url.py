"""`url`: drop documents by their URL (from the record's metadata): domains on a
blocklist, and adult words in the URL, as datatrove's URLFilter does."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from dataprep.quality.base import Drop, Rule, RuleParams, Verdict
from dataprep.quality.lists import read_list, readable_list
from dataprep.quality.text import Doc

# Whole words of a URL (split on anything not a letter or digit, lowercased) that mark
# adult sites. Deliberately short and unambiguous; `adult_words_file` adds more.
ADULT_WORDS = (
    "porn",
    "porno",
    "pornography",
    "pornographic",
    "xxx",
    "nsfw",
    "hentai",
    "camgirl",
    "camgirls",
)

_URL_WORDS = re.compile(r"[^a-z0-9]+")


class UrlParams(RuleParams):
    field: str = Field(
        default="url",
        min_length=1,
        description=(
            "The metadata key holding the URL; a dotted path reaches into nested objects "
            '("metadata.url" in Dolma). An exact key with that name wins over the path.'
        ),
    )
    blocklist: str | None = Field(
        default=None,
        description=(
            "A file of domains, one a line (`#` comments); a domain also blocks its "
            "subdomains. Relative to the working directory."
        ),
    )
    adult_words: bool = Field(
        default=True,
        description=("Drop a URL with an adult word (a short built-in list) as a whole word."),
    )
    adult_words_file: str | None = Field(
        default=None, description=("More words, added to the built-in list.")
    )
    require_url: bool = Field(
        default=False,
        description=(
            "A document without a URL is kept unless this is set (then `url:missing_url`)."
        ),
    )

    @field_validator("blocklist", "adult_words_file")
    @classmethod
    def _readable(cls, v: str | None) -> str | None:
        return readable_list(v)

    @model_validator(mode="after")
    def _something(self) -> UrlParams:
        if self.blocklist is None and not self.adult_words and not self.require_url:
            raise ValueError("nothing to check: set blocklist, adult_words or require_url")
        if self.adult_words_file is not None and not self.adult_words:
            raise ValueError("adult_words_file is set but adult_words is false")
        return self


class Url(Rule[UrlParams]):
    """Checks the document's URL; the text is not read."""

    name = "url"
    Params = UrlParams

    def setup(self) -> None:
        p = self.params
        self._blocked = frozenset(
            filter(None, map(domain_of, read_list(p.blocklist) if p.blocklist else ()))
        )
        words = (*ADULT_WORDS, *(read_list(p.adult_words_file) if p.adult_words_file else ()))
        self._words = frozenset(w.lower() for w in words) if p.adult_words else frozenset()

    def apply(self, doc: Doc) -> Verdict:
        p = self.params
        url = _lookup(doc.meta, p.field)
        if not isinstance(url, str) or not url.strip():
            return Drop("missing_url", f"no {p.field!r} in meta") if p.require_url else None
        if self._blocked:
            labels = domain_of(url).split(".")
            for i in range(len(labels)):
                domain = ".".join(labels[i:])
                if domain in self._blocked:
                    return Drop("blocklist", f"{url[:80]!r}: domain {domain!r} is blocked")
        if self._words:
            found = self._words.intersection(_URL_WORDS.split(url.lower()))
            if found:
                return Drop("adult_words", f"{url[:80]!r}: {', '.join(sorted(found))}")
        return None


def domain_of(url: str) -> str:
    """The lowercased host of a URL or bare domain ("example.com/x", "*.example.com"),
    without port or trailing dot; "" when there is none."""
    s = url.strip()
    if "://" not in s:
        s = "//" + s  # scheme-less: urlsplit would take the host for a path
    try:
        host = urlsplit(s).hostname or ""
    except ValueError:  # e.g. an unbalanced IPv6 bracket
        return ""
    return host.strip().removeprefix("*.").strip(".")


def _lookup(meta: Mapping[str, Any], field: str) -> Any:
    if field in meta:
        return meta[field]
    value: Any = meta
    for key in field.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return value
