"""Responses to every assistant turn of the traffic (`traffic.turns: all`), turn by turn: turn p's prompts hold the
target's own replies to turns 1..p-1 (its greedy ones), as speculators regenerates conversations, or the logged
replies where recorded replies are trained on (`distill.responses.source: recorded`). With `traffic.turns: last`,
one call on the requests as read.

Each turn position is one call of `respond` and so one cache entry: a later position's prompts are known only once
the earlier position's replies are, and are the same again on a re-run (greedy), so every entry is found again.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from distill.data.responses import ResponseSet, concat
from pipeline.traffic import Request
from pipeline.turns import context_reply, segments, turn_request

# respond(requests, prompts) -> (responses in the order of `requests`, sample after sample; cache dir; all cached)
Respond = Callable[[list[Request], list[list[int]]], tuple[ResponseSet, Path, bool]]


@dataclass
class TurnResponses:
    responses: ResponseSet
    paths: list[Path]  # one cache entry per turn position
    hit: bool  # every position came from the cache
    turns: int  # assistant turns answered (request, position), whatever the samples per turn
    positions: list[int]  # the turn position of every response


def turn_responses(requests: list[Request], turns: str, encode: Callable[[list[Request]], list[list[int]]],
                   respond: Respond, reply_text: Callable[[list[int]], str], *,
                   recorded: bool = False) -> TurnResponses:
    """The responses to the last turn of every request (`turns` "last"), or to each of their turns in order ("all").
    `reply_text` turns a response's ids into the text a later turn's prompt holds; `recorded`: the later turns hold
    the logged replies, and turns without one are left out."""
    if turns == "last":
        if recorded:  # a request without a logged reply has nothing to train on
            requests = [r for r in requests if r.reply is not None]
            if not requests:
                raise ValueError("no request logs its reply: recorded replies need a log with them")
        responses, path, hit = respond(requests, encode(requests))
        return TurnResponses(responses, [path], hit, len(requests), [1] * len(responses))
    parts = {r.id: segments(r) for r in requests}
    replies: dict[str, list[dict]] = {r.id: [] for r in requests}
    out, paths, hits, positions, answered = [], [], [], [], 0
    for position in range(1, max(len(p) for p in parts.values()) + 1):
        live = [r for r in requests if len(parts[r.id]) >= position]
        if recorded:  # a turn is trained on where its reply and every earlier one are logged
            live = [r for r in live if all(reply is not None for _, reply in parts[r.id][:position])]
            earlier = {r.id: [reply for _, reply in parts[r.id][:position - 1]] for r in live}
        else:
            earlier = replies
        asked = [turn_request(r, position, earlier[r.id]) for r in live]
        if not asked:
            continue
        responses, path, hit = respond(asked, encode(asked))
        if not recorded:
            for i, request in enumerate(live):  # rows 0..n-1: the first (greedy) sample of every turn
                replies[request.id].append(context_reply(parts[request.id][position - 1][1],
                                                         reply_text(responses.response_ids[i])))
        out.append(responses)
        paths.append(path)
        hits.append(hit)
        positions += [position] * len(responses)
        answered += len(asked)
    if not out:
        raise ValueError("no assistant turn to train on: the traffic logs no replies to its turns")
    return TurnResponses(concat(out), paths, all(hits), answered, positions)
