"""Completion responses of the inference servers -> the response's token ids and the top-k log-probs per position.

Three formats, each read as its server documents it:

- vLLM `/v1/completions` with `logprobs: k` and `return_tokens_as_token_ids: true`: `choices[0].logprobs` holds
  `tokens` ("token_id:N") and `top_logprobs`, one {"token_id:N": logprob} per position holding the top k and the
  sampled token (k + 1 entries when it is not among them); newer vLLM also returns `choices[0].token_ids` with
  `return_token_ids: true`. vLLM writes a log-prob of -inf as -9999.0.
- llama.cpp's llama-server: its own `/completion` with `n_probs: k` and `return_tokens: true` (`tokens`, and
  `completion_probabilities`, one {id, logprob, top_logprobs: [{id, logprob}]} per token), or its OpenAI-style
  `/v1/completions`, whose `choices[0].logprobs.content` holds the same entries. llama-server writes a log-prob of
  -inf as the lowest float (-3.4e38), and leaves out the entry of a token that ends inside a UTF-8 character.
- SGLang's `/generate` with `return_logprob: true` and `top_logprobs_num: k`: `meta_info.output_token_logprobs`
  ([logprob, id, text] per token) and `meta_info.output_top_logprobs` (a list of those per position).

A parser raises `MalformedResponse` (a one-line reason; the client adds the server and the request) when the body is
not what was asked for. What the response means (its length, its end, its token ids) the client checks.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

TOKEN_ID_PREFIX = "token_id:"  # vLLM's spelling of a token under return_tokens_as_token_ids


class MalformedResponse(ValueError):
    """A server's response that does not hold what was asked for."""


