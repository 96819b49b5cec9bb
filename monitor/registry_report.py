"""What `draftops report` shows: every version of the registered draft side by side, and the monitor's last checks.

Reads MLflow only (the versions, their tags and linked runs through `pipeline.registry`; the `draftops-monitor`
experiment here), so it needs no model. The same history draws the monitor plot (acceptance over time).
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field
from datetime import datetime, timezone

from pipeline import metrics as M
from pipeline import registry
from pipeline.tracking import tracking_uri as default_tracking_uri

MONITOR_EXPERIMENT = "draftops-monitor"


@dataclass
class VersionRow:
    version: str
    aliases: list[str]
    created: datetime
    target_fingerprint: str
    alpha_t0: float | None
    alpha_t1: float | None
    tau: float | None
    gamma: str
    eval_alpha_live: float | None  # from the version's latest `draftops eval`
    speedup: float | None  # from the version's latest `draftops bench`
    params: float | None
    vocab_size: float | None
    distill_run: str | None
    eval_run: str | None


@dataclass
class CheckRow:
    time: datetime
    decision: str
    cause: str
    champion_version: str
    acceptance_now: float | None
    acceptance_baseline: float | None
    threshold: float | None
    break_even: float | None
    p_value: float | None
    traffic_js: float | None
    promoted: bool
    challenger_version: str
    run_id: str
    notes: list[str] = field(default_factory=list)


def _client(tracking_uri: str | None):
    from mlflow import MlflowClient

    uri = tracking_uri or default_tracking_uri()
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _time(ms: int | None) -> datetime:
    return datetime.fromtimestamp((ms or 0) / 1000, tz=timezone.utc)


def _float(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def version_rows(client, name: str) -> list[VersionRow]:
    """All versions of `name`, newest first, with their figures (tags first, the linked runs' metrics else)."""
    rows = []
    for v in registry.version_records(client, name):
        tags = v.tags
        gamma = tags.get(M.GAMMA_TAG, "")
        tau_name = M.tau_at(int(gamma)) if gamma.isdigit() else None

        def figure(metric: str | None, *sources: dict) -> float | None:
            if metric is None:
                return None
            if metric in tags:
                return _float(tags[metric])
            return next((s[metric] for s in sources if metric in s), None)

        distilled = v.distill_metrics
        rows.append(VersionRow(
            version=v.version, aliases=v.aliases, created=_time(v.created_ms),
            target_fingerprint=tags.get(M.TARGET_FINGERPRINT_TAG, ""),
            alpha_t0=figure(M.ALPHA_T0, distilled), alpha_t1=figure(M.ALPHA_T1, distilled),
            tau=figure(tau_name, distilled), gamma=gamma, eval_alpha_live=v.eval_metrics.get(M.ACCEPTANCE_DRAFT),
            speedup=v.bench_metrics.get(M.SPEEDUP), params=figure(M.DRAFT_PARAMS, distilled),
            vocab_size=figure(M.DRAFT_VOCAB_SIZE, distilled), distill_run=v.distill_run,
            eval_run=tags.get(M.LATEST_EVAL_RUN_TAG)))
    return sorted(rows, key=lambda r: int(r.version) if r.version.isdigit() else 0, reverse=True)


def monitor_checks(client, name: str | None = None, limit: int = 10) -> list[CheckRow]:
    """The monitor's last `limit` checks (and rollbacks) of registered model `name`, oldest first."""
    experiment = client.get_experiment_by_name(MONITOR_EXPERIMENT)
    if experiment is None:
        return []
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"],
                              max_results=limit)
    rows = []
    for run in runs:
        tags, m = run.data.tags, run.data.metrics
        if name and tags.get(M.REGISTERED_MODEL_TAG, name) != name:
            continue
        rows.append(CheckRow(
            time=_time(run.info.start_time), decision=tags.get(M.MONITOR_DECISION_TAG, "?"),
            cause=tags.get(M.MONITOR_CAUSE_TAG, ""),
            champion_version=tags.get(M.MONITOR_CHAMPION_VERSION_TAG, ""),
            acceptance_now=m.get(M.MONITOR_ACCEPTANCE_NOW), acceptance_baseline=m.get(M.MONITOR_ACCEPTANCE_BASELINE),
            threshold=m.get(M.MONITOR_ACCEPTANCE_THRESHOLD), break_even=m.get(M.MONITOR_BREAK_EVEN),
            p_value=m.get(M.MONITOR_P_VALUE), traffic_js=m.get(M.MONITOR_TRAFFIC_JS),
            promoted=m.get(M.MONITOR_PROMOTED, 0.0) > 0,
            challenger_version=tags.get(M.MONITOR_CHALLENGER_VERSION_TAG, ""), run_id=run.info.run_id))
    return rows[::-1]


