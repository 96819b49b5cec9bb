"""The assistant turns of a conversation, each a request of its own (`traffic.turns: all`).

A conversation is cut into segments: the messages a turn adds (user, system, tool) and the assistant's reply to
them as logged (None where the log has none: the open last turn of a request, Spec-Bench's later `turns`). Turn p's
request is every earlier segment with its reply, then segment p: with the target's own earlier replies in place of
the logged ones (generated turn by turn) or with the logged ones (recorded replies). An assistant reply that called
tools stays as logged in later turns, since the tool results that follow answer those calls. An assistant message
with nothing before it since the last reply (a greeting that opens the chat) is context, not a turn.
"""
from __future__ import annotations

import dataclasses

from pipeline.traffic_records import Request

TURN_SEPARATOR = "@"  # a turn's request id: "<request id>@<position>"


def segments(request: Request) -> list[tuple[tuple[dict, ...], dict | None]]:
    """(the messages turn p adds, its reply as logged or None) for every assistant turn, in order."""
    out: list[tuple[tuple[dict, ...], dict | None]] = []
    pending: list[dict] = []
    for message in request.messages:
        if message["role"] == "assistant" and any(m["role"] != "assistant" for m in pending):
            out.append((tuple(pending), message))
            pending = []
        else:
            pending.append(message)
    out.append((tuple(pending), request.reply))
    out += [((message,), None) for message in request.later]
    return out


def turn_request(request: Request, position: int, earlier_replies: list[dict]) -> Request:
    """Turn `position` (1-based) of `request`: its conversation so far with `earlier_replies` as the assistant's
    replies, its logged reply as `reply`, its id `<id>@<position>`."""
    parts = segments(request)
    messages: list[dict] = []
    for (added, _), reply in zip(parts[:position - 1], earlier_replies):
        messages += [*added, reply]
    added, logged = parts[position - 1]
    return dataclasses.replace(request, id=f"{request.id}{TURN_SEPARATOR}{position}",
                               messages=tuple(messages + list(added)), reply=logged, later=())


def context_reply(logged: dict | None, own: str) -> dict:
    """The reply a later turn sees: the target's own text, or the logged reply where it called tools."""
    if logged is not None and logged.get("tool_calls"):
        return logged
    return {"role": "assistant", "content": own}


def turn_position(response_id: str) -> int:
    """The turn position in a response id `<request id>@<position>#<sample>` (1 where it names none)."""
    head = response_id.rsplit("#", 1)[0]
    _, separator, position = head.rpartition(TURN_SEPARATOR)
    return int(position) if separator and position.isdigit() else 1


def request_of(response_id: str) -> str:
    """The request a response id belongs to: its unit of measurement."""
    head = response_id.rsplit("#", 1)[0]
    stem, separator, position = head.rpartition(TURN_SEPARATOR)
    return stem if separator and position.isdigit() else head
