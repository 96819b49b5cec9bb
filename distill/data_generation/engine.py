"""The client that generates responses through inference servers: requests spread over every server, at most
`concurrency` in flight on each, a failed one retried with exponential backoff (on whichever server is free next), a
timeout per attempt, and a progress bar.

Each server gets `concurrency` worker threads that take requests from one shared queue, so a faster server simply
takes more of them. A connection error, an HTTP 429 or 5xx, a timeout or a body cut short is retried up to `retries`
times; a server that keeps failing has its workers wait longer between requests, which leaves the queue to the
others. Anything else (an HTTP 4xx, a response without the asked top-k, an unknown token id, a response that ends
neither at a stop token nor at max_new_tokens) stops the run with one line naming the server and the request; the
requests finished by then have been handed to `on_result` (the journal keeps them).
"""
from __future__ import annotations

import http.client
import json
import queue
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from distill.data_generation.parsers import PARSERS, MalformedResponse, ParsedCompletion

BACKOFF_S = 0.5  # first retry's wait; doubled per attempt, capped at BACKOFF_CAP_S, with jitter
BACKOFF_CAP_S = 30.0


class EngineError(RuntimeError):
    """A request that failed for good: one line naming the server and the request."""


@dataclass(frozen=True)
class Server:
    """One server: its base URL, its API kind (`identity.API_KINDS`) and the model name requests carry."""

    url: str
    api: str
    model: str = ""


@dataclass(frozen=True)
class EngineRequest:
    """One response to generate: `key` (sample round, prompt index), a name for messages (`<request id>#<sample>`),
    the prompt's token ids, its temperature (0: greedy) and its sampling seed."""

    key: tuple[int, int]
    name: str
    prompt: list[int]
    temperature: float
    seed: int


@dataclass(frozen=True)
class Settings:
    """What every request asks for and what its response must satisfy."""

    max_new_tokens: int
    topk: int
    stop_ids: tuple[int, ...]
    vocab_size: int


@dataclass
class RunStats:
    """What a run did: responses per server, retries, the fewest top-k entries any position came back with, time."""

    completed: dict[str, int] = field(default_factory=dict)
    retries: int = 0
    fewest_topk: int | None = None
    seconds: float = 0.0


def request_body(server: Server, request: EngineRequest, settings: Settings) -> tuple[str, dict]:
    """(path, JSON body) asking `server` for `request`: the prompt as token ids, plain sampling at the request's
    temperature (no top-k/top-p/min-p cut, no penalties: the target's own distribution), its stop ids, and the
    top-k log-probs of the raw (temperature-1) distribution at every generated token."""
    greedy = request.temperature == 0
    if server.api == "llamacpp":
        return "/completion", {
            "prompt": request.prompt, "n_predict": settings.max_new_tokens, "temperature": request.temperature,
            "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "repeat_penalty": 1.0, "seed": request.seed,
            "n_probs": settings.topk, "return_tokens": True, "cache_prompt": True, "stream": False}
    if server.api == "sglang":
        sampling = {"max_new_tokens": settings.max_new_tokens, "temperature": request.temperature, "top_p": 1.0,
                    "top_k": -1, "min_p": 0.0, "stop_token_ids": list(settings.stop_ids),
                    "skip_special_tokens": False, "sampling_seed": request.seed}
        return "/generate", {"input_ids": request.prompt, "sampling_params": sampling, "return_logprob": True,
                             "top_logprobs_num": settings.topk, "logprob_start_len": -1, "stream": False}
    body = {"prompt": request.prompt, "max_tokens": settings.max_new_tokens, "temperature": request.temperature,
            "top_p": 1.0, "top_k": -1, "min_p": 0.0, "seed": request.seed, "logprobs": settings.topk,
            "return_tokens_as_token_ids": True, "stop_token_ids": list(settings.stop_ids),
            "skip_special_tokens": False, "stream": False}
    if server.model:
        body["model"] = server.model
    if greedy:
        body.pop("seed")
    return "/v1/completions", body


def check_completion(parsed: ParsedCompletion, settings: Settings) -> None:
    """MalformedResponse unless the response is one the target could have given: ids inside its vocabulary, ended
    by a stop id (kept, as `distill.responses` keeps it) or at exactly max_new_tokens, and a top-k at each token."""
    n, stops = len(parsed.tokens), set(settings.stop_ids)
    if n == 0:
        raise MalformedResponse("an empty response")
    unknown = [t for t in parsed.tokens if not 0 <= t < settings.vocab_size]
    unknown += [t for row in parsed.top if row for _, t in row if not 0 <= t < settings.vocab_size]
    if unknown:
        raise MalformedResponse(f"token id {unknown[0]} is outside the target's vocabulary of "
                                f"{settings.vocab_size}: the server does not serve this target's tokenizer")
    if n > settings.max_new_tokens:
        raise MalformedResponse(f"{n} tokens, more than the {settings.max_new_tokens} asked")
    ended = parsed.tokens[-1] in stops
    if any(t in stops for t in parsed.tokens[:-1]) or not (ended or n == settings.max_new_tokens):
        raise MalformedResponse(f"truncated: {n} of at most {settings.max_new_tokens} tokens, finish "
                                f"{parsed.finish!r}, last token {parsed.tokens[-1]} (no stop id "
                                f"{sorted(stops)} where it ended)")
    if all(row is None for row in parsed.top):
        raise MalformedResponse("no top-k log-probs at any token")


