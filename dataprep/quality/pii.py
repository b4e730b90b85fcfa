"""`pii`: replace e-mail addresses and public IP addresses with fixed placeholders, as
datatrove's PIIFormatter (pipeline/formatters/pii.py) does; the document is kept with the
edited text and the replacements are counted for the report."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable

from pydantic import Field

from dataprep.quality.base import Rule, RuleParams, Verdict
from dataprep.quality.text import Doc

# datatrove's e-mail regex (an RFC 5322 local part, then a dotted domain or a bracketed
# IPv4 literal), matched ignoring case: datatrove's is lowercase-only, so it leaves
# "John.Doe@Example.com" as it is.
EMAIL_RE = re.compile(
    r"\b[a-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[a-z0-9!#$%&'*+/=?^_`{|}~-]+)*@"
    r"(?:(?:[a-z0-9](?:[a-z0-9-]*[a-z0-9])?\.)+[a-z0-9](?:[a-z0-9-]*[a-z0-9])?"
    r"|\[(?:(?:25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}"
    r"(?:25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?|[a-z0-9-]*[a-z0-9]:)])",
    re.IGNORECASE,
)
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)"
# datatrove's IPv4 regex, held to whole dotted tokens: no letter, digit or dot just
# before it, nor a letter/digit or ".digit" just after, so "v1.2.3.4" and the first four
# parts of "1.2.3.4.5" (version strings) stay as they are.
IPV4_RE = re.compile(rf"(?<![\w.]){_OCTET}(?:\.{_OCTET}){{3}}(?!\w|\.\d)")
# IPv6 candidates (datatrove has none): hex groups with two to seven colons, validated by
# `ipaddress` below; clock times ("12:30:45") are not valid addresses, and C++ names made
# of hex letters ("add::be") parse but lie in reserved ranges, which are left.
IPV6_RE = re.compile(r"(?<![\w:.])(?:[0-9a-f]{0,4}:){2,7}[0-9a-f]{0,4}(?![\w:])", re.IGNORECASE)


class PiiParams(RuleParams):
    emails: bool = Field(default=True, description="Replace e-mail addresses.")
    ips: bool = Field(
        default=True,
        description=(
            "Replace public IPv4/IPv6 addresses (private, loopback, link-local, documentation "
            "and reserved ones stay)."
        ),
    )
    # datatrove's first replacements: example.com is reserved for examples (RFC 2606),
    # and datatrove's IPs did not answer pings when its list was made. datatrove cycles
    # through several; one fixed string keeps the output independent of document order.
    email_replacement: str = Field(
        default="email@example.com", description=("What an e-mail address becomes.")
    )
    ip_replacement: str = Field(
        default="22.214.171.124", description=("What an IP address becomes.")
    )


class Pii(Rule[PiiParams]):
    """Replaces e-mail addresses, and IPv4/IPv6 addresses that are public
    (`ipaddress`'s `is_global`, as datatrove checks: private, loopback, link-local,
    documentation and reserved ranges stay). Counts what it replaced in `doc.redacted`
    under "email" and "ip"; text already equal to the placeholder is not counted, so
    running the rule twice counts nothing the second time."""

    name = "pii"
    Params = PiiParams

    def apply(self, doc: Doc) -> Verdict:
        p = self.params
        text = doc.text
        if p.emails and "@" in text:
            text = self._replace(EMAIL_RE, text, p.email_replacement, "email", doc)
        if p.ips:
            if "." in text:
                text = self._replace(IPV4_RE, text, p.ip_replacement, "ip", doc, public_ip)
            if "::" in text or text.count(":") >= 7:
                text = self._replace(IPV6_RE, text, p.ip_replacement, "ip", doc, public_ip)
        return None if text == doc.text else text

    @staticmethod
    def _replace(
        regex: re.Pattern[str],
        text: str,
        replacement: str,
        kind: str,
        doc: Doc,
        valid: Callable[[str], bool] | None = None,
    ) -> str:
        n = 0

        def sub(m: re.Match[str]) -> str:
            nonlocal n
            found = m.group(0)
            if found == replacement or (valid is not None and not valid(found)):
                return found
            n += 1
            return replacement

        out = regex.sub(sub, text)
        if n:
            doc.redacted[kind] = doc.redacted.get(kind, 0) + n
        return out


def public_ip(s: str) -> bool:
    """Whether `s` is a valid IP address that is globally routable (datatrove's
    public_ip_validator): leading zeros ("108.0.0.01") are invalid, as `ipaddress` reads
    them. An IPv6 address must also be outside the reserved and multicast ranges, which
    Python counts as global but which hold no hosts (and all of "add::be")."""
    try:
        ip = ipaddress.ip_address(s)
    except ValueError:
        return False
    if ip.version == 6 and (ip.is_reserved or ip.is_multicast):
        return False
    return ip.is_global
