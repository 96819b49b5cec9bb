"""Live acceptance read from a serving engine's Prometheus endpoint: vLLM's `/metrics`, llama.cpp's
`llama-server --metrics`.

The offline check measures the champion on held-out traffic; a serving engine counts what the draft it serves really
achieves on all of its traffic. Both engines export the same four cumulative counters, with prefix `vllm` or
`llamacpp`:

    <prefix>:spec_decode_num_drafts_total                 drafts (verification steps)
    <prefix>:spec_decode_num_draft_tokens_total           draft tokens proposed
    <prefix>:spec_decode_num_accepted_tokens_total        draft tokens accepted
    <prefix>:spec_decode_num_accepted_tokens_per_pos_total{position="i"}
                                                          drafts whose tokens 0..i were all accepted (i 0-based)

vLLM labels each with `model_name` and `engine` (one label set per engine core; data-parallel servers have several)
and also exports a `_created` timestamp per counter; llama.cpp has no labels (in router mode the model is chosen by
`?model=NAME` in the URL), prints values with 6 significant digits (a counter past 10^6 is rounded) and has no
per-position counter before its first speculative request. Counters are picked by sample name: prometheus_client's
parser files a counter under its name without `_total` (and a family without a TYPE line under its full name), while
its samples keep `_total` in both cases, and `_created` samples are never picked. Label sets are summed, or only those
whose `model_name` is `monitor.server_model_name`.

Windows. A counter only says what happened since the server started, so each check scrapes once and the difference
from the previous scrape (kept in `<monitor.state_dir>/server_metrics.json`, written atomically) is one window. A
counter lower than at the previous scrape means that the server restarted in between: the window is then the current
counters alone, what the new process counted (the traffic between the previous scrape and the restart is lost). A
restart followed by more traffic than the old process had counted is not seen; counters that cannot be true are
ImpossibleCounters. Window acceptance = accepted / draft tokens; acceptance at position i = accepted_per_pos[i] /
drafts (vLLM's per-position acceptance rate: per draft, not given the position was reached).

Drift. Tokens within a window share requests and prompts, so they are not independent trials; the window is the unit.
The first `server_baseline_windows` windows closed while a version is champion are its baseline; once
`server_recent_windows` more exist, the last of them are compared with the baseline by `stats.window_drop_test`. A
window that spans a change of champion belongs to neither version and is not kept; a version that becomes champion
again (rollback) keeps its baseline and starts its recent windows afresh. A window without draft tokens (an idle
server) has no acceptance and is not kept either. Changing the URL or the model name starts the state over.
"""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from monitor.stats.acceptance_tests import DropTest, window_drop_test
from pipeline.config import DraftopsConfig
from pipeline.files import write_text_atomic

ENGINES = ("vllm", "llamacpp")
COUNTERS = {"drafts": "spec_decode_num_drafts_total", "draft_tokens": "spec_decode_num_draft_tokens_total",
            "accepted": "spec_decode_num_accepted_tokens_total"}
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"
STATE_FILE = "server_metrics.json"
# the text format prometheus_client's parser reads; asked for so that a server able to answer in OpenMetrics does not
ACCEPT = "text/plain; version=0.0.4"
MAX_SCRAPE_BYTES = 64 << 20  # a vLLM page with many label sets is a few MiB


class ServerMetricsError(RuntimeError):
    """The endpoint could not be read, or holds no speculative-decoding counters (the message says what it holds)."""


class ImpossibleCounters(ServerMetricsError):
    """Counters that cannot be true (a count below 0 or not finite, more tokens accepted than drafted, in a scrape or
    over a window): an error the check reports, never a window it tests or a deployment it confirms."""


