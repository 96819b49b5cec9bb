"""Goodput through a running OpenAI-compatible engine by concurrency, with the draft and without it
(`draftops engine sweep`).

At each concurrency 1, 2, 4, ... N, `requests` held-out prompts are sent `c` at a time (greedy, `max_tokens` each,
non-streaming) to the engine with the draft and then to the engine without it: a second endpoint serving the target
alone, or the same endpoint with `plain_body` merged into each request (the engine's own per-request switch where it
has one, e.g. llama-server's `{"speculative.n_max": 0}`). Each pass records per-request tokens per second (completion
tokens / the request's wall time, prefill included), aggregate throughput (the pass's completion tokens / its wall
time), time per output token (the mean of wall time / completion tokens) and, with the draft, the acceptance the
engine's /metrics counted over the pass (monitor.fleet.counters: vLLM, llama.cpp; SGLang's gauge after the pass).

The boundary is the lowest concurrency whose throughput with the draft is below the throughput without it (None:
it paid at every concurrency swept); `engine_settings` turns it into a setting per concurrency. With several numbers
of draft tokens (llama-server only, whose requests take `speculative.n_max`), every concurrency runs one drafted pass
per number and the fastest is the one compared and recommended. llama-server's requests ask it not to reuse a
cached prompt (`cache_prompt: false`): every pass sends the same prompts. Every request goes through
`pipeline.deadline_http.exchange` (a deadline for the whole reply).
"""
from __future__ import annotations

import http.client
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from monitor.fleet.counters import ServerMetricsError, SpecCounters, parse_spec_counters, scrape, window_between
from monitor.fleet.engine_settings import recommendations
from monitor.fleet.sglang import is_sglang, parse_sglang
from pipeline.deadline_http import DeadlinePassed, exchange
from pipeline.errors import OperatorError

RESULT_FILE, TABLE_FILE = "engine_sweep.json", "engine_sweep.md"
PER_REQUEST_TOKENS = "speculative.n_max"  # llama-server's per-request number of draft tokens
# every pass sends the same prompts: an engine that keeps them cached would prefill only the first pass's, so its
# later passes (the other arm's, at the next concurrency) start ahead; llama-server takes a per-request switch
UNCACHED = {"llamacpp": {"cache_prompt": False}}


class SweepError(OperatorError):
    """The engine could not be driven (unreachable, an error answer, no completion tokens): one line."""


