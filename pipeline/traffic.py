"""Traffic logs: JSONL requests in three shapes, validated line by line, with a stable hash-based held-out split.

Accepted shapes (one object per line; optional `id`, `category`, `ts`):
- OpenAI chat: `{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`, ending with a user turn;
- `{"prompt": "..."}`;
- `{"turns": ["user message", ...]}` (Spec-Bench style): logs of this shape hold no replies, so only the first
  turn is a complete request, and the later turns are not used.
"""
from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

DEFAULT_TRAFFIC = Path(__file__).resolve().parent / "data" / "default_traffic.jsonl"
Split = Literal["train", "heldout", "all"]
_ROLES = {"system", "user", "assistant"}


class TrafficError(ValueError):
    """A traffic file or line that cannot be read; the message starts with `file:line:`."""


class TruncationWarning(UserWarning):
    """A prompt longer than the configured context was cut; callers count these."""


@dataclass(frozen=True)
class Request:
    id: str
    category: str
    messages: tuple[dict, ...]
    ts: str | None = None
    line: int = 0


@dataclass
class Traffic:
    path: Path
    requests: list[Request]
    malformed: list[str] = field(default_factory=list)  # "file:line: reason", only with skip_malformed

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


def resolve_traffic_path(path: str | Path) -> Path:
    return DEFAULT_TRAFFIC if str(path) == "default" else Path(path)


def _messages_of(record: dict) -> list[dict]:
    shapes = [k for k in ("messages", "prompt", "turns") if k in record]
    if len(shapes) != 1:
        raise ValueError("needs exactly one of 'messages', 'prompt' or 'turns'"
                         + (f", found {shapes}" if shapes else ""))
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
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} needs a role in {sorted(_ROLES)} and a string content")
        if not m["content"].strip():
            raise ValueError(f"message {i} has empty content")
    if messages[-1]["role"] != "user":
        raise ValueError("the last message must come from the user (it is the request to answer)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def parse_line(text: str) -> tuple[str | None, str, tuple[dict, ...], str | None]:
    record = json.loads(text)
    if not isinstance(record, dict):
        raise ValueError("a line must be a JSON object")
    messages = tuple(_messages_of(record))
    request_id = record.get("id")
    if request_id is not None and not isinstance(request_id, (str, int)):
        raise ValueError("'id' must be a string or an integer")
    category = record.get("category") or "uncategorized"
    if not isinstance(category, str):
        raise ValueError("'category' must be a string")
    ts = record.get("ts")
    return (None if request_id is None else str(request_id)), category, messages, (None if ts is None else str(ts))


def load_traffic(path: str | Path = "default", *, skip_malformed: bool = False) -> Traffic:
    """Read and validate a traffic log. A bad line fails as `file:line: reason`, or is skipped and counted."""
    path = resolve_traffic_path(path)
    if not path.is_file():
        raise TrafficError(f"{path}: traffic file not found")
    requests: list[Request] = []
    malformed: list[str] = []
    seen: set[str] = set()
    with path.open("rb") as f:  # decoded line by line, so that a bad byte is reported with its line
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                request_id, category, messages, ts = parse_line(raw.decode("utf-8"))
                if request_id is None:  # content hash: stable however the log grows
                    request_id = "sha-" + hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
                if request_id in seen:
                    raise ValueError(f"duplicate id {request_id!r}")
            except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                reason = f"{path}:{line_no}: {exc}"
                if not skip_malformed:
                    raise TrafficError(reason + " (use traffic.skip_malformed=true to skip such lines)") from None
                malformed.append(reason)
                continue
            seen.add(request_id)
            requests.append(Request(request_id, category, messages, ts, line_no))
    if not requests:
        raise TrafficError(f"{path}: no valid requests")
    return Traffic(path, requests, malformed)


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
