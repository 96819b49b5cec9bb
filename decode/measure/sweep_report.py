"""The sweep's report: figures and markdown from `run_sweep`'s report, and the decode config it recommends."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from decode.acceptance import break_even_alpha
from pipeline.config import DecodeConfig, save_config


def figures(report: dict) -> dict:
    """Name -> matplotlib figure: speedup vs γ, heat maps, break-even α vs draft cost, measured vs predicted,
    predicted tokens/s vs tree node budget and acceptance against cost by draft size when a draft model was swept,
    speedup and costs by batch size, and the quantized target beside speculation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    s, cells, drafts = report["settings"], report["cells"], list(report["drafts"])
    small, short = min(s["contexts"]), min(s["max_new_tokens"])
    colors = {d: f"C{i}" for i, d in enumerate(drafts)}
    out = {}

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
    out["speedup_vs_gamma.png"] = fig

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
    out["speedup_heatmap.png"] = fig

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
    out["break_even_alpha.png"] = fig

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
    out["measured_vs_predicted.png"] = fig

    trees, r = report["tree_budgets"], report["recommendation"]
    if trees["rows"]:
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
        out["tree_budget.png"] = fig
    if report.get("draft_sizes"):
        out["draft_size.png"] = draft_size_figure(report, plt)
    if report.get("batch"):
        out["batch.png"] = batch_figure(report["batch"], colors, plt)
    if report.get("quantization"):
        out["quantization.png"] = quantization_figure(report["quantization"], plt)
    return out


QUANTIZATION_LABELS = {"target_only": "fp32 target alone", "int8_target_only": "int8 target alone",
                       "speculative": "speculative (fp32 target)", "llama_cpp_target_only": "llama.cpp, target GGUF"}


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


ISO_SPEEDUPS = (1.0, 1.25, 1.5)  # the curves of the draft-size figure: α a draft of cost c needs for these speedups


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


