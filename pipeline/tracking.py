"""The one MLflow run helper: where runs go and what every run carries (draft versions: `pipeline.registry`).

Every run gets: an experiment per stage (`draftops-distill`, `draftops-eval`, `draftops-monitor`, ...), the git sha,
the resolved config as an artifact, system metrics, and whatever lineage tags the caller knows (target fingerprint and
source, data fingerprint; names in `pipeline.metrics`).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from pipeline import metrics as M
from pipeline.config import DraftopsConfig

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def tracking_uri(cfg: DraftopsConfig | None = None) -> str:
    if cfg is not None and cfg.tracking.uri:
        return cfg.tracking.uri
    return os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


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

