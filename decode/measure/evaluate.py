"""`draftops eval`: the draft's acceptance while decoding (alone, and inside the configured decoder) next to analytic α
over the text it produced."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from tqdm.auto import tqdm

from decode.acceptance import (
    alpha_by_target_confidence,
    analytic_acceptance,
    expected_tokens,
    expected_tokens_from_positions,
    token_mean,
)
from decode.chain_acceptance import ENGINE_CHAIN, chain_summary, greedy_chains
from decode.drafters.protocol import DECODER, DRAFT
from decode.factory import build_decoder
from decode.generation_stats import aggregate_stats
from pipeline import metrics as M
from pipeline.config import DecodeConfig
from pipeline.intervals import ratio_ci


def evaluate(target, draft, prompts: Sequence[list[int]], categories: Sequence[str], decode: DecodeConfig, *,
             gamma: int | None = None, seed: int = 0, chain_k: int = ENGINE_CHAIN) -> dict:
    """Decode every prompt speculatively, then score the same text analytically; prompt-level CIs throughout.

    target and draft are `pipeline.sources.ResolvedModel`s. The prompts are decoded with the draft model alone in
    chain rounds (its own acceptance α, what drift is about, and what the analytic α predicts) and, when the
    configured decoder also copies from the prompt or runs token trees, with that decoder too (the acceptance users
    see). `gamma` overrides the config's γ policy with a fixed γ. A progress bar per decoder goes to stderr when it
    is a terminal. Greedy (temperature 0), the report also has `chain`: the draft's acceptance by position in chains
    of `chain_k` drafts and their mean acceptance length over the decoded text (the target's own), as vLLM counts
    them (`decode.chain_acceptance`); None otherwise.
    """
    warp = dict(temperature=decode.temperature, top_k=decode.top_k, top_p=decode.top_p)
    decoders = eval_decoders(target, draft, decode, gamma)
    results = {
        kind: [
            d.generate(p, seed=seed + i)
            for i, p in enumerate(tqdm(prompts, desc=f"eval: decoding ({kind})", unit="prompt", disable=None))
        ]
        for kind, d in decoders.items()
    }
    summaries = {kind: aggregate_stats([r.stats for r in rs], categories, seed=seed) for kind, rs in results.items()}
    summaries.setdefault(DECODER, summaries[DRAFT])
    texts, starts = [p + r.token_ids for p, r in zip(prompts, results[DRAFT])], [len(p) for p in prompts]
    analytic = analytic_acceptance(target.model, draft.model, texts, starts, draft_token_ids=draft.token_ids, **warp)
    chain = None if decode.temperature else chain_summary(
        greedy_chains(target.model, draft.model, texts, starts, chain_k, draft_token_ids=draft.token_ids), seed=seed)
    alpha = ratio_ci(analytic.sums, analytic.counts, seed=seed)
    by_category = {
        name: ratio_ci(
            [s for s, c in zip(analytic.sums, categories) if c == name],
            [n for n, c in zip(analytic.counts, categories) if c == name],
            seed=seed,
        ).to_dict()
        for name in sorted(set(categories))
    }
    policy = decoders[DRAFT].gamma
    live_at = [a for a in summaries[DRAFT]["acceptance_at_position"] if a == a]  # drop nan
    return {
        "n_prompts": len(prompts),
        "settings": {**policy.to_dict(), "max_new_tokens": decode.max_new_tokens, "seed": seed, **warp},
        "drafters": {kind: d.drafter.name for kind, d in decoders.items()},
        "live": {DRAFT: summaries[DRAFT], DECODER: summaries[DECODER]},
        "analytic": {
            "alpha": alpha.to_dict(),
            "per_category": by_category,
            "alpha_by_token": mean_by_index(analytic.per_position),
            "by_target_confidence": alpha_by_target_confidence(analytic.per_position, analytic.target_confidence),
            "outside_draft_vocabulary": token_mean(analytic.outside_vocabulary),
        },
        "chain": chain,
        "predicted_tau": {
            "from_analytic_alpha": expected_tokens(alpha.value, policy.gamma) if alpha.value == alpha.value else None,
            "from_live_positions": expected_tokens_from_positions(live_at, policy.gamma) if live_at else None,
            "measured": summaries[DRAFT]["tau"]["value"],
        },
    }


def eval_decoders(target, draft, decode: DecodeConfig, gamma: int | None = None) -> dict:
    """eval's decoders by drafter kind: the draft model alone in chain rounds (its own α) and, when the configured
    decoder also copies from the text or runs token trees, that decoder."""
    decoders = {DRAFT: build_decoder(target, draft, decode.chain_rounds(), kind=DRAFT, gamma=gamma)}
    if decode.lookup_min_ngram is not None or decode.tree_rounds:
        decoders[DECODER] = build_decoder(target, draft, decode, kind=DECODER, gamma=gamma)
    return decoders


def mean_by_index(rows: Sequence[Sequence[float]], min_count: int = 3) -> list[float]:
    """Mean over sequences at each index, up to the last index that min_count sequences reach."""
    depth = max((len(r) for r in rows), default=0)
    out = []
    for t in range(depth):
        values = [r[t] for r in rows if len(r) > t]
        if len(values) < min_count:
            break
        out.append(float(np.mean(values)))
    return out


def per_position_figure(report: dict):
    """Left: live acceptance at each draft-block position vs analytic α. Right: analytic α along the response."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    live_at = report["live"][DRAFT]["acceptance_at_position"]
    left.bar(range(1, len(live_at) + 1), live_at, color="tab:blue", label="draft alone, given position reached")
    alpha = report["analytic"]["alpha"]
    left.axhspan(alpha["low"], alpha["high"], color="tab:orange", alpha=0.3, label="analytic α (95% CI)")
    left.set(xlabel="draft position in block", ylabel="acceptance", ylim=(0, 1.05))
    left.legend(loc="lower left", fontsize=8)
    by_token = report["analytic"]["alpha_by_token"]
    right.plot(range(len(by_token)), by_token, color="tab:orange")
    right.set(xlabel="response token", ylabel="analytic α (mean over prompts)", ylim=(0, 1.05))
    fig.tight_layout()
    return fig


def per_category_figure(report: dict):
    """Acceptance by traffic category: live α̂ and analytic α with their 95% intervals, prompts per category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(report["analytic"]["per_category"])
    live = [report["live"][DRAFT]["per_category"][n]["acceptance_rate"] for n in names]
    analytic = [report["analytic"]["per_category"][n] for n in names]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(names) + 2), 3.8))
    x = np.arange(len(names))
    bars = ((-0.2, live, "draft α̂ (decoding)", "tab:blue"), (0.2, analytic, "analytic α", "tab:orange"))
    for offset, rows, label, color in bars:
        values = np.array([r["value"] for r in rows])
        errors = np.array([[r["value"] - r["low"], r["high"] - r["value"]] for r in rows]).T
        ax.bar(x + offset, values, 0.4, yerr=np.clip(errors, 0, None), capsize=3, color=color, label=label)
    overall = report["analytic"]["alpha"]["value"]
    ax.axhline(overall, color="tab:orange", linestyle="--", linewidth=1, label=f"analytic α overall ({overall:.2f})")
    counts = [report["live"][DRAFT]["per_category"][n].get("n_prompts", "") for n in names]
    ax.set_xticks(x, [f"{n}\n({c})" if c != "" else n for n, c in zip(names, counts)])
    ax.set(ylabel="acceptance", ylim=(0, 1.05), title="acceptance by category (prompts)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def flat_metrics(report: dict) -> dict[str, float]:
    """MLflow metrics under `pipeline.metrics` names: overall and per-category acceptance, τ, by position, speed."""
    live, analytic, settings = report["live"][DRAFT], report["analytic"], report["settings"]
    alpha, tau = M.alpha_at(settings["temperature"]), M.tau_at(settings["gamma"])
    decoder = report["live"][DECODER]["acceptance_rate"]
    out = {
        M.ACCEPTANCE_DRAFT: live["acceptance_rate"]["value"],
        M.ACCEPTANCE_DRAFT_LOW: live["acceptance_rate"]["low"],
        M.ACCEPTANCE_DRAFT_HIGH: live["acceptance_rate"]["high"],
        M.ACCEPTANCE_DECODER: decoder["value"],
        M.ACCEPTANCE_DECODER_LOW: decoder["low"],
        M.ACCEPTANCE_DECODER_HIGH: decoder["high"],
        alpha: analytic["alpha"]["value"],
        f"{alpha}_ci_low": analytic["alpha"]["low"],
        f"{alpha}_ci_high": analytic["alpha"]["high"],
        M.DRAFT_EFFICIENCY: live["draft_efficiency"]["value"],
        tau: live["tau"]["value"],
        M.TOKENS_PER_S: live["tokens_per_s"]["value"],
        M.NEW_TOKENS: live["new_tokens"],
    }
    for name, summary in live.get("per_category", {}).items():
        out[M.per_category(M.ACCEPTANCE_DRAFT, name)] = summary["acceptance_rate"]["value"]
        out[M.per_category(tau, name)] = summary["tau"]["value"]
        out[M.per_category(alpha, name)] = analytic["per_category"][name]["value"]
    for band in analytic["by_target_confidence"]:
        out[M.by_target_confidence(alpha, band["low"], band["high"])] = band["alpha"]
    out[M.outside_draft_vocabulary(alpha)] = analytic["outside_draft_vocabulary"]
    for i, value in enumerate(live["acceptance_at_position"]):
        out[M.position(i + 1)] = value
    if report.get("chain"):
        out.update(M.chain_metrics(report["chain"]))
    return M.finite(out)
