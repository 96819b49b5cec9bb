"""Traffic logs: JSONL requests in three shapes, validated line by line, with a stable hash-based held-out split.

Accepted shapes (one object per line; optional id, `category` and time):
- OpenAI chat: `{"messages": [{"role": "system"|"user"|"assistant"|..., "content": "..."}, ...]}`, as a bare
  chat-completions body or inside a gateway's envelope (`pipeline.serving_logs` says which envelopes, content parts,
  roles and time formats are read);
- `{"prompt": "..."}`;
- `{"turns": ["user message", ...]}`, as Spec-Bench's own `question.jsonl` publishes it
  (`{"question_id": 81, "category": "writing", "turns": [...]}`, the id becoming the string "81"): logs of this
  shape hold no replies, so only the first turn is a complete request, and the later turns are not used.

The id is the first of `id`, `request_id`, `question_id`; a request without one gets a hash of its messages. A
request logged again under the same id with the same messages (a client's retry, or the same id-less request) is kept
once and counted in `Traffic.duplicates`; the same id with other messages is a malformed line. A path may be a glob
of rotated logs (`logs/requests-*.jsonl`, `.gz` files read as gzip), read in the sorted order of the file names; the
times, not the files, decide which requests are the most recent (`chronological`).

Reading is total: every non-blank line yields a request or a `file:line: reason` error (raised, or skipped and counted
with `skip_malformed`), whatever it holds: JSON nested past the parser's depth, lone UTF-16 surrogates (a tokenizer
cannot encode them), bytes that are not UTF-8, or a line longer than `max_line_bytes` (read in pieces, never held
whole). A prompt is cut to a bound of characters derived from the token budget (`prompt_char_bound`) before it is
tokenized, so that one huge request costs memory in proportion to the configuration, not to its size.
"""
from __future__ import annotations

import codecs
import dataclasses
import glob
import gzip
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from pipeline.prompts import TruncationWarning as TruncationWarning  # re-exported: callers import them from here
from pipeline.prompts import cut_messages, prompt_char_bound
from pipeline.prompts import encode_prompt as encode_prompt
from pipeline.prompts import encode_prompts as encode_prompts
from pipeline.serving_logs import (
    BODY_KEYS,
    ID_KEYS,
    REQUEST_KEYS,
    TIME_KEYS,
    chat_messages,
    envelope_field,
    parse_instant,
    request_body,
)

DEFAULT_TRAFFIC = Path(__file__).resolve().parent / "data" / "default_traffic.jsonl"
Split = Literal["train", "heldout", "all"]
Instant = str | int | float | datetime
_GLOB_CHARACTERS = "*?["
_EPOCH = datetime.fromtimestamp(0, timezone.utc)
DEFAULT_MAX_LINE_BYTES = 64 << 20  # `traffic.max_line_bytes`
_SKIP_CHUNK = 1 << 20
# What reading one line may raise on hostile content (a ValueError covers JSON, UTF-8 and the checks here; the JSON
# reader raises RecursionError past its depth): a bad line, never a crash.
_LINE_ERRORS = (ValueError, TypeError, OverflowError, RecursionError)


class TrafficError(ValueError):
    """A traffic file or line that cannot be read; the message starts with `file:line:`."""


@dataclass(frozen=True)
class Request:
    id: str
    category: str
    messages: tuple[dict, ...]
    ts: str | None = None  # the time as logged
    line: int = 0
    instant: datetime | None = None  # the time parsed, in UTC
    cut: int = 0  # characters dropped from the start of the conversation when read (`max_prompt_chars`)


@dataclass
class Traffic:
    path: Path  # the file, or the glob, as given
    requests: list[Request]
    malformed: list[str] = field(default_factory=list)  # "file:line: reason", only with skip_malformed
    files: list[Path] = field(default_factory=list)
    duplicates: int = 0  # lines repeating an earlier request (retries), not kept
    outside_window: int = 0  # requests before `since` or from `until` on, not kept

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
            h.update(json.dumps([r.id, r.messages], sort_keys=True).encode())
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
    """Oldest first by the parsed time; requests without one come first, and ties keep their log order."""
    return sorted(requests, key=lambda r: (r.instant is not None, r.instant or _EPOCH))


def resolve_traffic_path(path: str | Path) -> Path:
    return DEFAULT_TRAFFIC if str(path) == "default" else Path(path)


