"""Traffic: requests read from logs and data sets, validated record by record, with a stable hash-based held-out
split.

This is the one entry every stage reads traffic through (`load_traffic`, `Traffic`); the containers are read by
`pipeline.traffic_sources`, the record shapes by `pipeline.traffic_records` and `pipeline.serving_logs`
(docs/data.md#formats has an example of each). Reading is total: every non-blank line or row yields a request or a
`file:line: reason` (`file: row N: reason`) error, raised or skipped and counted (`skip_malformed`), whatever it
holds: JSON nested past the parser's depth, lone UTF-16 surrogates, bytes that are not UTF-8, or a line longer than
`max_line_bytes` (read in pieces, never held whole).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pipeline.prompts import TruncationWarning as TruncationWarning  # re-exported: callers import them from here
from pipeline.prompts import cut_messages, prompt_char_bound, prompt_style
from pipeline.prompts import encode_prompt as encode_prompt
from pipeline.prompts import encode_prompts as encode_prompts
from pipeline.serving_logs import parse_instant
from pipeline.traffic_records import Request as Request  # re-exported, as are the two below
from pipeline.traffic_records import digest, identity, parse_record
from pipeline.traffic_sources import TrafficError as TrafficError
from pipeline.traffic_sources import records, traffic_files

DEFAULT_TRAFFIC = Path(__file__).resolve().parent / "data" / "default_traffic.jsonl"
Split = Literal["train", "heldout", "all"]
Instant = str | int | float | datetime
_EPOCH = datetime.fromtimestamp(0, timezone.utc)
DEFAULT_MAX_LINE_BYTES = 64 << 20  # `traffic.max_line_bytes`
# What reading one line may raise on hostile content (a ValueError covers JSON, UTF-8 and the checks here; the JSON
# reader raises RecursionError past its depth): a bad line, never a crash.
_LINE_ERRORS = (ValueError, TypeError, OverflowError, RecursionError)


@dataclass
class Traffic:
    path: Path  # the file, or the glob, as given
    requests: list[Request]
    malformed: list[str] = field(default_factory=list)  # "file:line: reason", only with skip_malformed
    files: list[Path] = field(default_factory=list)
    # lines repeating an earlier request, not kept: the same id with the same messages (a client's retry, or the same
    # id-less request, whose id is a hash of its messages); the same id with other messages is a malformed line
    duplicates: int = 0
    outside_window: int = 0  # requests before `since` or from `until` on, not kept
    formats: dict[str, int] = field(default_factory=dict)  # requests kept per "shape (container)"

    def split(self, name: Split, heldout_fraction: float = 0.1) -> list[Request]:
        if name == "all":
            return list(self.requests)
        return [r for r in self.requests if split_of(r.id, heldout_fraction) == name]

    def categories(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.requests:
            counts[r.category] = counts.get(r.category, 0) + 1
        return dict(sorted(counts.items()))

    def fingerprint(self, name: Split = "all", heldout_fraction: float = 0.1) -> str:
        """Hash of the requests in a split: the data lineage of anything trained or measured on it."""
        h = hashlib.sha256()
        for r in self.split(name, heldout_fraction):
            h.update(json.dumps([r.id, *identity(r)], sort_keys=True).encode())
        return h.hexdigest()[:16]

    def to_dataset(self, name: Split = "all", heldout_fraction: float = 0.1):
        """The split as a `datasets.Dataset` with columns id, category, ts, messages."""
        from datasets import Dataset

        rows = [{"id": r.id, "category": r.category, "ts": r.ts, "messages": list(r.messages)}
                for r in self.split(name, heldout_fraction)]
        return Dataset.from_list(rows)


def split_of(request_id: str, heldout_fraction: float = 0.1) -> Literal["train", "heldout"]:
    """Held out iff the id's hash falls under the fraction: a request never changes side as the log grows."""
    bucket = int(hashlib.sha256(request_id.encode()).hexdigest()[:8], 16) / 0x1_0000_0000
    return "heldout" if bucket < heldout_fraction else "train"


def first_per_category(requests: list[Request], k: int) -> list[Request]:
    """The first k requests of every category, in log order: a small sample that still covers each category."""
    taken: dict[str, int] = {}
    kept = []
    for request in requests:
        if taken.get(request.category, 0) < k:
            taken[request.category] = taken.get(request.category, 0) + 1
            kept.append(request)
    return kept


def chronological(requests: list[Request]) -> list[Request]:
    """Oldest first by the parsed time; requests without one come first, and ties keep their log order. The times,
    not the files (a glob of rotated logs is read in the sorted order of its file names), decide what is recent."""
    return sorted(requests, key=lambda r: (r.instant is not None, r.instant or _EPOCH))


def resolve_traffic_path(path: str | Path) -> Path:
    return DEFAULT_TRAFFIC if str(path) == "default" else Path(path)


def parse_line(text: str, line: int = 0, columns: dict[str, str] | None = None) -> Request:
    """One log line as a request; ValueError (with the reason) for anything else, whatever the line holds."""
    return _parsed(text, line, columns)[0]


def _parsed(text: str, line: int, columns: dict[str, str] | None) -> tuple[Request, str]:
    try:
        record = json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested deeper than the reader allows") from None
    return parse_record(record, line, columns)


