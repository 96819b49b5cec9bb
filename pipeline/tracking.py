"""The one MLflow run helper: where runs go and what every run carries (draft versions: `pipeline.registry`).

Every run gets: an experiment per stage (`draftops-distill`, `draftops-eval`, `draftops-monitor`, ...), the git sha,
the resolved config as an artifact, system metrics, and whatever lineage tags the caller knows (target fingerprint and
source, data fingerprint; names in `pipeline.metrics`).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from pipeline import metrics as M
from pipeline.config import DraftopsConfig

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def tracking_uri(cfg: DraftopsConfig | None = None) -> str:
    if cfg is not None and cfg.tracking.uri:
        return cfg.tracking.uri
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


class TrackingUnavailable(RuntimeError):
    """The MLflow tracking store cannot be reached."""


def check_tracking(cfg: DraftopsConfig | None = None, timeout: float = 10.0) -> str:
    """The tracking URI, once it answers: a tracking server must answer its /health page within `timeout` seconds
    (MLflow's own client retries an unreachable server for minutes); a local sqlite store needs its folder.
    Raises `TrackingUnavailable` naming the URI, so that a job fails before its work, not at its end."""
    uri = tracking_uri(cfg)
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout):
                pass
        except urllib.error.HTTPError:
            pass  # the server answered
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise TrackingUnavailable(
                f"the MLflow tracking server {uri} does not answer ({reason}); start it, or point tracking.uri / "
                "MLFLOW_TRACKING_URI at one that runs") from None
    elif parsed.scheme == "sqlite" and parsed.path not in ("", "/:memory:"):
        folder = Path(parsed.path[1:]).parent  # sqlite:///rel.db and sqlite:////abs.db: one slash is the separator
        if not folder.is_dir():
            raise TrackingUnavailable(f"the MLflow store {uri}: folder {folder} does not exist")
    return uri


def setup_mlflow(cfg: DraftopsConfig | None = None) -> str:
    import mlflow

    uri = tracking_uri(cfg)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri


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

