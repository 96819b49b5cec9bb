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
"""
from __future__ import annotations

import glob
import gzip
import hashlib
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

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


class TrafficError(ValueError):
    """A traffic file or line that cannot be read; the message starts with `file:line:`."""


class TruncationWarning(UserWarning):
    """A prompt longer than the configured context was cut; callers count these."""


@dataclass(frozen=True)
class Request:
    id: str
    category: str
    messages: tuple[dict, ...]
    ts: str | None = None  # the time as logged
    line: int = 0
    instant: datetime | None = None  # the time parsed, in UTC


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
    """The file, or the files a glob matches, in sorted order."""
    if any(c in str(path) for c in _GLOB_CHARACTERS):
        files = sorted(Path(p) for p in glob.glob(str(path)) if Path(p).is_file())
        if not files:
            raise TrafficError(f"{path}: no traffic file matches")
        return files
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
    record = json.loads(text)
    if not isinstance(record, dict):
        raise ValueError("a line must be a JSON object")
    body = request_body(record)
    messages = tuple(_messages_of(body))
    id_key, request_id = envelope_field(record, body, ID_KEYS)
    if request_id is None:  # content hash: stable however the log grows
        request_id = "sha-" + hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
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
    return Request(str(request_id), category, messages, None if ts is None else str(ts), line, instant)


def _raw_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """Numbered raw lines; bytes, so that a bad byte is reported with its line. `.gz` files are decompressed."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            yield from enumerate(f, start=1)
    except (OSError, EOFError) as exc:  # a truncated or corrupt gzip file
        raise TrafficError(f"{path}: cannot be read: {exc}") from None


def load_traffic(path: str | Path = "default", *, skip_malformed: bool = False, since: Instant | None = None,
                 until: Instant | None = None) -> Traffic:
    """Read and validate a traffic log (a file or a glob). A bad line fails as `file:line: reason`, or is skipped and
    counted. With `since` / `until` (any time `pipeline.serving_logs.parse_instant` reads, or a datetime), only the
    requests logged at or after `since` and before `until` are kept, and a request without a time is malformed."""
    path = resolve_traffic_path(path)
    start, end = _window_bound("since", since), _window_bound("until", until)
    traffic = Traffic(path, [], files=traffic_files(path))
    first_seen: dict[str, tuple[tuple[dict, ...], str]] = {}  # id -> (messages, "file:line")
    for file in traffic.files:
        for line_no, raw in _raw_lines(file):
            if not raw.strip():
                continue
            try:
                request = parse_line(raw.decode("utf-8"), line_no)  # UnicodeDecodeError is a ValueError
                earlier = first_seen.get(request.id)
                if earlier is not None and earlier[0] != request.messages:
                    raise ValueError(f"duplicate id {request.id!r} with other messages than at {earlier[1]}")
                if request.instant is None and (start, end) != (None, None):
                    raise ValueError("no time, but the traffic is read between `since` and `until`")
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                reason = f"{file}:{line_no}: {exc}"
                if not skip_malformed:
                    raise TrafficError(reason + " (use traffic.skip_malformed=true to skip such lines)") from None
                traffic.malformed.append(reason)
                continue
            if earlier is not None:
                traffic.duplicates += 1
                continue
            first_seen[request.id] = (request.messages, f"{file}:{line_no}")
            if request.instant is not None and ((start is not None and request.instant < start)
                                                or (end is not None and request.instant >= end)):
                traffic.outside_window += 1
            else:
                traffic.requests.append(request)
    if not traffic.requests:
        outside = f" ({traffic.outside_window} outside since={since}, until={until})" if traffic.outside_window else ""
        raise TrafficError(f"{path}: no valid requests{outside}")
    return traffic


def _window_bound(name: str, value: Instant | None) -> datetime | None:
    try:
        return None if value is None else parse_instant(value)
    except ValueError as exc:
        raise TrafficError(f"traffic.{name}: {exc}") from None


def encode_prompt(request: Request, tokenizer, max_prompt_tokens: int) -> list[int]:
    """Chat template with the generation prompt; an over-long prompt keeps its last tokens (with a warning)."""
    text = tokenizer.apply_chat_template(list(request.messages), add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_prompt_tokens:
        warnings.warn(f"request {request.id}: prompt of {len(ids)} tokens truncated to its last {max_prompt_tokens}",
                      TruncationWarning, stacklevel=2)
        ids = ids[-max_prompt_tokens:]
    return ids


def encode_prompts(requests: list[Request], tokenizer, max_prompt_tokens: int) -> tuple[list[list[int]], int]:
    """Encode many prompts; returns the ids and how many were truncated (reported once, not per request)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TruncationWarning)
        encoded = [encode_prompt(r, tokenizer, max_prompt_tokens) for r in requests]
    truncated = sum(issubclass(w.category, TruncationWarning) for w in caught)
    if truncated:
        warnings.warn(f"{truncated} of {len(requests)} prompts were longer than {max_prompt_tokens} tokens "
                      "and were truncated", TruncationWarning, stacklevel=2)
    return encoded, truncated