def traffic_files(path: Path) -> list[Path]:
    """The file, or the files a glob matches, in sorted order; a path that exists is the file it names, glob
    characters (`log[1].jsonl`) and all."""
    if not path.exists() and any(c in str(path) for c in _GLOB_CHARACTERS):
        files = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
        if not files:
            raise TrafficError(f"{path}: no traffic file matches")
        return files
    if path.is_dir():
        raise TrafficError(f"{path}: a directory, not a traffic file (name a file, or a glob such as {path}/*.jsonl)")
    if path.exists() and not path.is_file():
        kind = "a FIFO" if path.is_fifo() else "a socket" if path.is_socket() else "a device"
        raise TrafficError(f"{path}: {kind}, not a traffic file (traffic is read from a regular file)")
    if not path.is_file():
        raise TrafficError(f"{path}: traffic file not found")
    return [path]


def _messages_of(record: dict) -> list[dict]:
    shapes = [k for k in REQUEST_KEYS if k in record]
    if len(shapes) != 1:
        raise ValueError("needs exactly one of 'messages', 'prompt' or 'turns'"
                         + (f", found {shapes}" if shapes else f" (or a {' or '.join(BODY_KEYS)} holding one)"))
    if "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("'prompt' must be a non-empty string")
        return [{"role": "user", "content": prompt}]
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError("'turns' must be a non-empty list of strings")
        if not turns[0].strip():
            raise ValueError("the first turn is empty")
        return [{"role": "user", "content": turns[0]}]
    return chat_messages(record["messages"])


def parse_line(text: str, line: int = 0) -> Request:
    """One log line as a request; ValueError (with the reason) for anything else, whatever the line holds."""
    try:
        record = json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested deeper than the reader allows") from None
    if not isinstance(record, dict):
        raise ValueError("a line must be a JSON object")
    body = request_body(record)
    messages = tuple(_messages_of(body))
    id_key, request_id = envelope_field(record, body, ID_KEYS)
    if request_id is None:  # content hash: stable however the log grows
        request_id = "sha-" + _digest(messages)
    elif isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        raise ValueError(f"'{id_key}' must be a string or an integer")
    _, category = envelope_field(record, body, ("category",))
    category = category or "uncategorized"
    if not isinstance(category, str):
        raise ValueError("'category' must be a string")
    time_key, ts = envelope_field(record, body, TIME_KEYS)
    try:
        instant = None if ts is None else parse_instant(ts)
    except ValueError as exc:
        raise ValueError(f"'{time_key}': {exc}") from None
    request = Request(str(request_id), category, messages, None if ts is None else str(ts), line, instant)
    _check_encodable(request)
    return request


def _digest(messages: tuple[dict, ...]) -> str:
    return hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]


def _check_encodable(request: Request) -> None:
    """Every string kept is valid Unicode: JSON's `\\ud800` escapes decode to lone surrogates, which no tokenizer
    (and no UTF-8 file) takes."""
    pending: list[object] = [request.id, request.category, request.ts, *request.messages]
    while pending:
        value = pending.pop()
        if isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"a lone UTF-16 surrogate {value[exc.start]!r} (not text) at character "
                                 f"{exc.start} of {value[:40]!r}") from None


