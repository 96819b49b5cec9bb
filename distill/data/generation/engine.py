"""The client that generates responses through inference servers: requests spread over every server, at most
`concurrency` in flight on each, a failed one retried with capped exponential backoff (on whichever server is free
next), one deadline per attempt, a bound on how long a job retries without an answer, and a progress bar.

Each server gets `concurrency` worker threads that take requests from one shared queue, so a faster server simply
takes more of them. A connection error, an HTTP 429 or 5xx, an attempt past its deadline (`timeout` seconds for
connecting, the headers and the whole body: `pipeline.deadline_http`), a body cut short or one that is not JSON is
retried up to `retries` times; a server that keeps failing has its workers wait longer between requests, which
leaves the queue to the others. A job that has kept no response for `give_up_after` seconds while its attempts fail
stops retrying.

Every answer is checked before it is kept: its types and shapes (`parsers.parse`), the model that answered, its ids
inside the target's vocabulary, its end, and its top-k (`check_completion`). Anything else than an answer to keep
stops the run: an HTTP 4xx, an answer that is not what was asked, a request out of retries, the time above spent, or
any error in a worker thread. The run then ends in the calling thread with one `EngineError` line naming the server,
the request, what it answered and how many requests remain for a rerun; the requests finished by then have been
handed to `on_result` (the journal keeps them), and a bad answer never is.
"""
from __future__ import annotations

import http.client
import json
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from distill.data.generation.parsers import MalformedResponse, ParsedCompletion, parse
from pipeline.deadline_http import DeadlinePassed, exchange
from pipeline.errors import OperatorError

BACKOFF_S = 0.5  # first retry's wait; doubled per attempt, capped at BACKOFF_CAP_S, with jitter
BACKOFF_CAP_S = 30.0
GIVE_UP_AFTER_S = 900.0


class EngineError(OperatorError):
    """A job the servers could not finish: one line naming the server, the request, what it answered and how many
    requests remain for a rerun."""


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
    """MalformedResponse unless the response is one the target could have given: a top-k row per token, ids inside
    its vocabulary, ended by a stop id (kept, as `distill.data.responses` keeps it) or at exactly max_new_tokens, and a
    teacher in its top-k (`check_topk`)."""
    n, stops = len(parsed.tokens), set(settings.stop_ids)
    if n == 0:
        raise MalformedResponse("an empty response")
    if len(parsed.top) != n:
        raise MalformedResponse(f"{n} tokens but {len(parsed.top)} top-k rows")
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
    check_topk(parsed)


def check_topk(parsed: ParsedCompletion) -> None:
    """MalformedResponse unless the top-k rows make a teacher. A server may return fewer entries than asked (its cap:
    the loss's tail bucket holds the rest of the mass) and none at a few tokens (llama-server at a token that ends
    inside a UTF-8 character), but it returns the same number wherever it returns any, and some at most tokens."""
    sizes = [len(row) for row in parsed.top if row]
    if not sizes:
        raise MalformedResponse("no top-k log-probs at any token")
    if 2 * len(sizes) < len(parsed.top):
        raise MalformedResponse(f"top-k log-probs at only {len(sizes)} of {len(parsed.top)} tokens")
    if min(sizes) < max(sizes):
        short = next(i for i, row in enumerate(parsed.top) if row and len(row) == min(sizes))
        raise MalformedResponse(f"a short top-k: token {short} holds {min(sizes)} of the {max(sizes)} entries the "
                                "others hold")


def check_model(server: Server, body) -> None:
    """MalformedResponse when an OpenAI-style answer names another model than the one the server listed."""
    answered = body.get("model") if server.api == "vllm" and isinstance(body, dict) else None
    if server.model and answered is not None and answered != server.model:
        raise MalformedResponse(f"answered by model {str(answered)[:100]!r}, not {server.model!r}, which it serves")


class _Retry(Exception):
    """A failure worth another attempt (the server may answer next time)."""


def post_json(url: str, body: dict, timeout: float) -> dict | list:
    """POST `body` and read the whole answer within `timeout` seconds; _Retry for what another attempt may cure,
    MalformedResponse for a 4xx."""
    try:
        answer = exchange(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                          timeout=timeout)
    except DeadlinePassed as exc:
        raise _Retry(f"{exc} (distill.responses.timeout)") from None
    except http.client.IncompleteRead as exc:
        raise _Retry(f"a body cut short ({len(exc.partial)} bytes of {len(exc.partial) + (exc.expected or 0)})"
                     ) from None
    except (OSError, http.client.HTTPException) as exc:  # refused, reset
        raise _Retry(f"{type(exc).__name__}: {exc}") from None
    if not 200 <= answer.status < 300:
        detail = answer.body[:300].decode(errors="replace").replace("\n", " ")
        if answer.status == 429 or answer.status >= 500:
            raise _Retry(f"HTTP {answer.status}: {detail}")
        hint = (" (vLLM caps top-k at its --max-logprobs, 20 by default: start it with --max-logprobs K or set "
                "distill.responses.topk)") if "logprob" in detail.lower() else ""
        raise MalformedResponse(f"HTTP {answer.status}: {detail}{hint}")
    try:
        return json.loads(answer.body)
    except (ValueError, RecursionError):
        raise _Retry(f"a body that is not JSON ({len(answer.body)} bytes, {answer.body[:40]!r}...; cut short?)"
                     ) from None