class _Retry(Exception):
    """A failure worth another attempt (the server may answer next time)."""


def post_json(url: str, body: dict, timeout: float) -> dict | list:
    """POST `body`; _Retry for what another attempt may cure, EngineError-worthy MalformedResponse for a 4xx."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read()[:300].decode(errors="replace").replace("\n", " ")
        if exc.code == 429 or exc.code >= 500:
            raise _Retry(f"HTTP {exc.code}: {detail}") from None
        hint = (" (vLLM caps top-k at its --max-logprobs, 20 by default: start it with --max-logprobs K or set "
                "distill.responses.topk)") if "logprob" in detail.lower() else ""
        raise MalformedResponse(f"HTTP {exc.code}: {detail}{hint}") from None
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, cut short
        raise _Retry(f"{type(exc).__name__}: {exc}") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise _Retry(f"a body that is not JSON ({len(raw)} bytes; cut short?)") from None


def generate(servers: Sequence[Server], requests: Sequence[EngineRequest], settings: Settings, *,
             on_result: Callable[[EngineRequest, ParsedCompletion], None], concurrency: int = 4,
             timeout: float = 600.0, retries: int = 3, progress: bool = False, backoff: float = BACKOFF_S,
             post: Callable[[str, dict, float], dict | list] = post_json) -> RunStats:
    """Every request's response through `servers`, each handed to `on_result(request, parsed)` as it arrives (one at
    a time, in arrival order). EngineError when a request fails for good; `on_result` has then seen every request
    that finished before it."""
    stats = RunStats(completed={s.url: 0 for s in servers})
    if not requests:
        return stats
    jobs: queue.Queue[tuple[EngineRequest, int]] = queue.Queue()
    for request in requests:
        jobs.put((request, 0))
    lock = threading.Lock()
    outstanding = [len(requests)]
    failure: list[str] = []
    warned: set[str] = set()
    bar = tqdm(total=len(requests), desc="engine responses", unit="resp", disable=not progress, dynamic_ncols=True)
    start = time.perf_counter()

    def wait(attempt: int) -> float:
        return min(BACKOFF_CAP_S, backoff * 2 ** attempt) * (0.5 + random.random())

    def finish(server: Server, request: EngineRequest, parsed: ParsedCompletion) -> None:
        with lock:  # kept even after another request failed: it is a finished response
            on_result(request, parsed)
            stats.completed[server.url] += 1
            returned = parsed.returned_k()
            stats.fewest_topk = returned if stats.fewest_topk is None else min(stats.fewest_topk, returned)
            if returned < settings.topk and server.url not in warned:
                warned.add(server.url)
                bar.write(f"draftops: {server.url} returns {returned} of the {settings.topk} top-k log-probs asked "
                          "at some tokens; the loss's tail bucket holds the rest of their mass")
            outstanding[0] -= 1
            bar.update(1)

    def fail(message: str) -> None:
        with lock:
            if not failure:
                failure.append(message)

    def worker(server: Server) -> None:
        failures_in_a_row = 0
        while not failure:
            with lock:
                if outstanding[0] == 0:
                    return
            try:
                request, attempt = jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            path, body = request_body(server, request, settings)
            try:
                parsed = PARSERS[server.api](post(server.url + path, body, timeout), settings.topk)
                check_completion(parsed, settings)
            except _Retry as exc:
                failures_in_a_row += 1
                if attempt >= retries:
                    fail(f"{server.url}: request {request.name}: {exc} (after {retries} retries)")
                    return
                with lock:
                    stats.retries += 1
                time.sleep(wait(attempt))
                jobs.put((request, attempt + 1))
                time.sleep(wait(min(failures_in_a_row, 6)) if failures_in_a_row > 1 else 0.0)
                continue
            except MalformedResponse as exc:
                fail(f"{server.url}: request {request.name}: {exc}")
                return
            failures_in_a_row = 0
            finish(server, request, parsed)

    threads = [threading.Thread(target=worker, args=(server,), daemon=True, name=f"engine-{server.url}-{i}")
               for server in servers for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    bar.close()
    stats.seconds = time.perf_counter() - start
    if failure:
        raise EngineError(failure[0])
    return stats