def markdown(report: dict) -> str:
    s, costs = report["settings"], report["costs"]
    lines = [
        "# draftops sweep",
        "",
        f"Greedy, device {s['device']}; acceptance from {s['analytic_prompts']} traffic prompts, real decoding on "
        f"{s['measure_prompts']} prompts per measured cell. Speedup = target-only request time / speculative "
        "request time (prefill included, EOS ignored).",
        "",
        "## Costs (ms) by context length",
        "",
    ]
    top = str(max(int(n) for n in costs["target"]["v"]))
    g_low, g_high = str(min(s["gammas"])), str(max(s["gammas"]))
    lines += [
        f"| context | target prefill | target step | v(2) | v({top}) | "
        + " | ".join(f"{d}: prefill, c(γ={g_low}), c(γ={g_high})" for d in report["drafts"]) + " |",
        "|---:|---:|---:|---:|---:|" + "---|" * len(report["drafts"]),
    ]
    for i, context in enumerate(costs["contexts"]):
        t = costs["target"]
        lines.append(f"| {context} | {t['prefill_s'][i] * 1e3:.1f} | {t['step_s'][i] * 1e3:.2f} | "
                     f"{t['v']['2'][i]:.2f} | {t['v'][top][i]:.2f} | " + " | ".join(
                         f"{c['prefill_s'][i] * 1e3:.1f}, {c['c'][g_low][i]:.3f}, {c['c'][g_high][i]:.3f}"
                         for c in costs["drafts"].values()) + " |")
    lines += ["", "c(γ) = one round of γ proposals / (γ target steps); v(n) = verify round of n tokens / target step.",
              "", "## Acceptance on the traffic (walk over target-greedy responses)", "",
              "| draft | γ | " + " | ".join(f"α / τ, {n} tok" for n in s["max_new_tokens"]) + " |",
              "|---|---:|" + "---|" * len(s["max_new_tokens"])]
    for d, table in report["acceptance"].items():
        for gamma, rows in table["per_gamma"].items():
            lines.append(f"| {d} | {gamma} | " + " | ".join(
                f"{rows[str(n)]['alpha']['value']:.3f} / {rows[str(n)]['tau']['value']:.2f}"
                for n in s["max_new_tokens"]) + " |")
    lines += ["", "## Best (draft, γ) per context and generation length (predicted)", "",
              "| context | new tokens | best draft | γ | speedup | α | break-even α | "
              + " | ".join(f"{d}: γ, speedup, break-even α" for d in report["drafts"]) + " |",
              "|---:|---:|---|---:|---:|---:|---:|" + "---|" * len(report["drafts"])]
    for b in report["best"]:
        lines.append(f"| {b['context']} | {b['max_new_tokens']} | {b['draft']} | {b['gamma']} | "
                     f"{b['predicted_speedup']:.2f}x | {b['alpha']:.3f} | {b['break_even_alpha']:.3f} | "
                     + " | ".join(f"{p['gamma']}, {p['predicted_speedup']:.2f}x, {p['break_even_alpha']:.3f}"
                                  for p in b["per_draft"].values()) + " |")
    lines += ["", "## Measured vs predicted", "",
              "| draft | γ | context | new tokens | measured | predicted | gap | live α̂ | live τ | same output |",
              "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for m in report["measured"]:
        sp = m["speedup"]
        lines.append(f"| {m['draft']} | {m['gamma']} | {m['context']} | {m['max_new_tokens']} | "
                     f"{sp['value']:.2f}x [{sp['low']:.2f}, {sp['high']:.2f}] | {m['predicted_speedup']:.2f}x | "
                     f"{m['gap']:+.0%} | {m['live_alpha']['value']:.3f} | {m['live_tau']['value']:.2f} | "
                     f"{m['same_output_as_target']}/{m['n_prompts']} |")
    g, r = report["gap"], report["recommendation"]
    lines += ["", f"Gap measured/predicted − 1: mean {g['mean']:+.1%}, mean |gap| {g['mean_abs']:.1%}, "
              f"max |gap| {g['max_abs']:.1%}.", ""]
    lines += tree_markdown(report)
    lines += size_markdown(report)
    lines += batch_markdown(report)
    lines += quantization_markdown(report)
    lines += [f"## Recommendation: --draft {r['draft']} with decode.gamma_schedule {r['gamma_schedule']}", ""]
    if "tree_budget_schedule" in r:
        shapes = ", ".join(f"budget {e['budget']} at context {e['context']}: {e['nodes']} nodes in {e['depth']} "
                           f"levels, widest {e['width']}" for e in r["tree_shapes"])
        lines += [f"Token trees: --draft {r['tree_draft']} with decode.tree_budget_schedule "
                  f"{r['tree_budget_schedule']} (best trees {shapes}; the decoder's tree reaches a shape with "
                  "decode.gamma ≥ its levels and decode.tree_branching ≥ its widest level).", ""]
    lines += [f"- note: {n}" for n in report.get("notes", [])]
    return "\n".join(lines) + "\n"


def tree_markdown(report: dict) -> list[str]:
    """The tree section: v_tree by context, rank acceptances, predicted tokens/s per node budget and context."""
    trees, costs, s = report["tree_budgets"], report["costs"], report["settings"]
    if not trees["rows"]:
        return []
    budgets = trees["budgets"]
    lines = ["## Token trees: node budget by context (predicted)", "",
             "| context | " + " | ".join(f"v_tree({b})" for b in budgets) + " |",
             "|---:|" + "---:|" * len(budgets)]
    for i, context in enumerate(costs["contexts"]):
        lines.append(f"| {context} | " + " | ".join(f"{costs['target']['v_tree'][str(b)][i]:.2f}" for b in budgets)
                     + " |")
    lines += ["", "v_tree(B) = verify of the pending token and B tree nodes / target step. p_r: share of response "
              "positions where the target's token is the draft's r-th choice.", ""]
    for draft in dict.fromkeys(row["draft"] for row in trees["rows"]):
        p = report["acceptance"][draft]["rank_acceptance"]
        lines.append(f"- {draft}: p_1..p_{min(len(p), 6)} = " + ", ".join(f"{x:.3f}" for x in p[:6]))
    lines += ["", f"Predicted tokens/s of the best tree of B nodes, at most {trees['max_depth']} levels (in brackets: "
              "nodes that can be accepted, levels × widest level); the chain column is the best γ under the same "
              "acceptance model.", "",
              "| draft | context | target alone | chain: γ, tok/s | " + " | ".join(f"B={b}" for b in budgets) + " |",
              "|---|---:|---:|---|" + "---|" * len(budgets)]
    for chain in trees["chains"]:
        draft, context = chain["draft"], chain["context"]
        i = s["contexts"].index(context)
        rows = [row for row in trees["rows"] if row["draft"] == draft and row["context"] == context]
        lines.append(f"| {draft} | {context} | {1 / costs['target']['step_s'][i]:.1f} | {chain['gamma']}, "
                     f"{chain['predicted_tokens_per_s']:.1f} | " + " | ".join(
                         f"{row['predicted_tokens_per_s']:.1f} ({row['nodes']}: {row['depth']}×{row['width']})"
                         for row in rows)
                     + " |")
    return lines + [""]


def size_markdown(report: dict) -> list[str]:
    """The draft-size section: every draft LM by layers, acceptance and cost, predicted and measured speedup."""
    sizes = report.get("draft_sizes")
    if not sizes:
        return []
    lines = [f"## Draft size: acceptance against cost (context {sizes['context']}, {sizes['max_new_tokens']} new "
             "tokens)", "",
             "| draft | layers | parameters | α (T=0) | c | v | best γ | break-even α | predicted | mean predicted "
             "(all cells) | measured (γ, context, tokens) | its prediction | gap | same output |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in sizes["rows"]:
        a, m = r["alpha"], r["measured"]
        measured = (f"{m['speedup']['value']:.2f}x [{m['speedup']['low']:.2f}, {m['speedup']['high']:.2f}] "
                    f"(γ={m['gamma']}, {m['context']}, {m['max_new_tokens']}) | {m['predicted_speedup']:.2f}x | "
                    f"{m['gap']:+.0%} | {m['same_output_as_target']}/{m['n_prompts']}") if m else "- | - | - | -"
        lines.append(f"| {r['draft']} | {r['layers']} | {r['parameters'] / 1e6:.1f}M | {a['value']:.3f} "
                     f"[{a['low']:.3f}, {a['high']:.3f}] | {r['c']:.3f} | {r['v']:.2f} | {r['gamma']} | "
                     f"{r['break_even_alpha']:.3f} | {r['predicted_speedup']:.2f}x | "
                     f"{r['mean_predicted_speedup']:.2f}x | {measured} |")
    best = sizes["recommended"]
    return lines + ["", f"Recommended draft size on this machine: **{best['layers']} layers** ({best['draft']}): the "
                    "best mean predicted speedup over every context and generation length, each at its best γ. A "
                    "fair comparison of sizes needs one training budget for all (`draftops distill --sizes`).", ""]


def batch_markdown(report: dict) -> list[str]:
    """The batch section: target step, verify and draft costs by batch size, and the predicted speedup per draft."""
    batch = report.get("batch")
    if not batch:
        return []
    costs, batches = batch["costs"], batch["costs"]["batches"]
    t = costs["target"]
    widths = sorted(t["v"], key=int)
    lines = [f"## Batch size: B sequences of {costs['context']} tokens decoded together (predicted)", "",
             "| B | target step (ms) | per sequence (ms) | " + " | ".join(f"v_B({n})" for n in widths) + " | "
             + " | ".join(f"c_B {d}" for d in costs["drafts"]) + " |",
             "|---:|---:|---:|" + "---:|" * (len(widths) + len(costs["drafts"]))]
    for i, b in enumerate(batches):
        lines.append(f"| {b} | {t['step_s'][i] * 1e3:.2f} | {t['step_s'][i] * 1e3 / b:.2f} | "
                     + " | ".join(f"{t['v'][n][i]:.2f}" for n in widths) + " | "
                     + " | ".join(f"{d['c'][i]:.3f}" for d in costs["drafts"].values()) + " |")
    drafts = list(dict.fromkeys(r["draft"] for r in batch["rows"]))
    lines += ["", "Predicted speedup against the target alone at the same B (best γ, steady state: acceptance from the "
              f"walk over {max(report['settings']['max_new_tokens'])} new tokens, prefills left out).", "",
              "| draft | " + " | ".join(f"B={b}" for b in batches) + " | stops paying at |",
              "|---|" + "---|" * len(batches) + "---:|"]
    for d in drafts:
        rows = [r for r in batch["rows"] if r["draft"] == d]
        stop = batch["stops_paying_at"][d]
        lines.append(f"| {d} | " + " | ".join(f"{r['predicted_speedup']:.2f}x (γ={r['gamma']}, break-even α "
                                              f"{r['break_even_alpha']:.2f})" for r in rows)
                     + f" | {'B=' + str(stop) if stop else f'pays at every B ≤ {max(batches)}'} |")
    if batch.get("measured"):
        lines += ["", "Decoded for real (`decode.measure.batched`: B sequences of the traffic at this context, the "
                  "target alone and speculative, decoding after the prefill timed once each):", "",
                  "| draft | B | γ | new tokens | measured | predicted | gap | acceptance | same output |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for m in batch["measured"]:
            lines.append(f"| {m['draft']} | {m['batch']} | {m['gamma']} | {m['new_tokens']} | "
                         f"{m['measured_speedup']:.2f}x | {m['predicted_speedup']:.2f}x | {m['gap']:+.0%} | "
                         f"{m['acceptance']:.3f} | {m['same_output_as_target']}/{m['batch']} |")
    skipped = costs["skipped"]
    lines += [""] + ([f"Not on the batch axis (the lean forward does not run them): {', '.join(skipped)}.", ""]
                     if skipped else [])
    return lines


def quantization_markdown(report: dict) -> list[str]:
    """The quantization section: the int8 target and the speculative decoder against the fp32 target alone."""
    q = report.get("quantization")
    if not q:
        return []
    lines = [f"## Quantized or drafted: the int8 target beside {q['draft']} at γ={q['gamma']} (measured)", "",
             f"{q['n_prompts']} prompts, {q['new_tokens']} new tokens each, interleaved; greedy.", "",
             "| method | tokens/s | speedup vs fp32 target | same output as fp32 target | mean shared prefix |",
             "|---|---:|---|---:|---:|"]
    for name, row in q["methods"].items():
        sp = row["speedup"]
        lines.append(f"| {QUANTIZATION_LABELS[name]} | {row['tokens_per_s']:.1f} | {sp['value']:.2f}x "
                     f"[{sp['low']:.2f}, {sp['high']:.2f}] | {row['same_output_as_target']}/{q['n_prompts']} | "
                     f"{row['mean_shared_prefix']:.0f} |")
    quality = q["int8_quality"]
    kl, agreement = quality["kl"], quality["agreement"]
    lines += ["", f"int8 quality on {quality['positions']} held-out response positions (the fp32 target's greedy "
              f"responses, teacher-forced): next-token KL(fp32 ‖ int8) {kl['value']:.3g} nats [{kl['low']:.3g}, "
              f"{kl['high']:.3g}], greedy agreement {agreement['value']:.1%} [{agreement['low']:.1%}, "
              f"{agreement['high']:.1%}]. Speculative decoding is lossless: its output is the fp32 target's."]
    if "llama_cpp_target_only" in q["methods"]:
        lines.append("llama.cpp decodes the target's GGUF with its own quantized kernels: its distance from the fp32 "
                     "target shows in the shared outputs and prefixes above (its logits are not read).")
    return lines + [""]


def write_decode_config(cfg, recommendation: dict, path: Path, target: str) -> Path:
    """The config with the swept target, the recommended γ schedule (decode.gamma_policy schedule; decode.gamma: its
    first γ) and, where the sweep recommends one, the token trees' node budget schedule (decode.tree_budget_schedule,
    with decode.tree_branching wide enough for the recommended trees' widest level), for `draftops
    decode/eval/bench`: the default decoder's settings, measured on this machine."""
    schedule = recommendation["gamma_schedule"]
    tuned = cfg.model_copy(deep=True)
    tuned.target = target
    decode = {**cfg.decode.model_dump(), "gamma": schedule[0][1], "gamma_policy": "schedule",
              "gamma_schedule": [tuple(entry) for entry in schedule]}
    trees = "tree_budget_schedule" in recommendation
    if trees:
        widest = max(shape["width"] for shape in recommendation["tree_shapes"])
        decode.update(tree_budget=0, tree_budget_schedule=[tuple(e) for e in recommendation["tree_budget_schedule"]],
                      tree_branching=max(cfg.decode.tree_branching, widest))
    tuned.decode = DecodeConfig.model_validate(decode)
    save_config(tuned, path)
    header = f"# Written by `draftops sweep`: use with --draft {recommendation['draft']}"
    if trees:
        header += f" (tree budgets measured with {recommendation['tree_draft']})"
    path.write_text(header + "\n" + path.read_text())
    return path