@dataclass
class Pass:
    """One concurrency, with or without the draft."""

    concurrency: int
    draft: bool
    requests: int
    completion_tokens: int
    seconds: float
    tokens_per_second: list[float] = field(default_factory=list)  # per request
    time_per_output_token: float = 0.0
    acceptance: float | None = None
    draft_tokens: int | None = None  # the request's own number of draft tokens, where the sweep set one

    @property
    def throughput(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        per_request = self.tokens_per_second
        return {**asdict(self), "throughput": self.throughput,
                "median_request_tokens_per_second": statistics.median(per_request) if per_request else None}


@dataclass
class SweepResult:
    kind: str
    draft_tokens: int | list[int]
    passes: list[Pass]

    def _by(self) -> dict[tuple[int, bool], Pass]:
        """{(concurrency, drafted): its pass}, the fastest drafted pass where several numbers of tokens ran."""
        by: dict[tuple[int, bool], Pass] = {}
        for p in self.passes:
            if (p.concurrency, p.draft) not in by or p.throughput > by[p.concurrency, p.draft].throughput:
                by[p.concurrency, p.draft] = p
        return by

    def best_draft_tokens(self) -> dict[int, int]:
        """{concurrency: the number of draft tokens of its fastest drafted pass}."""
        first = self.draft_tokens if isinstance(self.draft_tokens, int) else self.draft_tokens[0]
        return {c: (p.draft_tokens or first) for (c, d), p in self._by().items() if d}

    def speedups(self) -> dict[int, float | None]:
        """{concurrency: throughput with the draft (its fastest number of tokens) / without}."""
        by = self._by()
        return {c: (by[c, True].throughput / by[c, False].throughput if by[c, False].throughput > 0 else None)
                for c, d in by if d and (c, False) in by}

    @property
    def boundary(self) -> int | None:
        """The lowest concurrency where speculation stopped paying (module docstring)."""
        return next((c for c, s in sorted(self.speedups().items()) if s is not None and s < 1.0), None)

    def settings(self) -> dict[int, str]:
        return recommendations(self.kind, self.best_draft_tokens(), self.speedups(), self.boundary)

    def to_dict(self) -> dict:
        return {"engine": self.kind, "draft_tokens": self.draft_tokens, "boundary_concurrency": self.boundary,
                "best_draft_tokens": {str(c): k for c, k in self.best_draft_tokens().items()},
                "speedups": {str(c): s for c, s in self.speedups().items()},
                "settings": {str(c): s for c, s in self.settings().items()},
                "passes": [p.to_dict() for p in self.passes]}

    def markdown(self, heading: str) -> str:
        by = self._by()
        several = not isinstance(self.draft_tokens, int) and len(self.draft_tokens) > 1
        lines = [f"# {heading}", "", "| concurrency | tokens/s a request (draft / none) | throughput (draft / none) | "
                 "time per output token, ms (draft / none) | acceptance | speedup | setting |"
                 + (" throughput by draft tokens |" if several else ""),
                 "|---|---|---|---|---|---|---|" + ("---|" if several else "")]
        settings, speedups = self.settings(), self.speedups()
        for c in sorted({c for c, _ in by}):
            d, n = by.get((c, True)), by.get((c, False))
            cells = [f"{statistics.median(p.tokens_per_second):.1f}" if p and p.tokens_per_second else "–"
                     for p in (d, n)]
            acceptance = f"{d.acceptance:.3f}" if d is not None and d.acceptance is not None else "–"
            speedup = f"{speedups[c]:.2f}x" if speedups.get(c) is not None else "–"
            lines.append(f"| {c} | {cells[0]} / {cells[1]} | {d.throughput if d else 0:.1f} / "
                         f"{n.throughput if n else 0:.1f} | {1000 * (d.time_per_output_token if d else 0):.1f} / "
                         f"{1000 * (n.time_per_output_token if n else 0):.1f} | {acceptance} | {speedup} | "
                         f"`{settings.get(c, '–')}` |" + (f" {self._by_tokens(c)} |" if several else ""))
        stop = self.boundary
        lines += ["", f"Speculation stops paying at concurrency {stop}." if stop else
                  "Speculation paid at every concurrency swept."]
        return "\n".join(lines) + "\n"


    def _by_tokens(self, concurrency: int) -> str:
        return ", ".join(f"{p.draft_tokens}: {p.throughput:.1f}" for p in self.passes
                         if p.draft and p.concurrency == concurrency)


def complete(url: str, model: str | None, messages: list[dict], max_tokens: int, extra: dict, timeout: float
             ) -> tuple[int, float]:
    """One greedy chat completion: (its completion tokens, its wall seconds); SweepError naming what failed."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": False, **extra}
    if model:
        body["model"] = model
    start = time.perf_counter()
    try:
        answer = exchange(f"{url.rstrip('/')}/v1/chat/completions", data=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json"}, timeout=timeout)
    except DeadlinePassed:
        raise SweepError(f"{url}: no whole answer within {timeout:g} s (--timeout)") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise SweepError(f"{url}: {type(exc).__name__}: {exc}") from None
    seconds = time.perf_counter() - start
    if answer.status != 200:
        raise SweepError(f"{url}: {answer.said()}")
    tokens = int((answer.json().get("usage") or {}).get("completion_tokens") or 0)
    if tokens <= 0:
        raise SweepError(f"{url}: the answer counts no completion tokens (usage.completion_tokens)")
    return tokens, seconds


def _window(before: str | None, after: str | None) -> SpecCounters | None:
    """The engine's speculative counters between two pages of its /metrics; None without them (or for SGLang)."""
    if after is None or before is None or is_sglang(after):
        return None
    try:
        window, restarted = window_between(parse_spec_counters(before), parse_spec_counters(after))
    except ServerMetricsError:
        return None
    return None if restarted else window


def _acceptance(before: str | None, after: str | None) -> float | None:
    """The engine's acceptance between two pages of its /metrics (SGLang: its gauge after); None without them."""
    if after is not None and is_sglang(after):
        return parse_sglang(after).accept_rate
    window = _window(before, after)
    return window.acceptance if window is not None and window.draft_tokens > 0 else None


def _check_switch(url: str, draft: bool, extra: dict, window: SpecCounters | None) -> None:
    """A request's own switch (`--plain-body`, a per-request number of draft tokens) held, as the engine's counters
    over the pass say; SweepError where the engine ignored it (llama-server builds that disable per-request
    speculative settings)."""
    if window is None or not (extra.keys() - {"cache_prompt"}):
        return
    if not draft and window.draft_tokens > 0:
        raise SweepError(f"{url} kept drafting with --plain-body {json.dumps(extra)} ({window.draft_tokens:.0f} draft "
                         "tokens counted): this engine ignores the per-request switch; give --plain-url, a second "
                         "server of the target without the draft")
    tokens = extra.get(PER_REQUEST_TOKENS)
    if draft and tokens and window.drafts > 0 and window.draft_tokens > tokens * window.drafts:
        raise SweepError(f"{url} drafted {window.draft_tokens / window.drafts:.1f} tokens a round where requests asked "
                         f"for at most {tokens} ({PER_REQUEST_TOKENS}): this engine ignores the per-request number; "
                         "sweep one --draft-tokens per server start")


def run_pass(url: str, model: str | None, prompts: list[list[dict]], concurrency: int, draft: bool, max_tokens: int,
             extra: dict, timeout: float, metrics_url: str | None = None) -> Pass:
    """`prompts` sent `concurrency` at a time; the pass's figures."""
    page = (lambda: scrape(metrics_url, timeout)) if metrics_url and (draft or extra) else (lambda: None)
    try:
        before = page()
    except ServerMetricsError:
        before = None
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        done = list(pool.map(lambda m: complete(url, model, m, max_tokens, extra, timeout), prompts))
    seconds = time.perf_counter() - start
    try:
        after = page()
    except ServerMetricsError:
        after = None
    _check_switch(url, draft, extra, _window(before, after))
    return Pass(concurrency, draft, len(done), sum(t for t, _ in done), seconds, [t / s for t, s in done],
                statistics.mean(s / t for t, s in done), _acceptance(before, after) if draft else None,
                extra.get(PER_REQUEST_TOKENS) if draft else None)


def levels(maximum: int) -> list[int]:
    """1, 2, 4, ... up to `maximum` (and `maximum` itself)."""
    out, c = [], 1
    while c < maximum:
        out.append(c)
        c *= 2
    return out + [maximum]


def sweep(*, url: str, plain_url: str | None, plain_body: dict, kind: str, draft_tokens: int | list[int],
          model: str | None, prompts: list[list[dict]], max_concurrency: int, requests: int, max_tokens: int,
          timeout: float, metrics_url: str | None, progress: Callable[[], None] = lambda: None) -> SweepResult:
    """Every concurrency with and without the draft, the drafted pass once per number of draft tokens where several
    are given (module docstring)."""
    several = not isinstance(draft_tokens, int) and len(draft_tokens) > 1
    if several and kind != "llamacpp":
        raise SweepError(f"several --draft-tokens ({draft_tokens}) need a per-request number of draft tokens, which "
                         f"llama-server takes and {kind} does not: sweep one number per server start")
    fresh = UNCACHED.get(kind, {})
    extras = [{**fresh, PER_REQUEST_TOKENS: k} for k in draft_tokens] if several else [fresh]
    passes = []
    for c in levels(max_concurrency):
        batch = [prompts[i % len(prompts)] for i in range(max(requests, c))]
        for extra in extras:
            passes.append(run_pass(url, model, batch, c, True, max_tokens, extra, timeout, metrics_url))
            progress()
        passes.append(run_pass(plain_url or url, model, batch, c, False, max_tokens, {**fresh, **plain_body}, timeout,
                               None if plain_url else metrics_url))
        progress()
    return SweepResult(kind, draft_tokens, passes)
