"""Requests as serving gateways log them: OpenAI chat-completions bodies, the envelopes around them, their times.

A gateway logs each request either as the body itself (`{"model": ..., "messages": [...], ...}`) or inside an
envelope that names it and stamps its time, e.g. `{"request_id": "r1", "timestamp": 1759280400, "body": {...}}`.
This module turns one such record into what draftops keeps of a request: its id, its time, its messages and the reply
as served. It knows one record's shape, apart from the files and data sets that hold records
(`pipeline.traffic_sources`, `pipeline.traffic_records`). The formats: docs/data.md#formats.
"""
from __future__ import annotations

import json
import math
from datetime import datetime, timezone

ID_KEYS = ("id", "request_id", "question_id")
TIME_KEYS = ("ts", "timestamp", "created")
BODY_KEYS = ("body", "request")
REQUEST_KEYS = ("messages", "prompt", "turns", "conversations")
RESPONSE_KEY = "response"
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# ShareGPT's speakers (`from`), as its datasets name them
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "model": "assistant", "tool": "tool", "function": "tool",
                  "observation": "tool", "function_response": "tool"}
ANSWERABLE_LAST_ROLES = ("user", "tool")
KEPT_TOOL_FIELDS = {"assistant": ("tool_calls", "reasoning_content"), "tool": ("tool_call_id", "name")}
EPOCH_MILLISECONDS_ABOVE = 1e11  # as seconds, year 5138; as milliseconds, March 1973


def request_body(record: dict) -> dict:
    """The request a record holds: the record itself, or the body inside its envelope."""
    if any(key in record for key in REQUEST_KEYS):
        return record
    for key in BODY_KEYS:
        if key in record:
            body = record[key]
            if isinstance(body, str):
                try:
                    body = json.loads(body)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"'{key}' is a string but not JSON: {exc}") from None
            if not isinstance(body, dict):
                raise ValueError(f"'{key}' must be a JSON object")
            return body
    return record


def envelope_field(record: dict, body: dict, keys: tuple[str, ...]) -> tuple[str, object] | tuple[None, None]:
    """(key, value) of the first of `keys` set in the envelope, else in the body; (None, None) when none is. The id is
    looked up in `ID_KEYS` (`question_id` is Spec-Bench's), the time in `TIME_KEYS`."""
    for source in (record, body):
        for key in keys:
            if source.get(key) is not None:
                return key, source[key]
    return None, None


def chat_messages(messages: object, key: str = "messages") -> list[dict]:
    """OpenAI chat messages as draftops keeps them: text content, `developer` as `system`, tool fields kept."""
    kept, reply = chat_conversation(messages, key)
    if reply is not None:
        raise ValueError("the last message must come from the user or a tool (it is the request to answer)")
    return kept


def chat_conversation(messages: object, key: str = "messages") -> tuple[list[dict], dict | None]:
    """A conversation as (the request's messages, the assistant's reply to them as logged, or None). Messages are
    OpenAI's (`role`, `content`) or ShareGPT's (`from`, `value`). The request is the next assistant turn, so the
    conversation ends with a user turn or a tool turn (the model answering a tool's result is a request too), or with
    the assistant's reply to one: the reply as served, kept apart."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"'{key}' must be a non-empty list")
    kept = [_message(i, m) for i, m in enumerate(messages)]
    reply = kept.pop() if kept[-1]["role"] == "assistant" else None
    if not kept or kept[-1]["role"] not in ANSWERABLE_LAST_ROLES:
        raise ValueError("the last message must come from the user or a tool (it is the request to answer), or be "
                         "the assistant's reply to one")
    return kept, reply


def logged_reply(record: dict) -> dict | None:
    """The reply a gateway logged with the request (`response.choices[0].message`), or None."""
    response = record.get(RESPONSE_KEY)
    if response is None:
        return None
    choices = response.get("choices") if isinstance(response, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError(f"'{RESPONSE_KEY}' needs 'choices' with a message")
    reply = _message(0, {"role": "assistant", **(choices[0].get("message") or {})})
    if reply["role"] != "assistant":
        raise ValueError(f"'{RESPONSE_KEY}': the message must be the assistant's")
    return reply


def _message(i: int, message: object) -> dict:
    """One message as kept. Tool messages keep their `tool_call_id` and `name`, an assistant's its `tool_calls` (its
    content may then be empty) and `reasoning_content`: chat templates that know them render them."""
    if isinstance(message, dict) and message.get("from") is not None and message.get("role") is None:  # ShareGPT
        if message["from"] not in SHAREGPT_ROLES:
            raise ValueError(f"message {i} needs a 'from' in {sorted(SHAREGPT_ROLES)}")
        message = {"role": SHAREGPT_ROLES[message["from"]], "content": message.get("value")}
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise ValueError(f"message {i} needs a role in {sorted(ROLES)}")
    role = ROLES[message["role"]]
    kept = {"role": role, "content": _text(i, message.get("content"))}
    kept.update({key: message[key] for key in KEPT_TOOL_FIELDS.get(role, ()) if message.get(key) is not None})
    if not kept["content"].strip() and "tool_calls" not in kept:
        raise ValueError(f"message {i} has no text content")
    return kept


def _text(i: int, content: object) -> str:
    """A content's text: a string, or its text parts joined with newlines; other parts (images, audio, files) are
    skipped, so a message with no text left is an error."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"message {i}: content must be a string or a list of parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise ValueError(f"message {i}: every content part needs a 'type'")
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError(f"message {i}: a text part needs a string 'text'")
            texts.append(part["text"])
    return "\n".join(texts)


def parse_instant(value: object) -> datetime:
    """An aware UTC datetime from an ISO-8601 string (no offset: UTC) or a number of epoch seconds / milliseconds
    (over `EPOCH_MILLISECONDS_ABOVE`), so requests are ordered by the instant, never by how the time was written."""
    if isinstance(value, datetime):
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"time {value!r} is not a finite number")
        seconds = value / 1000 if abs(value) > EPOCH_MILLISECONDS_ABOVE else value
        try:
            return datetime.fromtimestamp(seconds, timezone.utc)
        except (OverflowError, OSError, ValueError):
            raise ValueError(f"time {value!r} is out of range") from None
    if isinstance(value, str):
        try:
            instant = datetime.fromisoformat(value.strip())
        except ValueError:
            raise ValueError(f"time {value!r} is neither ISO-8601 nor epoch seconds or milliseconds") from None
        return instant.replace(tzinfo=timezone.utc) if instant.tzinfo is None else instant.astimezone(timezone.utc)
    raise ValueError(f"time {value!r} must be an ISO-8601 string or epoch seconds or milliseconds")