@dataclass
class ParsedCompletion:
    """One response: its token ids, the top-k (log-prob, id) pairs of the distribution each was drawn from (best
    first, as many as the server returned; None where it returned none) and why it ended ("stop" or "length")."""

    tokens: list[int]
    top: list[list[tuple[float, int]] | None]
    finish: str

    def returned_k(self) -> int:
        """The fewest top-k entries returned at any position (0 if a position has none)."""
        return min((len(row) if row else 0 for row in self.top), default=0)

    def teacher_rows(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, k] fp16 log-probs and int32 ids, `distill.responses`' teacher format. Positions with fewer than k
        entries are padded with log-prob -inf and id -1, which the loss puts in its tail bucket
        (`distill.losses.bucket_log_probs`)."""
        values = torch.full((len(self.tokens), k), float("-inf"), dtype=torch.float32)
        ids = torch.full((len(self.tokens), k), -1, dtype=torch.int32)
        for position, row in enumerate(self.top):
            for j, (logprob, token) in enumerate((row or [])[:k]):
                values[position, j], ids[position, j] = logprob, token
        return values.half(), ids


def _logprob(value) -> float:
    """A returned log-prob as a float; the servers' stand-ins for -inf (-9999, the lowest float) stay as they are
    (exp of them is 0 in fp16), a missing one (JSON null) becomes -inf."""
    if value is None:
        return float("-inf")
    value = float(value)
    if math.isnan(value) or value > 1e-3:
        raise MalformedResponse(f"log-prob {value} is not a log-probability")
    return min(value, 0.0)


def _best_first(pairs: Iterable[tuple[float, int]], k: int) -> list[tuple[float, int]]:
    """The k most likely (log-prob, id) pairs, best first; one entry per id."""
    seen: dict[int, float] = {}
    for logprob, token in pairs:
        seen.setdefault(token, logprob)
    return sorted(((lp, t) for t, lp in seen.items()), key=lambda pair: (-pair[0], pair[1]))[:k]


def _finish(reason, stopped: Iterable[str] = ("stop", "eos", "word")) -> str:
    if reason in stopped:
        return "stop"
    if reason in ("length", "limit"):
        return "length"
    raise MalformedResponse(f"finish reason {reason!r} (neither a stop nor the length limit)")


def _first_choice(body: dict) -> dict:
    choices = body.get("choices") if isinstance(body, dict) else None
    if not choices:
        raise MalformedResponse("no choices in the response")
    return choices[0]


# --------------------------------------------------------------------------- vLLM


def vllm_token_id(token: str) -> int:
    """"token_id:123" -> 123 (what vLLM returns under return_tokens_as_token_ids)."""
    if not isinstance(token, str) or not token.startswith(TOKEN_ID_PREFIX):
        raise MalformedResponse(f"token {token!r} is not a token id: start vLLM's request with "
                                "return_tokens_as_token_ids (or the server with --return-tokens-as-token-ids)")
    try:
        return int(token[len(TOKEN_ID_PREFIX):])
    except ValueError:
        raise MalformedResponse(f"token {token!r} is not a token id") from None


def parse_vllm(body: dict, k: int) -> ParsedCompletion:
    """vLLM's (or another OpenAI-compatible server's) `/v1/completions` response, asked with `logprobs: k` and
    `return_tokens_as_token_ids: true`."""
    choice = _first_choice(body)
    logprobs = choice.get("logprobs")
    if not logprobs or logprobs.get("top_logprobs") is None:
        raise MalformedResponse("no top_logprobs in the response (was `logprobs` asked for?)")
    tokens = choice.get("token_ids")
    if tokens is None:
        tokens = [vllm_token_id(t) for t in logprobs.get("tokens", [])]
    top: list[list[tuple[float, int]] | None] = []
    for step in logprobs["top_logprobs"]:
        top.append(None if step is None else _best_first(((_logprob(v), vllm_token_id(t)) for t, v in step.items()),
                                                         k))
    if len(top) != len(tokens):
        raise MalformedResponse(f"{len(tokens)} tokens but {len(top)} top-logprob entries")
    return ParsedCompletion([int(t) for t in tokens], top, _finish(choice.get("finish_reason")))


# --------------------------------------------------------------------------- llama.cpp's llama-server


def _llamacpp_entry(entry: dict, k: int) -> tuple[int, list[tuple[float, int]]]:
    """One `completion_probabilities` / `logprobs.content` entry -> (token id, its top-k)."""
    if "id" not in entry:
        raise MalformedResponse("a log-prob entry without a token id")
    if "top_logprobs" in entry:
        top = [(_logprob(t.get("logprob")), int(t["id"])) for t in entry["top_logprobs"]]
    elif "top_probs" in entry:  # post_sampling_probs: probabilities, not their logs
        top = [(math.log(p) if (p := float(t.get("prob", 0.0))) > 0 else float("-inf"), int(t["id"]))
               for t in entry["top_probs"]]
    else:
        raise MalformedResponse("a log-prob entry without top_logprobs (was n_probs asked for?)")
    return int(entry["id"]), _best_first(top, k)


def parse_llamacpp(body: dict, k: int) -> ParsedCompletion:
    """llama-server's `/completion` response (asked with `n_probs: k`, `return_tokens: true`) or its `/v1/completions`
    one. Tokens llama-server returned no entry for (those ending inside a UTF-8 character) get no top-k (None)."""
    if "choices" in body:  # /v1/completions: the tokens are those of the log-prob entries
        choice = _first_choice(body)
        content = (choice.get("logprobs") or {}).get("content")
        if content is None:
            raise MalformedResponse("no logprobs.content in the response (was `logprobs` or n_probs asked for?)")
        entries = [_llamacpp_entry(e, k) for e in content]
        return ParsedCompletion([t for t, _ in entries], [top for _, top in entries],
                                _finish(choice.get("finish_reason")))
    if body.get("truncated"):
        raise MalformedResponse("the prompt and response outgrew the slot's context (llama-server's `truncated`): "
                                "start it with a larger -c per slot")
    if "tokens" not in body or "completion_probabilities" not in body:
        raise MalformedResponse("no tokens or completion_probabilities in the response (return_tokens and n_probs "
                                "must be asked for)")
    tokens = [int(t) for t in body["tokens"]]
    entries = [_llamacpp_entry(e, k) for e in body["completion_probabilities"]]
    top: list[list[tuple[float, int]] | None] = []
    pending = iter(entries)
    entry = next(pending, None)
    for token in tokens:  # entries come in token order, some tokens without one
        if entry is not None and entry[0] == token:
            top.append(entry[1])
            entry = next(pending, None)
        else:
            top.append(None)
    if entry is not None:
        raise MalformedResponse(f"log-prob entries that match no returned token (token {entry[0]})")
    return ParsedCompletion(tokens, top, _finish(body.get("stop_type")))


# --------------------------------------------------------------------------- SGLang


def parse_sglang(body: dict | list, k: int) -> ParsedCompletion:
    """SGLang's `/generate` response for one prompt, asked with `return_logprob: true`, `top_logprobs_num: k`."""
    if isinstance(body, list):
        if len(body) != 1:
            raise MalformedResponse(f"{len(body)} results for one prompt")
        body = body[0]
    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not meta or meta.get("output_top_logprobs") is None:
        raise MalformedResponse("no meta_info.output_top_logprobs in the response (was return_logprob with "
                                "top_logprobs_num asked for?)")
    chosen = meta.get("output_token_logprobs") or []
    tokens = body.get("output_ids")
    if tokens is None:
        tokens = [int(entry[1]) for entry in chosen]
    top = [None if step is None else _best_first(((_logprob(e[0]), int(e[1])) for e in step), k)
           for step in meta["output_top_logprobs"]]
    if len(top) != len(tokens):
        raise MalformedResponse(f"{len(tokens)} tokens but {len(top)} top-logprob entries")
    reason = meta.get("finish_reason")
    return ParsedCompletion([int(t) for t in tokens], top, _finish(reason.get("type") if isinstance(reason, dict)
                                                                   else reason))


PARSERS = {"vllm": parse_vllm, "llamacpp": parse_llamacpp, "sglang": parse_sglang}
