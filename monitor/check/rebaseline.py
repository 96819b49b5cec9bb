"""`draftops monitor rebaseline`: the operator's explicit word that the champion's server baseline starts afresh (a
fleet moved to other hardware, a Prometheus that now counts differently), never the monitor's own decision.

With Prometheus, the champion's windows from the next window boundary on make its new baseline; without, every
replica's windows of the champion are dropped from the window store and the next scrapes make it. Who asked and why
are recorded as a run of the draftops-monitor experiment (tags `draftops.monitor.rebaseline_by` and
`draftops.monitor.rebaseline_reason`), so a later drift alarm can be read against it.
"""
from __future__ import annotations

from datetime import datetime, timezone

from monitor.fleet import prometheus, window_store
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import DraftopsConfig
from pipeline.tracking import setup_mlflow, start_run

BY_TAG = "draftops.monitor.rebaseline_by"
REASON_TAG = "draftops.monitor.rebaseline_reason"


def rebaseline(cfg: DraftopsConfig, by: str, reason: str) -> str:
    """Start the champion's server baseline afresh and record who and why in MLflow; the line to print."""
    name = cfg.tracking.registered_model
    setup_mlflow(cfg)
    version = str(registry.champion(name).version)
    if cfg.monitor.prometheus_url:
        boundary = prometheus.rebaseline(cfg, version)
        when = datetime.fromtimestamp(boundary, timezone.utc).isoformat(timespec="seconds")
        what = f"its baseline is made of the Prometheus windows that end after {when}"
    else:
        dropped = window_store.rebaseline(cfg, version)
        what = (f"the windows of {len(dropped)} replica(s) dropped; the next scrapes make its baseline" if dropped
                else "no windows kept yet; the next scrapes make its baseline")
    with start_run(cfg, "monitor", run_name="rebaseline",
                   tags={BY_TAG: by, REASON_TAG: reason, M.MONITOR_CHAMPION_VERSION_TAG: version,
                         M.REGISTERED_MODEL_TAG: name}) as run:
        run_id = run.info.run_id
    return f"{name}@champion = version {version}: server baseline restarted by {by} ({reason}); {what} " \
           f"(MLflow run {run_id})"