def _raw_lines(path: Path, max_line_bytes: int) -> Iterator[tuple[int, bytes | None]]:
    """Numbered raw lines, as bytes so that a bad byte is reported with its line; None for a line longer than
    `max_line_bytes`, whose rest is read in pieces and dropped. `.gz` files are decompressed."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            line_no = 0
            while True:
                raw = f.readline(max_line_bytes + 1)
                if not raw:
                    return
                line_no += 1
                if line_no == 1 and raw.startswith(codecs.BOM_UTF8):  # what some editors put before the first line
                    raw = raw[len(codecs.BOM_UTF8):]
                if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                    while (rest := f.readline(_SKIP_CHUNK)) and not rest.endswith(b"\n"):
                        pass
                    raw = None
                yield line_no, raw
    except (OSError, EOFError) as exc:  # a truncated or corrupt gzip file
        raise TrafficError(f"{path}: cannot be read: {exc}") from None


class _Reader:
    """One pass over a traffic log: requests kept, retries and lines outside the window counted, bad lines raised or
    recorded."""

    def __init__(self, traffic: Traffic, skip_malformed: bool, window: tuple[datetime | None, datetime | None],
                 max_prompt_chars: int | None):
        self.traffic, self.skip_malformed, self.window = traffic, skip_malformed, window
        self.max_prompt_chars = max_prompt_chars
        self.first_seen: dict[str, tuple[str, str]] = {}  # id -> (digest of its messages, "file:line")

    def read(self, file: Path, max_line_bytes: int) -> None:
        for line_no, raw in _raw_lines(file, max_line_bytes):
            if raw is not None and not raw.strip():
                continue
            try:
                if raw is None:
                    raise ValueError(f"a line longer than traffic.max_line_bytes={max_line_bytes}")
                request, digest = self._request(raw, line_no)
            except _LINE_ERRORS as exc:
                self._malformed(f"{file}:{line_no}: {exc}")
                continue
            earlier = self.first_seen.get(request.id)
            if earlier is not None and earlier[0] != digest:
                self._malformed(f"{file}:{line_no}: duplicate id {request.id!r} with other messages than at "
                                f"{earlier[1]}")
            elif request.instant is None and self.window != (None, None):
                self._malformed(f"{file}:{line_no}: no time, but the traffic is read between `since` and `until`")
            elif earlier is not None:
                self.traffic.duplicates += 1
            else:
                self.first_seen[request.id] = (digest, f"{file}:{line_no}")
                self._keep(request)

    def _request(self, raw: bytes, line_no: int) -> tuple[Request, str]:
        request = parse_line(raw.decode("utf-8"), line_no)  # UnicodeDecodeError is a ValueError
        digest = _digest(request.messages)
        if self.max_prompt_chars is not None:
            messages, cut = cut_messages(request.messages, self.max_prompt_chars)
            if cut:
                request = dataclasses.replace(request, messages=messages, cut=cut)
        return request, digest

    def _keep(self, request: Request) -> None:
        start, end = self.window
        if request.instant is not None and ((start is not None and request.instant < start)
                                            or (end is not None and request.instant >= end)):
            self.traffic.outside_window += 1
        else:
            self.traffic.requests.append(request)

    def _malformed(self, reason: str) -> None:
        if not self.skip_malformed:
            raise TrafficError(reason + " (use traffic.skip_malformed=true to skip such lines)")
        self.traffic.malformed.append(reason)


def load_traffic(path: str | Path = "default", *, skip_malformed: bool = False, since: Instant | None = None,
                 until: Instant | None = None, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
                 max_prompt_chars: int | None = None) -> Traffic:
    """Read and validate a traffic log (a file or a glob). A bad line fails as `file:line: reason`, or is skipped and
    counted. With `since` / `until` (any time `pipeline.serving_logs.parse_instant` reads, or a datetime), only the
    requests logged at or after `since` and before `until` are kept, and a request without a time is malformed.
    With `max_prompt_chars`, each request keeps only the last that many characters of its conversation (its id and
    retry detection still see all of it)."""
    path = resolve_traffic_path(path)
    window = (_window_bound("since", since), _window_bound("until", until))
    traffic = Traffic(path, [], files=traffic_files(path))
    reader = _Reader(traffic, skip_malformed, window, max_prompt_chars)
    for file in traffic.files:
        reader.read(file, max_line_bytes)
    if not traffic.requests:
        outside = f" ({traffic.outside_window} outside since={since}, until={until})" if traffic.outside_window else ""
        raise TrafficError(f"{path}: no valid requests{outside}")
    return traffic


def load_configured_traffic(traffic_cfg, path: str | Path | None = None) -> Traffic:
    """`load_traffic` with the `traffic:` section's settings (a `pipeline.config.TrafficConfig`), prompts kept to
    what `max_prompt_tokens` can use."""
    return load_traffic(traffic_cfg.path if path is None else path, skip_malformed=traffic_cfg.skip_malformed,
                        since=traffic_cfg.since, until=traffic_cfg.until, max_line_bytes=traffic_cfg.max_line_bytes,
                        max_prompt_chars=prompt_char_bound(traffic_cfg.max_prompt_tokens))


def _window_bound(name: str, value: Instant | None) -> datetime | None:
    try:
        return None if value is None else parse_instant(value)
    except ValueError as exc:
        raise TrafficError(f"traffic.{name}: {exc}") from None