class _Reader:
    """One pass over a traffic source: requests kept, retries and records outside the window counted, bad records
    raised or recorded."""

    def __init__(self, traffic: Traffic, skip_malformed: bool, window: tuple[datetime | None, datetime | None],
                 max_prompt_chars: int | None, columns: dict[str, str] | None):
        self.traffic, self.skip_malformed, self.window = traffic, skip_malformed, window
        self.max_prompt_chars, self.columns = max_prompt_chars, columns
        self.first_seen: dict[str, tuple[str, str]] = {}  # id -> (digest of its content, "file:line")

    def read(self, file: Path, max_line_bytes: int) -> None:
        for record in records(file, max_line_bytes):
            if record.row is None and record.raw is not None and not record.raw.strip():
                continue
            where = record.where
            try:
                if record.row is None and record.raw is None:
                    raise ValueError(f"a line longer than traffic.max_line_bytes={max_line_bytes}")
                request, shape, content = self._request(record)
            except _LINE_ERRORS as exc:
                self._malformed(f"{where}: {exc}")
                continue
            earlier = self.first_seen.get(request.id)
            if earlier is not None and earlier[0] != content:
                self._malformed(f"{where}: duplicate id {request.id!r} with other messages than at {earlier[1]}")
            elif request.instant is None and self.window != (None, None):
                self._malformed(f"{where}: no time, but the traffic is read between `since` and `until`")
            elif earlier is not None:
                self.traffic.duplicates += 1
            else:
                self.first_seen[request.id] = (content, where)
                self._keep(request, f"{shape} ({record.container})")

    def _request(self, record) -> tuple[Request, str, str]:
        if record.row is None:  # UnicodeDecodeError is a ValueError
            request, shape = _parsed(record.raw.decode("utf-8"), record.number, self.columns)
        else:
            request, shape = parse_record(record.row, record.number, self.columns)
        content = digest(request)
        if self.max_prompt_chars is not None:
            messages, cut = cut_messages(request.messages, self.max_prompt_chars)
            if cut:
                request = dataclasses.replace(request, messages=messages, cut=cut)
        return request, shape, content

    def _keep(self, request: Request, form: str) -> None:
        start, end = self.window
        if request.instant is not None and ((start is not None and request.instant < start)
                                            or (end is not None and request.instant >= end)):
            self.traffic.outside_window += 1
        else:
            self.traffic.requests.append(request)
            self.traffic.formats[form] = self.traffic.formats.get(form, 0) + 1

    def _malformed(self, reason: str) -> None:
        if not self.skip_malformed:
            raise TrafficError(reason + " (use traffic.skip_malformed=true to skip such lines)")
        self.traffic.malformed.append(reason)


def load_traffic(path: str | Path = "default", *, skip_malformed: bool = False, since: Instant | None = None,
                 until: Instant | None = None, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                 max_prompt_chars: int | None = None, columns: dict[str, str] | None = None) -> Traffic:
    """Read and validate traffic (a file, a saved data set folder, or a glob). A bad record fails as
    `file:line: reason` (`file: row N: reason`), or is skipped and counted. With `since` / `until` (any time
    `pipeline.serving_logs.parse_instant` reads, or a datetime), only the requests logged at or after `since` and
    before `until` are kept, and a request without a time is malformed. With `max_prompt_chars`, each request keeps
    only the last that many characters of its conversation (its id and retry detection still see all of it), so that
    one huge request costs memory in proportion to the configuration, not to its size (`prompt_char_bound`).
    `columns`: draftops' names (messages, id, category, time) -> a data set's own column names."""
    path = resolve_traffic_path(path)
    window = (_window_bound("since", since), _window_bound("until", until))
    traffic = Traffic(path, [], files=traffic_files(path))
    reader = _Reader(traffic, skip_malformed, window, max_prompt_chars, columns)
    for file in traffic.files:
        reader.read(file, max_line_bytes)
    if not traffic.requests:
        outside = f" ({traffic.outside_window} outside since={since}, until={until})" if traffic.outside_window else ""
        raise TrafficError(f"{path}: no valid requests{outside}")
    return traffic


def reading_options(traffic_cfg) -> dict:
    """`load_traffic`'s settings from the `traffic:` section (a `pipeline.config.TrafficConfig`)."""
    return dict(skip_malformed=traffic_cfg.skip_malformed, since=traffic_cfg.since, until=traffic_cfg.until,
                max_line_bytes=traffic_cfg.max_line_bytes, columns=traffic_cfg.columns or None)


def load_configured_traffic(traffic_cfg, path: str | Path | None = None) -> Traffic:
    """`load_traffic` with the `traffic:` section's settings, prompts kept to what `max_prompt_tokens` can use."""
    return load_traffic(traffic_cfg.path if path is None else path, **reading_options(traffic_cfg),
                        max_prompt_chars=prompt_char_bound(traffic_cfg.max_prompt_tokens))


def heldout_by_recency(traffic_cfg) -> list[Request]:
    """All held-out requests of the configured traffic, oldest first (by the instant they were logged, then log
    order): the last N are the most recent."""
    return chronological(load_configured_traffic(traffic_cfg).split("heldout", traffic_cfg.heldout_fraction))


def encode_configured(requests: list[Request], tokenizer, traffic_cfg) -> tuple[list[list[int]], int]:
    """`encode_prompts` as the `traffic:` section says: its token budget, reasoning and chat template."""
    return encode_prompts(requests, tokenizer, traffic_cfg.max_prompt_tokens, prompt_style(traffic_cfg))


def _window_bound(name: str, value: Instant | None) -> datetime | None:
    try:
        return None if value is None else parse_instant(value)
    except ValueError as exc:
        raise TrafficError(f"traffic.{name}: {exc}") from None
