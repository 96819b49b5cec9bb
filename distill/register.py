"""Export the best draft (draftops checkpoint + an HF `assistant_model` copy, or for a feature draft the speculators
format vLLM serves) and record it in MLflow."""
from __future__ import annotations

from pathlib import Path

import torch

from decode.drafters.suffix import SuffixIndex
from decode.models.feature_draft import FeatureDraft
from decode.models.layer_draft import full_vocab_copy
from decode.serving.speculators import save_speculators
from decode.tree_budget_prediction import save_rank_acceptance
from pipeline import metrics, registry
from pipeline.config import DraftopsConfig, save_config
from pipeline.files import swap_dir, temporary_sibling
from pipeline.sources import CONFIG_FILE, HF_ASSISTANT_DIR, SUFFIX_INDEX_FILE, checkpoint_info, locate, save_checkpoint
from pipeline.tracking import git_sha, log_figure, start_run


def export_draft(draft, tokenizer, out_dir: Path, *, token_ids: torch.Tensor | None, cfg: DraftopsConfig,
                 suffix_index: SuffixIndex | None = None,
                 rank_acceptance: tuple[list[float], int] | None = None) -> Path:
    """`pipeline.sources.save_checkpoint` layout; a reduced-vocabulary draft also gets `hf_assistant/`, a plain
    full-vocabulary copy that transformers can load and use as `assistant_model`, and `suffix_index` (the target's
    responses for suffix decoding, `decode.drafters.suffix`) goes to `SUFFIX_INDEX_FILE` and `rank_acceptance` (p_1..
    and the positions measured) to `TREE_ACCEPTANCE_FILE` (`decode.tree_budget_prediction`). Written beside `out_dir`
    and swapped into place (`pipeline.files`): a stopped export leaves the previous draft whole. A feature draft
    (`decode.models.feature_draft`) is written in the speculators Eagle3 format (`decode.serving.speculators`), with the
    config and the suffix index beside it; HF assisted generation cannot run it, so it gets no copy for that."""
    tmp = temporary_sibling(out_dir)
    if isinstance(draft, FeatureDraft):
        # the verifier as a serving engine can load it: the target's local HF folder (a named GGUF's dequantized copy)
        save_speculators(draft, tmp, verifier_name_or_path=str(locate(cfg.target).path),
                         speculative_tokens=cfg.decode.gamma)
        save_config(cfg, tmp / CONFIG_FILE)
    else:
        save_checkpoint(draft, tokenizer, tmp, token_ids=token_ids, config=cfg)
    if token_ids is not None and not isinstance(draft, FeatureDraft):
        full_vocab_copy(draft, token_ids).save_pretrained(tmp / HF_ASSISTANT_DIR)
        tokenizer.save_pretrained(tmp / HF_ASSISTANT_DIR)
    if suffix_index is not None:
        suffix_index.save(tmp / SUFFIX_INDEX_FILE)
    if rank_acceptance is not None:
        save_rank_acceptance(tmp, *rank_acceptance)
    return swap_dir(tmp, out_dir)


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


def describe_draft(cfg: DraftopsConfig, result, info: dict, *, target_fingerprint: str, target_source: str) -> str:
    """The model version's description: what the draft is, what it learned from, and how well it does."""
    d, m = cfg.distill, result.metrics
    init = {"target_layers": f"target layers {d.init_layers} (+ embeddings, final norm, head)",
            "checkpoint": f"checkpoint {d.init_checkpoint}",
            "config": f"random init from the target's config {d.init_config or ''}".rstrip()}[d.init]
    vocab = (f"reduced vocabulary of {info['draft_vocab_size']} of {info['vocab_size']} target tokens"
             if info["draft_vocab_size"] else f"full vocabulary of {info['vocab_size']} tokens")
    return "\n".join([
        f"Draft for `{target_source}` (target fingerprint `{target_fingerprint}`).",
        "",
        f"- **model**: {info['layers']} layers, hidden {info['hidden_size']}, {info['parameters'] / 1e6:.1f}M "
        f"parameters, {vocab}",
        f"- **init**: {init}",
        f"- **training**: {d.loss} distillation ({d.teacher} teacher), best step {m['best_step']}, "
        f"loss {m['loss']:.4f}",
        f"- **data**: {m['train_responses']} target responses ({m['train_tokens']} tokens) to the train split of "
        f"`{cfg.traffic.path}`, data fingerprint `{result.data_fingerprint}`",
        f"- **held-out acceptance**: α(T=0) {m['alpha_t0']:.3f}, α(T=1) {m['alpha_t1']:.3f}, "
        f"τ {m['tau']:.2f} at γ={cfg.decode.gamma}",
        "",
        f"Tags hold the figures under the names of `pipeline.metrics`; `{metrics.DISTILL_RUN_TAG}` links the run that "
        f"made this version, `{metrics.LATEST_EVAL_RUN_TAG}` the latest `draftops eval` of it.",
    ])


