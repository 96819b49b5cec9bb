"""Live acceptance read from a serving engine's Prometheus endpoint: vLLM's `/metrics`, llama.cpp's
`llama-server --metrics` (SGLang's gauges: monitor.fleet.sglang).

The offline check measures the champion on held-out traffic; a serving engine counts what the draft it serves really
achieves on all of its traffic. Both engines export the same four cumulative counters, with prefix `vllm` or
`llamacpp`:

    <prefix>:spec_decode_num_drafts_total                 drafts (verification steps)
    <prefix>:spec_decode_num_draft_tokens_total           draft tokens proposed
    <prefix>:spec_decode_num_accepted_tokens_total        draft tokens accepted
    <prefix>:spec_decode_num_accepted_tokens_per_pos_total{position="i"}
                                                          drafts whose tokens 0..i were all accepted (i 0-based)"""
# vLLM labels each with `model_name` and `engine` (one label set per engine core; data-parallel servers have several,
# read summed or one per core: `parse_per_core`) and also exports a `_created` timestamp per counter; llama.cpp has no
# labels (in router mode the model is chosen by `?model=NAME` in the URL), prints values with 6 significant digits (a
# counter past 10^6 is rounded) and has no per-position counter before its first speculative request. Counters are
# picked by sample name: prometheus_client's parser files a counter under its name without `_total` (and a family
# without a TYPE line under its full name), while its samples keep `_total` in both cases, and `_created` samples are
# never picked. Label sets are summed, or only those whose `model_name` is the engine's configured model.
#
# A window is the difference between two scrapes (`window_between`). A counter lower than at the previous scrape means
# that the server restarted in between: the window is then the current counters alone, what the new process counted
# (the traffic between the previous scrape and the restart is lost). A restart followed by more traffic than the old
# process had counted is not seen. Window acceptance = accepted / draft tokens; acceptance at position i =
# accepted_per_pos[i] / drafts (vLLM's per-position acceptance rate: per draft, not given the position was reached).
# Where windows are kept and tested: monitor.fleet.window_store and monitor.fleet.verdicts.
#

from __future__ import annotations

import http.client
import math
from dataclasses import asdict, dataclass

from prometheus_client.parser import text_string_to_metric_families

from pipeline.deadline_http import DeadlinePassed, exchange
from pipeline.url_credentials import redact

ENGINES = ("vllm", "llamacpp")
GAUGE_ENGINE = "sglang"
COUNTERS = {"drafts": "spec_decode_num_drafts_total", "draft_tokens": "spec_decode_num_draft_tokens_total",
            "accepted": "spec_decode_num_accepted_tokens_total"}
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos_total"
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

    @property
    def gauge(self) -> bool:
        """A window of SGLang's acceptance-rate gauge (monitor.fleet.sglang): `accepted` is the gauge's mean over
        the window and `draft_tokens` its weight (1 per window), not token counts."""
        return self.engine == GAUGE_ENGINE

    def position_acceptance(self) -> list[float]:
        """Share of drafts whose tokens 0..i were all accepted, for each position i."""
        return [v / self.drafts if self.drafts > 0 else math.nan for v in self.accepted_per_pos]

    def to_dict(self) -> dict:
        return {**asdict(self), "accepted_per_pos": list(self.accepted_per_pos)}

    @classmethod
    def from_dict(cls, data: dict) -> SpecCounters:
        return cls(data["engine"], float(data["drafts"]), float(data["draft_tokens"]), float(data["accepted"]),
                   tuple(float(v) for v in data.get("accepted_per_pos", ())))

    def window_since(self, previous: object) -> tuple[SpecCounters | None, bool]:
        """`window_between` this reading and the replica's previous one (none, or another kind: no window)."""
        return window_between(previous if isinstance(previous, SpecCounters) else None, self)


def _seen(names: list[str]) -> str:
    """What a metrics text holds, for an error message: each engine prefix with a few of its families, else a few
    family names."""
    prefixes = list(dict.fromkeys(n.split(":", 1)[0] for n in names if ":" in n))
    if prefixes:
        return "; ".join(f"{p} metrics ({len(of)} families, e.g. {', '.join(of[:3])})"
                         for p in prefixes for of in [[n for n in names if n.startswith(p + ":")]])
    return f"{len(names)} metric families ({', '.join(names[:5]) or 'none'})"


def parse_spec_counters(text: str, model_name: str | None = None, kind: str = "auto") -> SpecCounters:
    """The speculative-decoding counters in a Prometheus text exposition, summed over label sets (of `model_name`
    only, when given); `kind` vllm or llamacpp reads only that engine's counters, auto whichever there are."""
    return sum_counters(parse_per_core(text, model_name, kind).values())


