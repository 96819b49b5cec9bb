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

`parse` raises `MalformedResponse` (a one-line reason; the client adds the server and the request) when the body is
not what was asked for, whatever its shape: every log-prob must be a JSON number (or null), every id an integer, every
entry of the type its format documents. What the response means (its length, its end, its token ids, how many top-k
entries each token holds) the client checks.
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
        """[n, k] fp16 log-probs and int32 ids, `distill.data.responses`' teacher format. Positions with fewer than k
        entries are padded with log-prob -inf and id -1, which the loss puts in its tail bucket
        (`distill.losses.bucket_log_probs`)."""
        values = torch.full((len(self.tokens), k), float("-inf"), dtype=torch.float32)
        ids = torch.full((len(self.tokens), k), -1, dtype=torch.int32)
        for position, row in enumerate(self.top):
            for j, (logprob, token) in enumerate((row or [])[:k]):
                values[position, j], ids[position, j] = logprob, token
        return values.half(), ids


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _token(value) -> int:
    """A returned token id, which must be a JSON integer."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise MalformedResponse(f"token id {value!r} is a {type(value).__name__}, not an integer")
    return value


def _logprob(value) -> float:
    """A returned log-prob as a float; the servers' stand-ins for -inf (-9999, the lowest float) stay as they are
    (exp of them is 0 in fp16), a missing one (JSON null) becomes -inf."""
    if value is None:
        return float("-inf")
    if not _number(value):
        raise MalformedResponse(f"log-prob {value!r} is a {type(value).__name__}, not a number")
    value = float(value)
    if math.isnan(value) or value > 1e-3:
        raise MalformedResponse(f"log-prob {value} is not a log-probability")
    return min(value, 0.0)


def _best_first(pairs: Iterable[tuple[float, int]], k: int) -> list[tuple[float, int]] | None:
    """The k most likely (log-prob, id) pairs, best first; one entry per id; None for no pairs."""
    seen: dict[int, float] = {}
    for logprob, token in pairs:
        seen.setdefault(token, logprob)
    return sorted(((lp, t) for t, lp in seen.items()), key=lambda pair: (-pair[0], pair[1]))[:k] or None


def _entries(value, what: str, kind: type = list) -> list | dict:
    """`value`, which the format says is a `kind` (a list, or a dict)."""
    if not isinstance(value, kind):
        raise MalformedResponse(f"{what} is a {type(value).__name__}, not a {kind.__name__}: {str(value)[:80]!r}")
    return value


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
    if not logprobs or not isinstance(logprobs, dict) or logprobs.get("top_logprobs") is None:
        raise MalformedResponse("no top_logprobs in the response (was `logprobs` asked for?)")
    tokens = choice.get("token_ids")
    if tokens is None:
        tokens = [vllm_token_id(t) for t in _entries(logprobs.get("tokens", []), "logprobs.tokens")]
    top: list[list[tuple[float, int]] | None] = []
    for step in _entries(logprobs["top_logprobs"], "top_logprobs"):
        pairs = _entries(step, "a top_logprobs entry", dict) if step is not None else {}
        top.append(_best_first(((_logprob(v), vllm_token_id(t)) for t, v in pairs.items()), k))
    tokens = [_token(t) for t in _entries(tokens, "token_ids")]
    if len(top) != len(tokens):
        raise MalformedResponse(f"{len(tokens)} tokens but {len(top)} top-logprob entries")
    return ParsedCompletion(tokens, top, _finish(choice.get("finish_reason")))


# --------------------------------------------------------------------------- llama.cpp's llama-server


def _llamacpp_entry(entry: dict, k: int) -> tuple[int, list[tuple[float, int]] | None]:
    """One `completion_probabilities` / `logprobs.content` entry -> (token id, its top-k)."""
    if "id" not in _entries(entry, "a log-prob entry", dict):
        raise MalformedResponse("a log-prob entry without a token id")
    # top_probs: post_sampling_probs, probabilities rather than their logs
    key = next((key for key in ("top_logprobs", "top_probs") if key in entry), None)
    if key is None:
        raise MalformedResponse("a log-prob entry without top_logprobs (was n_probs asked for?)")
    pairs = []
    for item in _entries(entry[key], key):
        item = _entries(item, f"a {key} entry", dict)
        value = _logprob(item.get("logprob")) if key == "top_logprobs" else _probability_log(item.get("prob", 0.0))
        pairs.append((value, _token(item.get("id"))))
    return _token(entry["id"]), _best_first(pairs, k)


def _probability_log(p) -> float:
    if not _number(p) or not 0.0 <= p <= 1.0 + 1e-6:
        raise MalformedResponse(f"probability {p!r} is not a probability")
    return math.log(p) if p > 0 else float("-inf")


def parse_llamacpp(body: dict, k: int) -> ParsedCompletion:
    """llama-server's `/completion` response (asked with `n_probs: k`, `return_tokens: true`) or its `/v1/completions`
    one. Tokens llama-server returned no entry for (those ending inside a UTF-8 character) get no top-k (None)."""
    if "choices" in body:  # /v1/completions: the tokens are those of the log-prob entries
        choice = _first_choice(body)
        content = (choice.get("logprobs") or {}).get("content")
        if content is None:
            raise MalformedResponse("no logprobs.content in the response (was `logprobs` or n_probs asked for?)")
        entries = [_llamacpp_entry(e, k) for e in _entries(content, "logprobs.content")]
        return ParsedCompletion([t for t, _ in entries], [top for _, top in entries],
                                _finish(choice.get("finish_reason")))
    if body.get("truncated"):
        raise MalformedResponse("the prompt and response outgrew the slot's context (llama-server's `truncated`): "
                                "start it with a larger -c per slot")
    if "tokens" not in body or "completion_probabilities" not in body:
        raise MalformedResponse("no tokens or completion_probabilities in the response (return_tokens and n_probs "
                                "must be asked for)")
    tokens = [_token(t) for t in _entries(body["tokens"], "tokens")]
    entries = [_llamacpp_entry(e, k) for e in _entries(body["completion_probabilities"], "completion_probabilities")]
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
    chosen = _entries(meta.get("output_token_logprobs") or [], "output_token_logprobs")
    tokens = body.get("output_ids")
    if tokens is None:
        tokens = [_token(_entries(entry, "an output_token_logprobs entry")[1]) for entry in chosen]
    top = [None if step is None else _best_first(((_logprob(_entries(e, "a top-logprob entry")[0]), _token(e[1]))
                                                  for e in _entries(step, "an output_top_logprobs entry")), k)
           for step in _entries(meta["output_top_logprobs"], "output_top_logprobs")]
    tokens = [_token(t) for t in _entries(tokens, "output_ids")]
    if len(top) != len(tokens):
        raise MalformedResponse(f"{len(tokens)} tokens but {len(top)} top-logprob entries")
    reason = meta.get("finish_reason")
    return ParsedCompletion(tokens, top, _finish(reason.get("type") if isinstance(reason, dict) else reason))


PARSERS = {"vllm": parse_vllm, "llamacpp": parse_llamacpp, "sglang": parse_sglang}


def parse(api: str, body, k: int) -> ParsedCompletion:
    """The response `body` of a server of kind `api`; MalformedResponse for any body its parser cannot read, whatever
    its shape (a list where an object belongs, a missing key, an entry too short)."""
    try:
        return PARSERS[api](body, k)
    except MalformedResponse:
        raise
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
        raise MalformedResponse(f"an answer of an unexpected shape ({type(exc).__name__}: {str(exc)[:120]})") from None