class _Run:
    """One `generate` call: the shared queue, the requests left, the first failure and the time of the last kept
    response, and what its worker threads do."""

    def __init__(self, servers: Sequence[Server], requests: Sequence[EngineRequest], settings: Settings,
                 on_result: Callable[[EngineRequest, ParsedCompletion], None], *, timeout: float, retries: int,
                 give_up_after: float, backoff: float, post: Callable, progress: bool):
        self.settings, self.on_result, self.post = settings, on_result, post
        self.timeout, self.retries, self.give_up_after, self.backoff = timeout, retries, give_up_after, backoff
        self.jobs: queue.Queue[tuple[EngineRequest, int]] = queue.Queue()
        for request in requests:
            self.jobs.put((request, 0))
        self.lock = threading.Lock()
        self.total = self.left = len(requests)
        self.failure: str | None = None
        self.stopped = threading.Event()
        self.last_kept = time.monotonic()
        self.warned: set[str] = set()
        self.stats = RunStats(completed={s.url: 0 for s in servers})
        self.bar = tqdm(total=len(requests), desc="engine responses", unit="resp", disable=not progress,
                        dynamic_ncols=True)

    def fail(self, message: str) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = message
        self.stopped.set()

    def wait(self, attempt: int) -> float:
        return min(BACKOFF_CAP_S, self.backoff * 2 ** attempt) * (0.5 + random.random())

    def worker(self, server: Server) -> None:
        """Take requests until none is left or the run failed; any error ends the run (`fail`), never the thread
        alone."""
        try:
            self._serve(server)
        except BaseException as exc:  # reported by the calling thread
            self.fail(f"{server.url}: {type(exc).__name__}: {str(exc)[:300]}")

    def _serve(self, server: Server) -> None:
        in_a_row = 0
        while not self.stopped.is_set():
            with self.lock:
                if self.left == 0:
                    return
            try:
                request, attempt = self.jobs.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                path, body = request_body(server, request, self.settings)
                answer = self.post(server.url + path, body, self.timeout)
                check_model(server, answer)
                parsed = parse(server.api, answer, self.settings.topk)
                check_completion(parsed, self.settings)
            except _Retry as exc:
                in_a_row += 1
                self.retry(server, request, attempt, exc, in_a_row)
                continue
            except MalformedResponse as exc:
                self.fail(f"{server.url}: request {request.name}: {exc}")
                return
            in_a_row = 0
            self.keep(server, request, parsed)

    def retry(self, server: Server, request: EngineRequest, attempt: int, exc: _Retry, in_a_row: int) -> None:
        """Put a failed request back after its backoff, unless it is out of retries or the job has kept no response
        for `give_up_after` seconds; then wait longer the more this server failed in a row."""
        waited = time.monotonic() - self.last_kept
        if attempt >= self.retries:
            self.fail(f"{server.url}: request {request.name}: {exc} (after {self.retries} retries)")
            return
        if waited >= self.give_up_after:
            self.fail(f"{server.url}: request {request.name}: {exc}; no response kept for {waited:.0f} s of "
                      f"retries (distill.responses.give_up_after={self.give_up_after:g})")
            return
        with self.lock:
            self.stats.retries += 1
        left = self.give_up_after - waited
        self.stopped.wait(min(self.wait(attempt), left))
        self.jobs.put((request, attempt + 1))
        if in_a_row > 1:
            self.stopped.wait(min(self.wait(min(in_a_row, 6)), left))

    def keep(self, server: Server, request: EngineRequest, parsed: ParsedCompletion) -> None:
        with self.lock:  # kept even after another request failed: it is a finished response
            self.on_result(request, parsed)
            self.left -= 1
            self.last_kept = time.monotonic()
            self.stats.completed[server.url] += 1
            returned = parsed.returned_k()
            self.stats.fewest_topk = returned if self.stats.fewest_topk is None else min(self.stats.fewest_topk,
                                                                                         returned)
            if returned < self.settings.topk and server.url not in self.warned:
                self.warned.add(server.url)
                self.bar.write(f"draftops: {server.url} returns {returned} of the {self.settings.topk} top-k "
                               "log-probs asked at some tokens; the loss's tail bucket holds the rest of their mass")
            self.bar.update(1)


def generate(servers: Sequence[Server], requests: Sequence[EngineRequest], settings: Settings, *,
             on_result: Callable[[EngineRequest, ParsedCompletion], None], concurrency: int = 4,
             timeout: float = 600.0, retries: int = 3, give_up_after: float = GIVE_UP_AFTER_S,
             progress: bool = False, backoff: float = BACKOFF_S,
             post: Callable[[str, dict, float], dict | list] = post_json) -> RunStats:
    """Every request's response through `servers`, each handed to `on_result(request, parsed)` as it arrives (one at
    a time, in arrival order). EngineError when the run cannot finish; `on_result` has then seen every request that
    finished before it, and no other."""
    if not requests:
        return RunStats(completed={s.url: 0 for s in servers})
    run = _Run(servers, requests, settings, on_result, timeout=timeout, retries=retries, give_up_after=give_up_after,
               backoff=backoff, post=post, progress=progress)
    start = time.perf_counter()
    threads = [threading.Thread(target=run.worker, args=(server,), daemon=True, name=f"engine-{server.url}-{i}")
               for server in servers for i in range(concurrency)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    except BaseException:  # an interrupt: the workers stop taking requests
        run.fail("interrupted")
        raise
    finally:
        run.bar.close()
    run.stats.seconds = time.perf_counter() - start
    if run.failure is not None or run.left:  # counted now: requests in flight at the failure may have finished since
        raise EngineError(f"{run.failure or 'requests left unanswered'}; {run.left} of {run.total} requests remain: "
                          "run again to ask for those only (the finished ones are kept)")
    return run.stats
