"""Credentials written into a URL (`http://user:password@host`) never leave it: every message, log line, config dump
and MLflow parameter shows the URL with its password (or its lone token) replaced by `***`.

`redact` works on any text, so an error line that quotes a URL inside a longer sentence is covered as well."""
from __future__ import annotations

import re
from typing import Any

# scheme://userinfo@ : a userinfo is everything up to the last '@' before the host's first '/', '?' or '#'
_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^\s/?#@]*(?:@[^\s/?#@]*)*)@")
HIDDEN = "***"


def _hidden(match: re.Match) -> str:
    user, colon, _ = match["userinfo"].partition(":")
    return f"{match['scheme']}{user}:{HIDDEN}@" if colon else f"{match['scheme']}{HIDDEN}@"


def redact(text: str) -> str:
    """`text` with the credentials of every URL in it hidden: `user:***@`, or `***@` for a user or token alone."""
    return _USERINFO.sub(_hidden, text) if "@" in text else text


def redact_tree(value: Any) -> Any:
    """A JSON-like value (dicts, lists, strings) with every string passed through `redact`."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {key: redact_tree(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_tree(item) for item in value]
    return value