def monitor_history_figure(checks: list[CheckRow]):
    """Acceptance at each check against its baseline, the drift threshold (baseline − margin) and break-even;
    DRIFT checks in red, DEPLOY_MISMATCH in purple, DEPLOY_FAILED in orange, and a vertical line where retraining
    promoted a new champion."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    measured = [c for c in checks if c.acceptance_now is not None]
    times = [c.time for c in measured]
    ax.plot(times, [c.acceptance_now for c in measured], color="tab:blue", linewidth=1, zorder=1)
    colors = {"OK": "tab:green", "DRIFT": "tab:red", "DEPLOY_MISMATCH": "tab:purple", "DEPLOY_FAILED": "tab:orange"}
    for decision, color in colors.items():
        picked = [c for c in measured if c.decision == decision]
        ax.scatter([c.time for c in picked], [c.acceptance_now for c in picked], color=color, zorder=2,
                   label=f"acceptance now ({decision})")
    with_baseline = [c for c in measured if c.acceptance_baseline is not None]
    if with_baseline:
        ax.step([c.time for c in with_baseline], [c.acceptance_baseline for c in with_baseline], where="post",
                color="tab:gray", label="baseline")
    with_threshold = [c for c in measured if c.threshold is not None]
    if with_threshold:
        ax.step([c.time for c in with_threshold], [c.threshold for c in with_threshold], where="post",
                color="tab:red", linestyle="--", label="drift threshold (baseline − margin)")
    break_even = next((c.break_even for c in reversed(checks) if c.break_even is not None), None)
    if break_even is not None:
        ax.axhline(break_even, color="black", linestyle=":", linewidth=1, label=f"break-even α ({break_even:.2f})")
    for c in checks:
        if c.promoted:
            ax.axvline(c.time, color="tab:purple", linewidth=1.5)
            ax.annotate(f"retrained: v{c.challenger_version} promoted", (c.time, 0.02), rotation=90, fontsize=8,
                        color="tab:purple", xytext=(3, 0), textcoords="offset points")
    ax.set(ylabel="acceptance", ylim=(0, 1.05), title="monitor: champion acceptance over time (UTC)")
    ax.legend(loc="lower left", fontsize=8)
    locator = mdates.AutoDateLocator()
    ax.xaxis.set_major_locator(locator)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------ rendering


def _fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _size(params: float | None) -> str:
    return "–" if params is None else f"{params / 1e6:.1f}M" if params >= 1e5 else f"{params / 1e3:.1f}k"


def version_table(rows: list[VersionRow]) -> tuple[list[str], list[list[str]]]:
    gammas = {r.gamma for r in rows if r.gamma}
    tau_head = f"τ (γ={gammas.pop()})" if len(gammas) == 1 else "τ (γ)"
    header = ["version", "aliases", "target fingerprint", "α T=0", "α T=1", tau_head, "eval α live",
              "speedup", "params", "head vocab", "created"]
    body = [[r.version, ", ".join(r.aliases) or "–", r.target_fingerprint[:12] or "–", _fmt(r.alpha_t0),
             _fmt(r.alpha_t1), _fmt(r.tau, 2) + (f" (γ={r.gamma})" if len(gammas) > 1 and r.gamma else ""),
             _fmt(r.eval_alpha_live), "–" if r.speedup is None else f"{r.speedup:.2f}x", _size(r.params),
             "–" if r.vocab_size is None else str(int(r.vocab_size)), r.created.strftime("%Y-%m-%d %H:%M")]
            for r in rows]
    return header, body


def check_table(rows: list[CheckRow]) -> tuple[list[str], list[list[str]]]:
    header = ["time (UTC)", "decision", "cause", "champion", "acceptance now", "baseline", "p-value", "traffic JS",
              "retrain"]
    body = []
    for c in rows:
        retrain = (f"v{c.challenger_version} {'promoted' if c.promoted else 'not promoted'}"
                   if c.challenger_version else "–")
        p_value = "–" if c.p_value is None else f"{c.p_value:.3g}"
        body.append([c.time.strftime("%Y-%m-%d %H:%M"), c.decision, c.cause or "–", c.champion_version or "–",
                     _fmt(c.acceptance_now), _fmt(c.acceptance_baseline), p_value, _fmt(c.traffic_js), retrain])
    return header, body


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    """A Markdown table padded to column width, so it also reads well in a terminal."""
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


def render_markdown(name: str, versions: list[VersionRow], checks: list[CheckRow], uri: str) -> str:
    parts = [f"# draftops report: {name}", "", f"MLflow store: `{uri}`", "", f"## Versions ({len(versions)})", ""]
    parts.append(markdown_table(*version_table(versions)) if versions else "No versions registered.")
    parts += ["", "α and τ: held-out acceptance measured when the version was distilled (T=0 greedy, T=1 sampling); "
              "eval α live: acceptance measured while decoding in its latest `draftops eval`; "
              "speedup: its latest `draftops bench` (vs the target alone).",
              "", f"## Monitor: last {len(checks)} checks", ""]
    parts.append(markdown_table(*check_table(checks)) if checks else "No monitor checks yet.")
    return "\n".join(parts) + "\n"


def _html_table(header: list[str], body: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in body)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


def _png_data_uri(fig) -> str:
    import base64
    import io

    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def render_html(name: str, versions: list[VersionRow], checks: list[CheckRow], uri: str) -> str:
    style = ("body{font-family:system-ui,sans-serif;margin:2em}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}th{background:#f3f3f3}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>draftops report: {html.escape(name)}</title>"
            f"<style>{style}</style></head><body><h1>draftops report: {html.escape(name)}</h1>"
            f"<p>MLflow store: <code>{html.escape(uri)}</code></p><h2>Versions ({len(versions)})</h2>"
            f"{_html_table(*version_table(versions)) if versions else '<p>No versions registered.</p>'}"
            f"<h2>Monitor: last {len(checks)} checks</h2>"
            f"{_html_table(*check_table(checks)) if checks else '<p>No monitor checks yet.</p>'}"
            + (f"<p><img alt='monitor history' src='{_png_data_uri(monitor_history_figure(checks))}'></p>"
               if checks else "") + "</body></html>\n")


def build_report(name: str, *, fmt: str = "md", tracking_uri: str | None = None, checks: int = 10) -> str:
    client = _client(tracking_uri)
    versions = version_rows(client, name)
    history = monitor_checks(client, name, checks)
    render = render_html if fmt == "html" else render_markdown
    return render(name, versions, history, client.tracking_uri)
