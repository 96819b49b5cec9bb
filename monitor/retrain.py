"""The one place the monitor calls distillation: re-distill a challenger for the current target and traffic."""

from __future__ import annotations

from distill.train import run_distill
from pipeline.config import DraftopsConfig


def distill_challenger(cfg: DraftopsConfig) -> str:
    """Run the configured distillation and register its draft; returns the new model version.

    distill registers a new version as `challenger` while a champion exists; the monitor's gate decides.
    """

    result = run_distill(cfg.model_copy(update={"distill": cfg.distill.model_copy(update={"register_model": True})}))
    if result.version is None:
        raise RuntimeError("distillation finished without registering a version")
    return str(result.version)