def version_figures(cfg: DraftopsConfig, result, info: dict) -> dict[str, float]:
    """The figures a version carries both as registration-run metrics and as version tags."""
    m = result.metrics
    chain = metrics.chain_metrics(m["chain"]) if "chain" in m else {}
    return metrics.finite({
        metrics.ALPHA_T0: m["alpha_t0"], metrics.ALPHA_T1: m["alpha_t1"],
        metrics.tau_at(cfg.decode.gamma): m["tau"],
        metrics.TRAIN_FINAL_LOSS: m["loss"],
        metrics.DRAFT_PARAMS: info["parameters"], metrics.DRAFT_LAYERS: info["layers"],
        metrics.DRAFT_VOCAB_SIZE: info["draft_vocab_size"] or info["vocab_size"],
        **chain,
    })


def log_and_register(cfg: DraftopsConfig, result, *, target_fingerprint: str, target_source: str,
                     alias: str | None = None) -> tuple:
    """One MLflow run in `draftops-distill` with params, curves, plots and lineage; then a registered version (with
    `alias` instead of champion/challenger when given: `pipeline.registry.register`)."""
    import mlflow
    from mlflow import MlflowClient

    m = result.metrics
    info = checkpoint_info(locate(str(result.export_dir)))
    figures = version_figures(cfg, result, info)
    lineage = {metrics.TARGET_FINGERPRINT_TAG: target_fingerprint, metrics.TARGET_SOURCE_TAG: target_source,
               metrics.DATA_FINGERPRINT_TAG: result.data_fingerprint,
               **({metrics.TEACHER_TAG: result.teacher} if result.teacher else {})}
    with start_run(cfg, "distill", tags=lineage) as run:
        mlflow.log_params(flat_params(cfg))
        if result.mixed_precision:  # what `distill.mixed_precision` (auto) resolved to
            mlflow.log_param("distill.mixed_precision_used", result.mixed_precision)
        for h in result.history:
            mlflow.log_metrics({metrics.TRAIN_LOSS: h["loss"], metrics.TRAIN_LR: h["lr"],
                                metrics.TRAIN_GRAD_NORM: h["grad_norm"]}, step=h["step"])
        for e in result.evals:
            mlflow.log_metrics(metrics.finite({f"train/heldout_{k}": v for k, v in e.items() if k != "step"}),
                               step=e["step"])
        mlflow.log_metrics(figures)
        mlflow.log_metrics(metrics.finite({metrics.TRAIN_BEST_STEP: m["best_step"],
                                           metrics.TRAIN_RESPONSES: m["train_responses"],
                                           metrics.TRAIN_TOKENS: m["train_tokens"]}))
        mlflow.log_metrics({metrics.seconds(k): v for k, v in result.timings.items()})
        log_figure(curves_figure(result.history, result.evals, cfg.decode.gamma), "plots/distill_curves.png")
        mlflow.log_dict({"token_ids": None if result.token_ids is None else result.token_ids.tolist()},
                        "data/draft_vocab.json")
        tags = {**lineage, metrics.VERSION_SOURCE_TAG: "distill", metrics.GIT_SHA_TAG: git_sha(),
                metrics.DISTILL_RUN_TAG: run.info.run_id, metrics.GAMMA_TAG: str(cfg.decode.gamma),
                metrics.LOSS_KIND_TAG: cfg.distill.loss, **{k: metrics.tag_value(v) for k, v in figures.items()}}
        version, alias = registry.register(
            result.export_dir, cfg.tracking.registered_model, tags=tags, job=result.job_dir.name,
            description=describe_draft(cfg, result, info, target_fingerprint=target_fingerprint,
                                       target_source=target_source), alias=alias,
            lock_timeout=cfg.tracking.lock_timeout)
        client = MlflowClient()
        client.update_run(run.info.run_id, name=f"draft-v{version.version}-{cfg.distill.loss}")
        client.set_tag(run.info.run_id, "mlflow.note.content",
                       f"Registered as version {version.version} of {cfg.tracking.registered_model} ({alias}).")
        return run.info.run_id, str(version.version), alias