@dataclass(frozen=True)
class SpecCounters:
    """Speculative-decoding counters of one scrape, or their difference over one window."""

    engine: str
    drafts: float
    draft_tokens: float
    accepted: float
    accepted_per_pos: tuple[float, ...] = ()  # index = draft position, 0-based

    @property
    def acceptance(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens > 0 else math.nan

    def position_acceptance(self) -> list[float]:
        """Share of drafts whose tokens 0..i were all accepted, for each position i."""
        return [v / self.drafts if self.drafts > 0 else math.nan for v in self.accepted_per_pos]

    def to_dict(self) -> dict:
        return {**asdict(self), "accepted_per_pos": list(self.accepted_per_pos)}

    @classmethod
    def from_dict(cls, data: dict) -> SpecCounters:
        return cls(data["engine"], float(data["drafts"]), float(data["draft_tokens"]), float(data["accepted"]),
                   tuple(float(v) for v in data.get("accepted_per_pos", ())))


def _seen(names: list[str]) -> str:
    """What a metrics text holds, for an error message: each engine prefix with a few of its families, else a few
    family names."""
    prefixes = list(dict.fromkeys(n.split(":", 1)[0] for n in names if ":" in n))
    if prefixes:
        return "; ".join(f"{p} metrics ({len(of)} families, e.g. {', '.join(of[:3])})"
                         for p in prefixes for of in [[n for n in names if n.startswith(p + ":")]])
    return f"{len(names)} metric families ({', '.join(names[:5]) or 'none'})"


def parse_spec_counters(text: str, model_name: str | None = None) -> SpecCounters:
    """The speculative-decoding counters in a Prometheus text exposition, summed over label sets (of `model_name`
    only, when given)."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ServerMetricsError(f"not a Prometheus text exposition: {exc}") from None
    wanted = {f"{engine}:{name}": (engine, key) for engine in ENGINES
              for key, name in (*COUNTERS.items(), ("per_pos", PER_POSITION))}
    totals: dict[str, dict[str, float]] = {}
    per_pos: dict[str, dict[int, float]] = {}
    models: set[str] = set()
    unlabeled = False  # counters without a model_name label were left out by the filter
    for sample in (s for family in families for s in family.samples if s.name in wanted):
        engine, key = wanted[sample.name]
        if model_name is not None and sample.labels.get("model_name") != model_name:
            if "model_name" in sample.labels:
                models.add(sample.labels["model_name"])
            else:
                unlabeled = True
            continue
        if key == "per_pos":
            if sample.labels.get("position", "").isdigit():
                by_position = per_pos.setdefault(engine, {})
                position = int(sample.labels["position"])
                by_position[position] = by_position.get(position, 0.0) + sample.value
        else:
            by_key = totals.setdefault(engine, {})
            by_key[key] = by_key.get(key, 0.0) + sample.value
    complete = [e for e in ENGINES if set(totals.get(e, {})) == set(COUNTERS)]
    if len(complete) > 1:
        raise ServerMetricsError(f"speculative-decoding counters of several engines ({', '.join(complete)}) in one "
                                 "exposition: point monitor.server_metrics_url at one server")
    if not complete:
        if models:
            raise ServerMetricsError(f"no speculative-decoding counters with model_name={model_name!r}; model names "
                                     f"seen: {', '.join(sorted(models))}")
        if unlabeled:
            raise ServerMetricsError(f"the speculative-decoding counters carry no model_name label to match "
                                     f"{model_name!r} (llama.cpp): unset monitor.server_model_name (in router mode "
                                     "put ?model=NAME in monitor.server_metrics_url)")
        raise ServerMetricsError(
            f"no speculative-decoding counters (<prefix>:{COUNTERS['drafts']}, ...:{COUNTERS['draft_tokens']}, "
            f"...:{COUNTERS['accepted']} with prefix vllm or llamacpp): the endpoint exports "
            f"{_seen([f.name for f in families])}; is the server decoding with a draft (vLLM --speculative-config, "
            "llama-server --model-draft with --metrics)?")
    engine = complete[0]
    positions = per_pos.get(engine, {})
    return check_possible(SpecCounters(
        engine, totals[engine]["drafts"], totals[engine]["draft_tokens"], totals[engine]["accepted"],
        tuple(positions.get(i, 0.0) for i in range(max(positions) + 1)) if positions else ()), "the engine's counters")


def check_possible(counters: SpecCounters, what: str, slack: float = 0.0) -> SpecCounters:
    """`counters`, or ImpossibleCounters unless every count is finite and >= 0 and no more tokens were accepted than
    drafted (`slack`: what rounded counters may be off by; llama.cpp prints 6 significant digits)."""
    counts = {"drafts": counters.drafts, "draft tokens": counters.draft_tokens, "accepted tokens": counters.accepted,
              **{f"accepted at position {i}": v for i, v in enumerate(counters.accepted_per_pos)}}
    wrong = [f"{name} {value:g}" for name, value in counts.items() if not math.isfinite(value) or value < -slack]
    if not wrong and counters.accepted > counters.draft_tokens + slack:
        wrong = [f"{counters.accepted:g} accepted tokens of {counters.draft_tokens:g} drafted"]
    if wrong:
        raise ImpossibleCounters(f"{what} cannot be true: {', '.join(wrong)}")
    return counters


def scrape(url: str, timeout: float = 10.0) -> str:
    """The text a metrics endpoint answers, whole within `timeout` seconds (an overall deadline: an endpoint that
    trickles its answer is cut off, never waited on); a ServerMetricsError that says why when it does not. The
    request runs in a daemon thread, so that not even a server that sends its headers slowly outlasts the deadline."""
    result: dict[str, object] = {}
    worker = threading.Thread(target=lambda: result.update(_fetch(url, timeout)), daemon=True, name="scrape")
    worker.start()
    worker.join(timeout)
    if worker.is_alive() or not result:
        raise ServerMetricsError(f"{url}: no complete answer within {timeout:g} s (monitor.server_timeout)")
    if "error" in result:
        raise ServerMetricsError(str(result["error"]))
    return str(result["text"])


def _fetch(url: str, timeout: float) -> dict[str, object]:
    """{"text": ...} or {"error": ...}; reads in pieces, each given the time left, and stops at the deadline."""
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"Accept": ACCEPT})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            sock = getattr(getattr(response.fp, "raw", None), "_sock", None)
            body = bytearray()
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                if sock is not None:
                    sock.settimeout(left)
                chunk = response.read1(1 << 16)
                if not chunk:
                    return {"text": body.decode("utf-8")}
                body += chunk
                if len(body) > MAX_SCRAPE_BYTES:
                    return {"error": f"{url}: the answer exceeds {MAX_SCRAPE_BYTES >> 20} MiB: not a metrics page"}
    except urllib.error.HTTPError as exc:
        hint = " (llama-server serves /metrics only with --metrics)" if exc.code in (404, 501) else ""
        return {"error": f"{url}: HTTP {exc.code} {exc.reason}{hint}"}
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            return {"error": f"{url}: no complete answer within {timeout:g} s (monitor.server_timeout)"}
        return {"error": f"{url}: server unreachable: {exc.reason}"}
    except TimeoutError:
        return {"error": f"{url}: no complete answer within {timeout:g} s (monitor.server_timeout)"}
    except UnicodeDecodeError as exc:
        return {"error": f"{url}: the answer is not UTF-8 text: {exc}"}
    except (OSError, ValueError, http.client.HTTPException) as exc:  # a reset connection, a malformed answer
        return {"error": f"{url}: {type(exc).__name__}: {exc}"}


def window_between(previous: SpecCounters | None, current: SpecCounters) -> tuple[SpecCounters | None, bool]:
    """(the counters' difference since `previous`, whether the server restarted in between); no window without a
    previous scrape. A counter that went down is a restart: the window is then `current` alone."""
    if previous is None or previous.engine != current.engine:
        return None, False
    n_pos = max(len(previous.accepted_per_pos), len(current.accepted_per_pos))
    before = (previous.drafts, previous.draft_tokens, previous.accepted,
              *previous.accepted_per_pos, *(0.0,) * (n_pos - len(previous.accepted_per_pos)))
    now = (current.drafts, current.draft_tokens, current.accepted,
           *current.accepted_per_pos, *(0.0,) * (n_pos - len(current.accepted_per_pos)))
    if any(b > a for b, a in zip(before, now)):
        return current, True
    delta = [a - b for a, b in zip(now, before)]
    rounding = 1e-5 * sum(abs(v) for v in before[1:3] + now[1:3]) if current.engine == "llamacpp" else 0.0
    return check_possible(SpecCounters(current.engine, delta[0], delta[1], delta[2], tuple(delta[3:])),
                          "the engine's counters over a window", slack=rounding), False


@dataclass
class Window:
    """One window between two scrapes, and the champion version it belongs to."""

    start: str
    end: str
    champion_version: str
    counters: SpecCounters
    restarted: bool = False

    def to_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "champion_version": self.champion_version,
                "counters": self.counters.to_dict(), "restarted": self.restarted}

    @classmethod
    def from_dict(cls, data: dict) -> Window:
        return cls(data["start"], data["end"], str(data["champion_version"]),
                   SpecCounters.from_dict(data["counters"]), bool(data.get("restarted", False)))


@dataclass
class ServerReading:
    """What one check read from the server: the window it closed (if any), the window test (once enough windows
    exist), why either is missing, or the error that stopped the reading."""

    url: str
    window: Window | None = None
    test: DropTest | None = None
    n_baseline_windows: int = 0
    n_recent_windows: int = 0
    notes: list[str] = field(default_factory=list)
    error: str | None = None
    impossible: bool = False  # the error: counters that cannot be true

    def to_dict(self) -> dict:
        return {"url": self.url, "window": self.window and self.window.to_dict(),
                "acceptance": self.window.counters.acceptance if self.window else None,
                "test": self.test and self.test.to_dict(), "n_baseline_windows": self.n_baseline_windows,
                "n_recent_windows": self.n_recent_windows, "notes": self.notes, "error": self.error}

    def summary(self) -> str:
        if self.error:
            return f"  server: {self.error}"
        lines = []
        if self.window is not None and self.window.counters.draft_tokens > 0:
            c = self.window.counters
            positions = ", ".join(f"{a:.3f}" for a in c.position_acceptance())
            lines.append(f"  server: window acceptance {c.acceptance:.3f} ({c.accepted:.0f}/{c.draft_tokens:.0f} "
                         f"draft tokens, {c.drafts:.0f} drafts{f'; by position {positions}' if positions else ''})")
        if self.test is not None:
            t = self.test
            lines.append(f"  server windows: {t.baseline_acceptance:.3f} -> {t.current_acceptance:.3f}, drop "
                         f"{t.drop:+.3f} [{t.ci_low:+.3f}, {t.ci_high:+.3f}], p={t.p_value:.3g} "
                         f"({t.n_current_prompts} recent vs {t.n_baseline_prompts} baseline windows)")
        return "\n".join(lines)


def state_path(cfg: DraftopsConfig) -> Path:
    return Path(cfg.monitor.state_dir).resolve() / STATE_FILE


def _empty_state(url: str, model_name: str | None) -> dict:
    return {"source": {"url": url, "model_name": model_name}, "last": None, "versions": {}}


def load_state(path: Path, url: str, model_name: str | None) -> dict:
    """The recorded scrapes and windows of this source; a fresh state for another source or none yet."""
    if not path.exists():
        return _empty_state(url, model_name)
    state = json.loads(path.read_text())
    if state.get("source") != {"url": url, "model_name": model_name}:
        return _empty_state(url, model_name)
    return state


def record(state: dict, counters: SpecCounters, champion_version: str, at: str, n_baseline: int, n_recent: int
           ) -> tuple[Window | None, list[str]]:
    """Add one scrape to `state`: the window it closes (or None) and notes saying why a window was not kept."""
    last = state["last"]
    previous = SpecCounters.from_dict(last["counters"]) if last else None
    delta, restarted = window_between(previous, counters)
    state["last"] = {"at": at, "champion_version": champion_version, "counters": counters.to_dict()}
    version = state["versions"].setdefault(champion_version, {"baseline": [], "recent": []})
    notes = []
    if restarted:
        notes.append("server counters went down since the last check (restart): the window is what the server "
                     "counted since")
    if delta is None:
        notes.append("first reading of this server: the next check closes the first window")
        return None, notes
    window = Window(last["at"], at, champion_version, delta, restarted)
    if last["champion_version"] != champion_version:
        version["recent"] = []
        notes.append(f"the window spans a change of champion ({last['champion_version']} -> {champion_version}): "
                     "not kept")
        return window, notes
    if delta.draft_tokens <= 0:
        notes.append("no draft tokens since the last check: no window kept")
        return window, notes
    if len(version["baseline"]) < n_baseline:
        version["baseline"].append(window.to_dict())
    else:
        version["recent"] = (version["recent"] + [window.to_dict()])[-n_recent:]
    return window, notes


def window_test(state: dict, champion_version: str, n_baseline: int, n_recent: int, margin: float, level: float,
                seed: int = 0) -> tuple[DropTest | None, int, int]:
    """The window test of this version's recent windows against its baseline windows, when there are enough."""
    version = state["versions"].get(champion_version, {"baseline": [], "recent": []})
    baseline = [Window.from_dict(w).counters for w in version["baseline"][:n_baseline]]
    recent = [Window.from_dict(w).counters for w in version["recent"][-n_recent:]]
    if len(baseline) < n_baseline or len(recent) < n_recent:
        return None, len(baseline), len(recent)
    test = window_drop_test([w.accepted for w in baseline], [w.draft_tokens for w in baseline],
                            [w.accepted for w in recent], [w.draft_tokens for w in recent], margin, level, seed=seed)
    return test, len(baseline), len(recent)


def read_server(cfg: DraftopsConfig, champion_version: str,
                fetch: Callable[[str, float], str] | None = None) -> ServerReading:
    """One check's server reading: scrape (with `fetch`, default `scrape`), record the window in the state file, run
    the window test when it can."""
    m = cfg.monitor
    reading = ServerReading(m.server_metrics_url)
    path = state_path(cfg)
    state = load_state(path, m.server_metrics_url, m.server_model_name)
    at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    try:
        text = (fetch or scrape)(m.server_metrics_url, m.server_timeout)
        counters = parse_spec_counters(text, m.server_model_name)
        reading.window, reading.notes = record(state, counters, champion_version, at, m.server_baseline_windows,
                                               m.server_recent_windows)
    except ServerMetricsError as exc:
        reading.error, reading.impossible = str(exc), isinstance(exc, ImpossibleCounters)
        return reading
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(state, indent=1))
    reading.test, reading.n_baseline_windows, reading.n_recent_windows = window_test(
        state, champion_version, m.server_baseline_windows, m.server_recent_windows, m.margin, m.level, cfg.seed)
    if reading.test is None:
        reading.notes.append(f"server windows of version {champion_version}: {reading.n_baseline_windows} of "
                             f"{m.server_baseline_windows} baseline, {reading.n_recent_windows} of "
                             f"{m.server_recent_windows} recent; the window test runs once both are complete")
    return reading


def recorded_windows(cfg: DraftopsConfig) -> list[tuple[float, float]]:
    """(accepted, draft tokens) of every window the state file keeps, for `draftops monitor simulate --server`."""
    m = cfg.monitor
    state = load_state(state_path(cfg), m.server_metrics_url, m.server_model_name)
    return [(w["counters"]["accepted"], w["counters"]["draft_tokens"]) for v in state["versions"].values()
            for w in v["baseline"] + v["recent"]]
