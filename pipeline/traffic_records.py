"""One logged record as a request: its shape read, its id, category, time, tools and recorded reply.

Shapes (one per record, named in `Traffic.formats`):
- `messages`: OpenAI chat messages (or ShareGPT's `from`/`value` messages under that name), as a bare
  chat-completions body or inside a gateway's envelope (`pipeline.serving_logs`);
- `prompt`: `{"prompt": "..."}`;
- `turns`: `{"turns": ["user message", ...]}`, Spec-Bench's `question.jsonl` (`{"question_id": 81, ...}`, the id
  becoming "81"): no replies are logged, so the first turn is the request and the later ones are `Request.later`
  (used with `traffic.turns: all`, each answered by the target's own earlier replies);
- `sharegpt`: `{"conversations": [{"from": "human"|"gpt"|"system"|"tool", "value": "..."}], "tools": ...}`.

A conversation ending with the assistant's message keeps it as `Request.reply` (what the served model answered);
a gateway record's `response` is such a reply too. A request's `tools` (the body's `tools`; in ShareGPT a list or
a JSON string of them) reach the chat template.

`columns` maps draftops' names (`messages`, `id`, `category`, `time`) to a data set's own (`traffic.columns`): the
record's column of that name is read as draftops' field.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime

from pipeline.serving_logs import (
    BODY_KEYS,
    ID_KEYS,
    REQUEST_KEYS,
    TIME_KEYS,
    chat_conversation,
    envelope_field,
    logged_reply,
    parse_instant,
    request_body,
)

SHAPES = {"messages": "messages", "prompt": "prompt", "turns": "turns", "conversations": "sharegpt"}
COLUMN_NAMES = ("messages", "id", "category", "time")


@dataclass(frozen=True)
class Request:
    id: str
    category: str
    messages: tuple[dict, ...]
    ts: str | None = None  # the time as logged
    line: int = 0
    instant: datetime | None = None  # the time parsed, in UTC
    cut: int = 0  # characters dropped from the start of the conversation when read (`max_prompt_chars`)
    tools: tuple[dict, ...] | None = None  # the tool schemas the request was served with
    reply: dict | None = None  # the assistant's reply as logged
    later: tuple[dict, ...] = ()  # user turns logged after `messages` without replies (the `turns` shape)


def identity(request: Request) -> list:
    """What identifies a request's content (its messages, and its tools and reply where logged): retries and
    fingerprints compare this. A `turns` record's later turns are not part of it."""
    extra = {key: value for key, value in (("tools", request.tools), ("reply", request.reply)) if value is not None}
    return [request.messages, extra] if extra else [request.messages]


def digest(request: Request) -> str:
    content = identity(request)
    return hashlib.sha256(json.dumps(content[0] if len(content) == 1 else content, sort_keys=True)
                          .encode()).hexdigest()[:16]


def renamed(record: dict, columns: dict[str, str] | None) -> dict:
    """The record with a data set's own column names read as draftops' (`traffic.columns`)."""
    if not columns:
        return record
    out = dict(record)
    for name, column in columns.items():
        if column in record:
            value = out.pop(column)
            out[TIME_KEYS[0] if name == "time" else name] = value
    return out


def parse_record(record: object, line: int = 0, columns: dict[str, str] | None = None) -> tuple[Request, str]:
    """One logged record as (request, shape); ValueError (with the reason) for anything else."""
    if not isinstance(record, dict):
        raise ValueError("a line must be a JSON object")
    record = renamed(record, columns)
    body = request_body(record)
    messages, reply, later, shape = _conversation_of(body)
    reply = logged_reply(record) or logged_reply(body) or reply
    tools = _tools(body.get("tools"))
    id_key, request_id = envelope_field(record, body, ID_KEYS)
    request = Request("", "", tuple(messages), tools=tools, reply=reply, later=tuple(later))
    if request_id is None:  # content hash: stable however the log grows
        request_id = "sha-" + digest(request)
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
    request = Request(str(request_id), category, tuple(messages), None if ts is None else str(ts), line, instant,
                      tools=tools, reply=reply, later=tuple(later))
    _check_encodable(request)
    return request, SHAPES[next(k for k in REQUEST_KEYS if k in body)]


def _conversation_of(record: dict) -> tuple[list[dict], dict | None, list[dict], str]:
    shapes = [k for k in REQUEST_KEYS if k in record]
    if len(shapes) != 1:
        raise ValueError("needs exactly one of 'messages', 'prompt', 'turns' or 'conversations'"
                         + (f", found {shapes}" if shapes else f" (or a {' or '.join(BODY_KEYS)} holding one)"))
    if "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("'prompt' must be a non-empty string")
        return [{"role": "user", "content": prompt}], None, [], "prompt"
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ValueError("'turns' must be a non-empty list of strings")
        if not turns[0].strip():
            raise ValueError("the first turn is empty")
        later = [{"role": "user", "content": t} for t in turns[1:] if t.strip()]
        return [{"role": "user", "content": turns[0]}], None, later, "turns"
    key = shapes[0]
    messages, reply = chat_conversation(record[key], key)
    return messages, reply, [], key


def _tools(tools: object) -> tuple[dict, ...] | None:
    if tools is None or tools == []:
        return None
    if isinstance(tools, str):  # ShareGPT data sets keep them as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise ValueError(f"'tools' is a string but not JSON: {exc}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("'tools' must be a list of tool schemas (objects)")
    return tuple(tools) or None


def _check_encodable(request: Request) -> None:
    """Every string kept is valid Unicode: JSON's `\\ud800` escapes decode to lone surrogates, which no tokenizer
    (and no UTF-8 file) takes."""
    pending: list[object] = [request.id, request.category, request.ts, *request.messages, *request.later,
                             request.reply, *(request.tools or ())]
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
