"""`draftops eval`: live acceptance from speculative decoding next to analytic α over the text it produced."""

from __future__ import annotations

import re
from collections.abc import Sequence

import numpy as np

from decode.acceptance import analytic_acceptance, expected_tokens, expected_tokens_from_positions
from decode.speculative import AdaptiveGamma, SpeculativeDecoder
from decode.stats import aggregate_stats, ratio_ci
from pipeline.sources import eos_token_ids


def evaluate(
    target,
    draft,
    prompts: Sequence[list[int]],
    categories: Sequence[str],
    *,
    gamma: int,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    adaptive: bool = False,
    gamma_schedule: Sequence[tuple[int, int]] | None = None,
    seed: int = 0,
) -> dict:
    """Decode every prompt speculatively, then score the same text analytically; prompt-level CIs throughout.

    target and draft are `pipeline.sources.ResolvedModel`s (anything with .model, .tokenizer, .token_ids).
    """
    decoder = SpeculativeDecoder(
        target.model, draft.model, gamma, draft_token_ids=draft.token_ids,
        adaptive=AdaptiveGamma() if adaptive else None, gamma_schedule=gamma_schedule,
        eos_token_ids=eos_token_ids(target.model, target.tokenizer),
    )
    warp = dict(temperature=temperature, top_k=top_k, top_p=top_p)
    results = [
        decoder.generate(p, max_new_tokens=max_new_tokens, seed=seed + i, **warp) for i, p in enumerate(prompts)
    ]
    stats = [r.stats for r in results]
    analytic = analytic_acceptance(
        target.model, draft.model, [p + r.token_ids for p, r in zip(prompts, results)], [len(p) for p in prompts],
        draft_token_ids=draft.token_ids, **warp,
    )
    live = aggregate_stats(stats, categories, seed=seed)
    alpha = ratio_ci(analytic.sums, analytic.counts, seed=seed)
    by_category = {
        name: ratio_ci(
            [s for s, c in zip(analytic.sums, categories) if c == name],
            [n for n, c in zip(analytic.counts, categories) if c == name],
            seed=seed,
        ).to_dict()
        for name in sorted(set(categories))
    }
    live_at = [a for a in live["acceptance_at_position"] if a == a]  # drop nan
    return {
        "n_prompts": len(prompts),
        "settings": {"gamma": gamma, "max_new_tokens": max_new_tokens, "adaptive": adaptive, "seed": seed, **warp,
                     **({"gamma_schedule": [list(e) for e in gamma_schedule]} if gamma_schedule else {})},
        "live": live,
        "analytic": {
            "alpha": alpha.to_dict(),
            "per_category": by_category,
            "alpha_by_token": mean_by_index(analytic.per_position),
        },
        "predicted_tau": {
            "from_analytic_alpha": expected_tokens(alpha.value, gamma) if alpha.value == alpha.value else None,
            "from_live_positions": expected_tokens_from_positions(live_at, gamma) if live_at else None,
            "measured": live["tau"]["value"],
        },
    }


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
    live_at = report["live"]["acceptance_at_position"]
    left.bar(range(1, len(live_at) + 1), live_at, color="tab:blue", label="live, given position reached")
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
    live = [report["live"]["per_category"][n]["acceptance_rate"] for n in names]
    analytic = [report["analytic"]["per_category"][n] for n in names]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(names) + 2), 3.8))
    x = np.arange(len(names))
    bars = ((-0.2, live, "live α̂", "tab:blue"), (0.2, analytic, "analytic α", "tab:orange"))
    for offset, rows, label, color in bars:
        values = np.array([r["value"] for r in rows])
        errors = np.array([[r["value"] - r["low"], r["high"] - r["value"]] for r in rows]).T
        ax.bar(x + offset, values, 0.4, yerr=np.clip(errors, 0, None), capsize=3, color=color, label=label)
    overall = report["analytic"]["alpha"]["value"]
    ax.axhline(overall, color="tab:orange", linestyle="--", linewidth=1, label=f"analytic α overall ({overall:.2f})")
    counts = [report["live"]["per_category"][n].get("n_prompts", "") for n in names]
    ax.set_xticks(x, [f"{n}\n({c})" if c != "" else n for n, c in zip(names, counts)])
    ax.set(ylabel="acceptance", ylim=(0, 1.05), title="acceptance by category (prompts)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def flat_metrics(report: dict) -> dict[str, float]:
    """MLflow metrics under `pipeline.metrics` names: overall and per-category acceptance, τ, by position, speed."""
    from pipeline import metrics as M

    live, analytic, settings = report["live"], report["analytic"], report["settings"]
    alpha, tau = M.alpha_at(settings["temperature"]), M.tau_at(settings["gamma"])
    out = {
        M.ALPHA_LIVE: live["acceptance_rate"]["value"],
        M.ALPHA_LIVE_LOW: live["acceptance_rate"]["low"],
        M.ALPHA_LIVE_HIGH: live["acceptance_rate"]["high"],
        alpha: analytic["alpha"]["value"],
        f"{alpha}_ci_low": analytic["alpha"]["low"],
        f"{alpha}_ci_high": analytic["alpha"]["high"],
        M.DRAFT_EFFICIENCY: live["draft_efficiency"]["value"],
        tau: live["tau"]["value"],
        M.TOKENS_PER_S: live["tokens_per_s"]["value"],
        M.NEW_TOKENS: live["new_tokens"],
    }
    for name, summary in live.get("per_category", {}).items():
        out[M.per_category(M.ALPHA_LIVE, name)] = summary["acceptance_rate"]["value"]
        out[M.per_category(tau, name)] = summary["tau"]["value"]
        out[M.per_category(alpha, name)] = analytic["per_category"][name]["value"]
    for i, value in enumerate(live["acceptance_at_position"]):
        out[M.position(i + 1)] = value
    return M.finite(out)
