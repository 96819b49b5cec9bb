"""The one place the monitor calls distillation: re-distill a challenger for the current target and traffic."""

from __future__ import annotations

from distill.data.recorded import served_by_target
from distill.train import run_distill
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import DraftopsConfig
from pipeline.sources import fingerprint_dir, locate


def challenger_config(cfg: DraftopsConfig) -> DraftopsConfig:
    """The distillation a challenger runs: registered, and warm from the champion unless monitor.retrain_init says
    otherwise. Recorded replies are trained on only while the target is still the model that served them; after a
    target update the target generates its own again."""
    update: dict = {"register_model": True}
    responses = cfg.distill.responses
    if responses.source == "recorded" and not served_by_target(
            cfg.traffic.served_by, cfg.target, fingerprint_dir(locate(cfg.target).path)):
        update["responses"] = responses.model_copy(update={"source": "generate"})
    if cfg.monitor.retrain_init == "champion":
        update.update(init="checkpoint", init_checkpoint=registry.alias_uri(cfg.tracking.registered_model, M.CHAMPION))
    return cfg.model_copy(update={"distill": cfg.distill.model_copy(update=update)})


def distill_challenger(cfg: DraftopsConfig) -> str:
    """Run the challenger's distillation and register its draft; returns the new model version.

    distill registers a new version as `challenger` while a champion exists; the monitor's gate decides.
    """
    result = run_distill(challenger_config(cfg))
    if result.version is None:
        raise RuntimeError("distillation finished without registering a version")
    return str(result.version)
