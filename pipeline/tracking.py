"""The one MLflow run helper: where runs go and what every run carries (draft versions: `pipeline.registry`).

Every run gets: an experiment per stage (`draftops-distill`, `draftops-eval`, `draftops-monitor`, ...), the git sha,
the resolved config as an artifact, system metrics, and whatever lineage tags the caller knows (target fingerprint and
source, data fingerprint; names in `pipeline.metrics`).
"""
from __future__ import annotations

import contextlib
import http.client
import logging
import os
import socket
import subprocess
import sys
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

from pipeline import metrics as M
from pipeline.config import DraftopsConfig, TrackingConfig
from pipeline.deadline_http import DeadlinePassed, exchange
from pipeline.url_credentials import redact

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def tracking_uri(cfg: DraftopsConfig | None = None) -> str:
    if cfg is not None and cfg.tracking.uri:
        return cfg.tracking.uri
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking store cannot be reached."""


# MLflow's HTTP client retries a failed request 7 times with a doubling, jittered backoff (minutes) and waits 120 s
# for each answer; draftops bounds both (`tracking.http_timeout`, `tracking.http_retries`) and retries at once (the
# timeout is the wait), unless the environment sets them.
_HTTP_KNOBS = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
               "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER")
_SET_BY_USER = frozenset(k for k in _HTTP_KNOBS if k in os.environ)
PROBE_TIMEOUT = 5.0
API_PROBE = "/api/2.0/mlflow/experiments/search?max_results=1"  # any answer at all shows the API is served


def bound_http_requests(cfg: DraftopsConfig | None = None) -> None:
    """Give every MLflow request to a tracking server a deadline: timeout and retries from the config (or its
    defaults), no backoff beyond the timeout, so that a call takes at most `http_timeout × (http_retries + 1)`
    seconds; a variable the environment sets itself is left as it is. Each retry's warning from urllib3 is silenced:
    a call that fails for good is one line (`store_error_line`)."""
    tracking = cfg.tracking if cfg is not None else TrackingConfig()
    values = {"MLFLOW_HTTP_REQUEST_TIMEOUT": tracking.http_timeout,
              "MLFLOW_HTTP_REQUEST_MAX_RETRIES": tracking.http_retries, "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": 0,
              "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": 0}
    for key, value in values.items():
        if key not in _SET_BY_USER:
            os.environ[key] = str(value)
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)


def http_timeout() -> float:
    """Seconds one MLflow request may take, as `bound_http_requests` set it (or the environment)."""
    try:
        return max(float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", "")), 0.1)
    except ValueError:
        return float(TrackingConfig().http_timeout)


def check_tracking(cfg: DraftopsConfig | None = None, timeout: float | None = None) -> str:
    """The tracking URI, once it answers: a tracking server must accept a TCP connection within a few seconds, answer
    its /health page, whole, within `timeout` seconds (default: one request's, `tracking.http_timeout`; MLflow's own
    client retries an unreachable server for minutes) and answer its API, whole, within one request's timeout (a
    server whose API hangs behind a live /health); a local sqlite store needs its folder. Raises `TrackingUnavailable`
    naming the URI, so that a job fails before its work, not at its end. MLflow's later requests get deadlines too
    (`bound_http_requests`)."""
    bound_http_requests(cfg)
    timeout = http_timeout() if timeout is None else timeout
    uri = tracking_uri(cfg)
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("http", "https"):
        try:
            port = parsed.port or (443 if parsed.scheme == "https" else 80)
            with socket.create_connection((parsed.hostname or "", port), timeout=min(PROBE_TIMEOUT, timeout)):
                pass
            exchange(f"{uri.rstrip('/')}/health", timeout=timeout, max_bytes=1 << 20)  # any status: it answered
        except (OSError, ValueError, http.client.HTTPException) as exc:
            reason = exc if not isinstance(exc, DeadlinePassed) else (
                f"no whole answer from /health within {timeout:g} s (tracking.http_timeout)")
            raise TrackingUnavailable(redact(
                f"the MLflow tracking server {uri} does not answer ({reason}); start it, or point tracking.uri / "
                "MLFLOW_TRACKING_URI at one that runs")) from None
        _check_api(uri)
    elif parsed.scheme == "sqlite" and parsed.path not in ("", "/:memory:"):
        folder = Path(parsed.path[1:]).parent  # sqlite:///rel.db and sqlite:////abs.db: one slash is the separator
        if not folder.is_dir():
            raise TrackingUnavailable(redact(f"the MLflow store {uri}: folder {folder} does not exist"))
    return uri


def _check_api(uri: str) -> None:
    """TrackingUnavailable unless the server's REST API answers (any status) within one request's timeout."""
    seconds = http_timeout()
    try:
        exchange(uri.rstrip("/") + API_PROBE, timeout=seconds, max_bytes=1 << 20)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        why = (f"within {seconds:g} s (tracking.http_timeout)" if isinstance(exc, DeadlinePassed)
               else f"({type(exc).__name__}: {exc})")
        raise TrackingUnavailable(redact(
            f"the MLflow tracking server {uri} answers /health but not its API {why}; restart it, or point "
            "tracking.uri / MLFLOW_TRACKING_URI at one that works")) from None


def setup_mlflow(cfg: DraftopsConfig | None = None) -> str:
    import mlflow

    bound_http_requests(cfg)
    uri = tracking_uri(cfg)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri


def store_error_line(exc: BaseException) -> str | None:
    """One line for a failure of the MLflow store (an MlflowException, or the requests error under it), naming the
    store MLflow is set to (a command that reads another store, such as `report` with `tracking.uri`, sets MLflow to
    it first: `setup_mlflow`); None for any other error. mlflow is not imported to find out."""
    mlflow_exceptions = sys.modules.get("mlflow.exceptions")
    if mlflow_exceptions is None or not isinstance(exc, mlflow_exceptions.MlflowException):
        return None
    import mlflow

    first = (str(getattr(exc, "message", exc)).strip().splitlines() or ["unknown error"])[0]
    return redact(f"the MLflow store {mlflow.get_tracking_uri()} failed: {first[:500]}")


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@contextlib.contextmanager
def start_run(cfg: DraftopsConfig, stage: str, *, run_name: str | None = None,
              tags: dict[str, str] | None = None) -> Iterator:
    """An MLflow run in experiment `draftops-<stage>`, tagged and carrying the resolved config."""
    import mlflow

    setup_mlflow(cfg)
    mlflow.set_experiment(f"draftops-{stage}")
    all_tags = {M.STAGE_TAG: stage, M.GIT_SHA_TAG: git_sha(), M.TARGET_SOURCE_TAG: cfg.target}
    all_tags.update({k: str(v) for k, v in (tags or {}).items()})
    with mlflow.start_run(run_name=run_name, tags=all_tags, log_system_metrics=cfg.tracking.system_metrics) as run:
        mlflow.log_dict(cfg.to_dict(), "config/resolved.yaml")
        yield run


def log_figure(fig, name: str) -> None:
    """Log a matplotlib figure as a run artifact (PNG) and close it."""
    import matplotlib.pyplot as plt
    import mlflow

    mlflow.log_figure(fig, name)
    plt.close(fig)

