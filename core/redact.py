"""Credential redaction: no secret from the environment, and no user:password@ of a URL,
may reach a log line or an error message."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

_USERINFO = re.compile(r"(://)[^/@\s]+@")
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")


def hide_userinfo(text: str) -> str:
    """Endpoint URLs may carry user:password@; never echo that part."""
    return _USERINFO.sub(r"\1***@", text)


def redact(text: str, env_names: Iterable[str] = (), values: Iterable[str] = ()) -> str:
    """`text` with the values of the named environment variables (and the usual AWS
    ones), any extra `values`, and URL user info replaced by ***."""
    secrets = {v for v in values if v}
    for name in (*env_names, *CREDENTIAL_ENV):
        value = os.environ.get(name)
        if value:
            secrets.add(value)
    # Longest first, so a secret containing another is removed whole. Very short values
    # are skipped: they cannot be real keys and would shred the message.
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= 4:
            text = text.replace(secret, "***")
    return hide_userinfo(text)
