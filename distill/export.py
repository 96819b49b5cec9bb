"""Export the best draft (draftops checkpoint + an HF `assistant_model` copy) and record it in MLflow."""
from __future__ import annotations

from pathlib import Path

import torch

from distill.init import full_vocab_copy
from pipeline.config import DraftopsConfig

HF_ASSISTANT_DIR = "hf_assistant"


def export_draft(draft, tokenizer, out_dir: Path, *, token_ids: torch.Tensor | None, cfg: DraftopsConfig) -> Path:
    """`pipeline.sources.save_checkpoint` layout; a reduced-vocabulary draft also gets `hf_assistant/`, a plain
    full-vocabulary copy that transformers can load and use as `assistant_model`."""
    import shutil

    from pipeline.sources import save_checkpoint

    shutil.rmtree(out_dir, ignore_errors=True)
    save_checkpoint(draft, tokenizer, out_dir, token_ids=token_ids, config=cfg)
    if token_ids is not None:
        full_vocab_copy(draft, token_ids).save_pretrained(out_dir / HF_ASSISTANT_DIR)
        tokenizer.save_pretrained(out_dir / HF_ASSISTANT_DIR)
    return out_dir


def curves_figure(history: list[dict], evals: list[dict], gamma: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_alpha, ax_tau) = plt.subplots(1, 3, figsize=(15, 4))
    ax_loss.plot([h["step"] for h in history], [h["loss"] for h in history])
    ax_loss.set(xlabel="step", ylabel="loss (per response token)", title="training loss")
    steps = [e["step"] for e in evals]
    ax_alpha.plot(steps, [e["alpha_t0"] for e in evals], marker="o", label="α, T=0 (greedy agreement)")
    ax_alpha.plot(steps, [e["alpha_t1"] for e in evals], marker="o", label="α, T=1 (top-k lower bound)")
    ax_alpha.set(xlabel="step", ylabel="α", title="held-out acceptance")
    ax_alpha.legend()
    ax_tau.plot(steps, [e["tau_t0"] for e in evals], marker="o", label="T=0")
    ax_tau.plot(steps, [e["tau_t1"] for e in evals], marker="o", label="T=1")
    ax_tau.set(xlabel="step", ylabel="tokens per target call", title=f"simulated τ (γ={gamma})")
    ax_tau.legend()
    fig.tight_layout()
    return fig


def flat_params(cfg: DraftopsConfig) -> dict[str, str]:
    params = {f"distill.{k}": v for k, v in cfg.distill.model_dump(mode="json").items()}
    params.update({"target": cfg.target, "seed": cfg.seed, "decode.gamma": cfg.decode.gamma,
                   "decode.temperature": cfg.decode.temperature})
    return {k: str(v)[:500] for k, v in params.items()}


def log_and_register(cfg: DraftopsConfig, result, *, target_fingerprint: str, target_source: str) -> tuple:
    """One MLflow run in `draftops-distill` with params, curves, plots and lineage; then a registered version."""
    import mlflow

    from pipeline.tracking import git_sha, log_figure, register_checkpoint, start_run

    m = result.metrics
    lineage = {"draftops.target_fingerprint": target_fingerprint, "draftops.target_source": target_source,
               "draftops.data_fingerprint": result.data_fingerprint}
    with start_run(cfg, "distill", tags=lineage) as run:
        mlflow.log_params(flat_params(cfg))
        for h in result.history:
            mlflow.log_metrics({"loss": h["loss"], "lr": h["lr"], "grad_norm": h["grad_norm"]}, step=h["step"])
        for e in result.evals:
            mlflow.log_metrics({f"heldout_{k}": v for k, v in e.items() if k != "step"}, step=e["step"])
        mlflow.log_metrics({f"final_{k}": v for k, v in m.items() if isinstance(v, (int, float))})
        mlflow.log_metrics({f"time_{k}_s": v for k, v in result.timings.items()})
        log_figure(curves_figure(result.history, result.evals, cfg.decode.gamma), "plots/distill_curves.png")
        mlflow.log_dict({"token_ids": None if result.token_ids is None else result.token_ids.tolist()},
                        "data/draft_vocab.json")
        tags = {**lineage, "draftops.source": "distill", "draftops.git_sha": git_sha(),
                "alpha_t0": f"{m['alpha_t0']:.4f}", "alpha_t1": f"{m['alpha_t1']:.4f}", "tau": f"{m['tau']:.4f}",
                "gamma": str(cfg.decode.gamma), "loss": f"{m['loss']:.5f}", "loss_kind": cfg.distill.loss}
        version, alias = register_checkpoint(
            result.export_dir, cfg.tracking.registered_model, tags=tags,
            description=f"{cfg.distill.loss} distillation of {target_source}: α(T=0) {m['alpha_t0']:.3f}, "
                        f"α(T=1) {m['alpha_t1']:.3f}, τ {m['tau']:.2f} at γ={cfg.decode.gamma}")
        return run.info.run_id, str(version.version), alias
