"""The schema's building blocks: the section base every config model derives from, and the error the loader raises."""
from __future__ import annotations

import urllib.parse
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

from pipeline.url_credentials import redact


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


def http_url(url: str) -> str:
    """`url` when it is an http(s) URL with a host: every URL draftops requests is checked when the config loads, so
    that `file://` (a local file read and quoted in an error) or another scheme never reaches a request."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{redact(url)!r} is not an http(s) URL (e.g. http://127.0.0.1:8080)")
    return url


HttpUrl = Annotated[str, AfterValidator(http_url)]

class Section(BaseModel):
    # no setting is infinite or NaN: `decode.temperature=inf` is an error, not a decoder that samples nothing
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

