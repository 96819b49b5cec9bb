"""The one MLflow helper: where runs go, what every run carries, and how draft versions are registered.

Every run gets: an experiment per stage (`draftops-distill`, `draftops-eval`, `draftops-monitor`, ...), the git sha,
the resolved config as an artifact, system metrics, and whatever lineage tags the caller knows (target fingerprint and
source, data fingerprint). Stages are deprecated in MLflow 3: versions are found by aliases (`champion`, `challenger`).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Iterator

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
    all_tags = {"draftops.stage": stage, "draftops.git_sha": git_sha(), "draftops.target_source": cfg.target}
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


def register_checkpoint(checkpoint_dir: str | Path, model_name: str, *, tags: dict[str, str],
                        description: str, artifact_path: str = "draft"):
    """Log a checkpoint directory to the active run and register it as a new version of `model_name`.

    The version's source is the run's artifact folder, so `models:/NAME@ALIAS` resolves to the plain HF checkpoint.
    The first version of a model becomes `champion`; later ones `challenger` until the monitor's gate promotes them.
    """
    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    run = mlflow.active_run()
    if run is None:
        raise RuntimeError("register_checkpoint needs an active MLflow run")
    mlflow.log_artifacts(str(checkpoint_dir), artifact_path)
    client = MlflowClient()
    try:
        client.get_registered_model(model_name)
    except MlflowException:
        client.create_registered_model(model_name, description="Speculative-decoding drafts managed by draftops.")
    version = client.create_model_version(
        model_name, source=f"{run.info.artifact_uri}/{artifact_path}", run_id=run.info.run_id,
        tags={k: str(v) for k, v in tags.items()}, description=description)
    has_champion = "champion" in client.get_registered_model(model_name).aliases
    alias = "challenger" if has_champion else "champion"
    client.set_registered_model_alias(model_name, alias, version.version)
    mlflow.set_tag("draftops.registered_version", f"{model_name}/{version.version}")
    return version, alias