def parse_per_core(text: str, model_name: str | None = None, kind: str = "auto") -> dict[str, SpecCounters]:
    """As `parse_spec_counters`, one SpecCounters per value of vLLM's `engine` label (its engine cores; "" for label
    sets without one, as llama.cpp's)."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ServerMetricsError(f"not a Prometheus text exposition: {exc}") from None
    engines = ENGINES if kind == "auto" else (kind,)
    wanted = {f"{engine}:{name}": (engine, key) for engine in engines
              for key, name in (*COUNTERS.items(), ("per_pos", PER_POSITION))}
    totals: dict[str, dict[str, dict[str, float]]] = {}  # engine -> core -> key -> value
    per_pos: dict[str, dict[str, dict[int, float]]] = {}  # engine -> core -> position -> value
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
        core = sample.labels.get("engine", "")
        if key == "per_pos":
            if sample.labels.get("position", "").isdigit():
                by_position = per_pos.setdefault(engine, {}).setdefault(core, {})
                position = int(sample.labels["position"])
                by_position[position] = by_position.get(position, 0.0) + sample.value
        else:
            by_key = totals.setdefault(engine, {}).setdefault(core, {})
            by_key[key] = by_key.get(key, 0.0) + sample.value
    complete = [e for e in engines if {k for core in totals.get(e, {}).values() for k in core} == set(COUNTERS)]
    if len(complete) > 1:
        raise ServerMetricsError(f"speculative-decoding counters of several engines ({', '.join(complete)}) in one "
                                 "exposition: list each server as an engine of its own (monitor.engines)")
    if not complete:
        raise ServerMetricsError(_missing(families, model_name, models, unlabeled, kind))
    engine = complete[0]
    out = {}
    for core, values in sorted(totals[engine].items()):
        positions = per_pos.get(engine, {}).get(core, {})
        out[core] = check_possible(SpecCounters(
            engine, values.get("drafts", 0.0), values.get("draft_tokens", 0.0), values.get("accepted", 0.0),
            tuple(positions.get(i, 0.0) for i in range(max(positions) + 1)) if positions else ()),
            "the engine's counters")
    return out


def _missing(families: list, model_name: str | None, models: set[str], unlabeled: bool, kind: str) -> str:
    """Why an exposition gave no speculative-decoding counters (what it holds instead)."""
    if models:
        return (f"no speculative-decoding counters with model_name={model_name!r}; model names seen: "
                f"{', '.join(sorted(models))}")
    if unlabeled:
        return (f"the speculative-decoding counters carry no model_name label to match {model_name!r} (llama.cpp): "
                "unset the engine's model (in router mode put ?model=NAME in its url)")
    prefixes = "vllm or llamacpp" if kind == "auto" else kind
    return (f"no speculative-decoding counters (<prefix>:{COUNTERS['drafts']}, ...:{COUNTERS['draft_tokens']}, "
            f"...:{COUNTERS['accepted']} with prefix {prefixes}): the endpoint exports "
            f"{_seen([f.name for f in families])}; is the server decoding with a draft (vLLM --speculative-config, "
            "llama-server --model-draft with --metrics)?")


def sum_counters(parts) -> SpecCounters:
    """The sum of several engines' (or cores') counters of one engine kind."""
    parts = list(parts)
    n_pos = max((len(p.accepted_per_pos) for p in parts), default=0)
    per_pos = [sum(p.accepted_per_pos[i] for p in parts if i < len(p.accepted_per_pos)) for i in range(n_pos)]
    return SpecCounters(parts[0].engine, sum(p.drafts for p in parts), sum(p.draft_tokens for p in parts),
                        sum(p.accepted for p in parts), tuple(per_pos))


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
    """The text a metrics endpoint answers, whole within `timeout` seconds (an overall deadline, connecting, headers
    and body: `pipeline.deadline_http`; an endpoint that trickles its answer is cut off, never waited on; a redirect
    is not followed); a ServerMetricsError that says why when it does not."""
    where = redact(url)
    try:
        answer = exchange(url, headers={"Accept": ACCEPT}, timeout=timeout, max_bytes=MAX_SCRAPE_BYTES)
    except DeadlinePassed:
        raise ServerMetricsError(f"{where}: no complete answer within {timeout:g} s (monitor.server_timeout)"
                                 ) from None
    except ValueError as exc:  # an answer over the bound
        raise ServerMetricsError(f"{where}: {exc}: not a metrics page") from None
    except (OSError, http.client.HTTPException) as exc:  # refused, reset, a malformed answer
        raise ServerMetricsError(f"{where}: server unreachable: {type(exc).__name__}: {exc}") from None
    if answer.status != 200:
        hint = " (llama-server serves /metrics only with --metrics)" if answer.status in (404, 501) else ""
        raise ServerMetricsError(f"{where}: {answer.said()}{hint}")
    try:
        return answer.body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ServerMetricsError(f"{where}: the answer is not UTF-8 text: {exc}") from None


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
