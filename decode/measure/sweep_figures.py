"""The sweep's figures (matplotlib, written beside sweep.md and logged to MLflow): speedup against γ, heat maps of the
best speedup, break-even α against draft cost, measured against predicted, tree budgets, draft sizes, batch sizes and
the quantized target."""
from __future__ import annotations

import numpy as np

from decode.acceptance import break_even_alpha
from decode.measure.sweep_report import QUANTIZATION_LABELS

ISO_SPEEDUPS = (1.0, 1.25, 1.5)  # the curves of the draft-size figure: α a draft of cost c needs for these speedups


def figures(report: dict) -> dict:
    """Name -> matplotlib figure: speedup vs γ, heat maps, break-even α vs draft cost, measured vs predicted,
    predicted tokens/s vs tree node budget and acceptance against cost by draft size when a draft model was swept,
    speedup and costs by batch size, and the quantized target beside speculation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drafts = list(report["drafts"])
    colors = {d: f"C{i}" for i, d in enumerate(drafts)}
    out = {
        "speedup_vs_gamma.png": speedup_vs_gamma_figure(report, colors, plt),
        "speedup_heatmap.png": speedup_heatmap_figure(report, colors, plt),
        "break_even_alpha.png": break_even_figure(report, colors, plt),
        "measured_vs_predicted.png": measured_vs_predicted_figure(report, colors, plt),
    }
    if report["tree_budgets"]["rows"]:
        out["tree_budget.png"] = tree_budget_figure(report, plt)
    if report.get("draft_sizes"):
        out["draft_size.png"] = draft_size_figure(report, plt)
    if report.get("batch"):
        out["batch.png"] = batch_figure(report["batch"], colors, plt)
    if report.get("quantization"):
        out["quantization.png"] = quantization_figure(report["quantization"], plt)
    return out



def speedup_vs_gamma_figure(report: dict, colors: dict, plt):
    """Predicted speedup against γ at the smallest context and length, with the measured cells."""
    s, cells, drafts = report["settings"], report["cells"], list(report["drafts"])
    small, short = min(s["contexts"]), min(s["max_new_tokens"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in drafts:
        here = [c for c in cells if c["draft"] == d and c["context"] == small and c["max_new_tokens"] == short]
        ax.plot([c["gamma"] for c in here], [c["predicted_speedup"] for c in here], "-", color=colors[d],
                label=f"{d} (predicted)")
        meas = [m for m in report["measured"]
                if m["draft"] == d and m["context"] == small and m["max_new_tokens"] == short]
        if meas:
            ax.errorbar([m["gamma"] for m in meas], [m["speedup"]["value"] for m in meas],
                        yerr=[[m["speedup"]["value"] - m["speedup"]["low"] for m in meas],
                              [m["speedup"]["high"] - m["speedup"]["value"] for m in meas]],
                        fmt="o", color=colors[d], capsize=3)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set(xlabel="γ (draft tokens per target call)", ylabel="speedup vs target alone", xticks=s["gammas"],
           title=f"context {small}, {short} new tokens (dots: measured, 95% CI)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def speedup_heatmap_figure(report: dict, colors: dict, plt):
    """Per draft, the best predicted speedup (and its γ) of every context and generation length."""
    from matplotlib.colors import TwoSlopeNorm

    s, cells, drafts = report["settings"], report["cells"], list(report["drafts"])
    fig, axes = plt.subplots(1, len(drafts), figsize=(4.2 * len(drafts) + 1, 3.8), squeeze=False, layout="constrained")
    values = [c["predicted_speedup"] for c in cells]
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min(min(values), 0.99), vmax=max(max(values), 1.01))
    for ax, d in zip(axes[0], drafts):
        grid = np.zeros((len(s["contexts"]), len(s["max_new_tokens"])))
        for i in range(len(s["contexts"])):
            for j in range(len(s["max_new_tokens"])):
                best = report["best"][i * len(s["max_new_tokens"]) + j]["per_draft"][d]
                grid[i, j] = best["predicted_speedup"]
                ax.text(j, i, f"{grid[i, j]:.2f}x\nγ={best['gamma']}", ha="center", va="center", fontsize=7)
        image = ax.imshow(grid, cmap="RdBu", norm=norm, origin="lower", aspect="auto")
        ax.set(xticks=range(len(s["max_new_tokens"])), xticklabels=s["max_new_tokens"],
               yticks=range(len(s["contexts"])), yticklabels=s["contexts"], xlabel="new tokens",
               ylabel="context (prompt tokens)", title=d)
    fig.colorbar(image, ax=axes[0].tolist(), label="predicted speedup (best γ)")
    return fig


def break_even_figure(report: dict, colors: dict, plt):
    """The α each γ needs to break even against the draft's cost c, with each draft's own α."""
    s, cells, drafts = report["settings"], report["cells"], list(report["drafts"])
    small = min(s["contexts"])
    fig, ax = plt.subplots(figsize=(6, 4))
    costs = report["costs"]
    c_max = max(1.0, 1.2 * max(c["c"] for c in cells))
    grid_c = np.linspace(0, c_max, 60)
    for gamma in s["gammas"]:
        v = costs["target"]["v"][str(gamma + 1)][0]  # at the smallest context
        ax.plot(grid_c, [break_even_alpha(gamma, c, v) for c in grid_c], lw=1, label=f"γ={gamma}")
    for d in drafts:
        here = [c for c in cells if c["draft"] == d and c["context"] == small and c["max_new_tokens"] == max(
            s["max_new_tokens"])]
        best = max(here, key=lambda c: c["steady_speedup"])
        ax.plot(best["c"], best["alpha"], "*", ms=12, color=colors[d], label=f"{d}: α at γ={best['gamma']}")
    ax.set(xlabel="draft cost c (draft step / target step)", ylabel="α needed to break even", ylim=(0, 1.02),
           title=f"break-even acceptance (v measured at context {small})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def measured_vs_predicted_figure(report: dict, colors: dict, plt):
    """Measured against predicted speedup for every cell decoded for real."""
    drafts = list(report["drafts"])
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    for d in drafts:
        meas = [m for m in report["measured"] if m["draft"] == d]
        ax.errorbar([m["predicted_speedup"] for m in meas], [m["speedup"]["value"] for m in meas],
                    yerr=[[m["speedup"]["value"] - m["speedup"]["low"] for m in meas],
                          [m["speedup"]["high"] - m["speedup"]["value"] for m in meas]],
                    fmt="o", color=colors[d], capsize=3, label=d)
    everything = [m["predicted_speedup"] for m in report["measured"]] + [m["speedup"]["value"]
                                                                         for m in report["measured"]]
    low, high = 0.9 * min(everything), 1.1 * max(everything)
    ax.plot([low, high], [low, high], color="gray", lw=0.8, ls="--")
    ax.set(xlabel="predicted speedup", ylabel="measured speedup", xlim=(low, high), ylim=(low, high),
           title=f"mean |gap| {report['gap']['mean_abs']:.0%}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def tree_budget_figure(report: dict, plt):
    """Predicted tokens/s against the tree node budget, per context, beside the best chain."""
    s = report["settings"]
    trees, r = report["tree_budgets"], report["recommendation"]
    draft = r["tree_draft"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, context in enumerate(s["contexts"]):
        rows = [row for row in trees["rows"] if row["draft"] == draft and row["context"] == context]
        chain = next(c for c in trees["chains"] if c["draft"] == draft and c["context"] == context)
        ax.plot([row["budget"] for row in rows], [row["predicted_tokens_per_s"] for row in rows], "o-",
                color=f"C{i}", label=f"context {context}")
        ax.axhline(chain["predicted_tokens_per_s"], color=f"C{i}", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set(xticks=trees["budgets"], xticklabels=trees["budgets"], xlabel="tree node budget",
           ylabel="predicted tokens/s")
    ax.set_title(f"{draft}\nbest tree per budget (dashed: best chain, same model)", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def quantization_figure(quantization: dict, plt):
    """Speedup against the fp32 target alone of the int8 target and the speculative decoder, with the int8 target's
    greedy agreement and KL under its bar."""
    rows = quantization["methods"]
    names = list(rows)
    fig, ax = plt.subplots(figsize=(6, 4))
    values = [rows[n]["speedup"]["value"] for n in names]
    ax.bar(range(len(names)), values, color=["0.6", "C3", "C0", "C2"][: len(names)],
           yerr=[[v - rows[n]["speedup"]["low"] for n, v in zip(names, values)],
                 [rows[n]["speedup"]["high"] - v for n, v in zip(names, values)]], capsize=4)
    quality = quantization["int8_quality"]
    labels = [QUANTIZATION_LABELS[n] + (f"\nagrees {quality['agreement']['value']:.1%}, KL "
                                         f"{quality['kl']['value']:.3g}" if n == "int8_target_only" else
                                         "\nlossless" if n == "speculative" else "") for n in names]
    ax.set_xticks(range(len(names)), labels, fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set(ylabel="speedup vs fp32 target alone (95% CI)",
           title=f"quantized or drafted: {quantization['n_prompts']} prompts × {quantization['new_tokens']} tokens")
    fig.tight_layout()
    return fig


def alpha_needed(speedup: float, c: float, gammas, v: dict[int, float]) -> float:
    """The i.i.d. acceptance at which a draft of cost c reaches `speedup` at its best γ: τ(α) = s·(γc + v(γ+1)) is
    `decode.acceptance.break_even_alpha` with c and v scaled by s; v: γ -> verify cost of γ + 1 tokens."""
    return min(break_even_alpha(g, speedup * c, speedup * v[g]) for g in gammas)


def draft_size_figure(report: dict, plt):
    """Left: each draft LM's acceptance against its cost c, labelled by layers, over the α a draft of cost c needs
    to break even (and to reach 1.25× and 1.5×) at its best γ, at the size axis' context. Right: by draft size, the
    predicted speedup at that cell and where decoded for real the measured cell beside its own prediction."""
    sizes, costs, s = report["draft_sizes"], report["costs"], report["settings"]
    rows = sizes["rows"]
    mean_context = sizes["context"] + sizes["max_new_tokens"] / 2
    v = {g: float(np.interp(mean_context, costs["contexts"], costs["target"]["v"][str(g + 1)])) for g in s["gammas"]}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    grid_c = np.linspace(0, max(0.5, 1.3 * max(r["c"] for r in rows)), 50)
    for speedup, style in zip(ISO_SPEEDUPS, ("-", "--", ":")):
        left.plot(grid_c, [alpha_needed(speedup, c, s["gammas"], v) for c in grid_c], style, color="0.3", lw=1,
                  label="break-even" if speedup == 1 else f"{speedup:g}x")
    for i, r in enumerate(rows):
        a = r["alpha"]
        left.errorbar(r["c"], a["value"], yerr=[[a["value"] - a["low"]], [a["high"] - a["value"]]], fmt="o",
                      color=f"C{i}", capsize=3, label=f"{r['layers']} layers: {r['draft']}")
        left.annotate(f"{r['layers']}L", (r["c"], a["value"]), textcoords="offset points", xytext=(6, 4), fontsize=8)
    left.set(xlabel="draft cost c (draft step / target step)", ylabel="per-token acceptance α (T=0)", ylim=(0, 1.02),
             title=f"acceptance against cost, context {sizes['context']} + {sizes['max_new_tokens']} new tokens")
    left.legend(fontsize=6)
    x = np.arange(len(rows))
    right.bar(x - 0.2, [r["predicted_speedup"] for r in rows], 0.4, color="0.75",
              label=f"predicted, context {sizes['context']}, {sizes['max_new_tokens']} tokens (best γ)")
    decoded = [(i, r["measured"]) for i, r in enumerate(rows) if r["measured"]]
    if decoded:
        right.errorbar([i + 0.2 for i, _ in decoded], [m["speedup"]["value"] for _, m in decoded],
                       yerr=[[m["speedup"]["value"] - m["speedup"]["low"] for _, m in decoded],
                             [m["speedup"]["high"] - m["speedup"]["value"] for _, m in decoded]],
                       fmt="D", color="C3", capsize=3, label="measured (its cell, 95% CI)")
        right.plot([i + 0.2 for i, _ in decoded], [m["predicted_speedup"] for _, m in decoded], "_", ms=16,
                   color="k", label="that cell's prediction")
    right.axhline(1.0, color="gray", lw=0.8, ls="--")
    right.set_xticks(x, [f"{r['layers']} layers\nγ={r['gamma']}" for r in rows], fontsize=7)
    right.set(ylabel="speedup vs target alone", title=f"recommended: {sizes['recommended']['layers']} layers")
    right.legend(fontsize=6)
    fig.tight_layout()
    return fig


def batch_figure(batch: dict, colors: dict, plt):
    """Predicted speedup (best γ) by batch size per draft, beside the verify cost v_B(n) and the draft cost c_B."""
    costs, batches = batch["costs"], batch["costs"]["batches"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for d in dict.fromkeys(r["draft"] for r in batch["rows"]):
        rows = [r for r in batch["rows"] if r["draft"] == d]
        left.plot(batches, [r["predicted_speedup"] for r in rows], "o-", color=colors[d], label=d)
        for r in rows:
            left.annotate(f"γ={r['gamma']}", (r["batch"], r["predicted_speedup"]), fontsize=6,
                          textcoords="offset points", xytext=(0, 5), ha="center")
    for m in batch.get("measured", []):
        left.plot(m["batch"], m["measured_speedup"], "D", color=colors[m["draft"]], mfc="none", ms=8)
    left.axhline(1.0, color="gray", lw=0.8, ls="--")
    left.set(xlabel="batch size B (sequences decoded together; hollow: decoded for real)",
             ylabel="speedup vs target alone at B (line: predicted)",
             title=f"best γ per batch size, context {costs['context']}")
    widths = sorted(costs["target"]["v"], key=int)
    for n, shade in zip(dict.fromkeys((widths[0], widths[len(widths) // 2], widths[-1])), ("0.65", "0.4", "0")):
        right.plot(batches, costs["target"]["v"][n], "o-", color=shade, label=f"v_B({n}) target verify / step")
    for d, draft in costs["drafts"].items():
        right.plot(batches, draft["c"], "s--", color=colors[d], label=f"c_B {d}")
    right.axhline(1.0, color="gray", lw=0.8, ls=":")
    right.set(xlabel="batch size B", ylabel="cost / target step at B", title="costs by batch size")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set(xticks=batches, xticklabels=batches)
        ax.legend(fontsize=6)
    fig.tight_layout()
    return fig
