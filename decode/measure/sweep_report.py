"""The sweep's report: figures and markdown from `run_sweep`'s report, and the decode config it recommends."""

from __future__ import annotations

from pathlib import Path

from decode.measure.markdown import interval, table
from pipeline.config import DecodeConfig, save_config

QUANTIZATION_LABELS = {"target_only": "fp32 target alone", "int8_target_only": "int8 target alone",
                       "speculative": "speculative (fp32 target)", "llama_cpp_target_only": "llama.cpp, target GGUF"}


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# draftops sweep",
        "",
        f"Greedy, device {s['device']}; acceptance from {s['analytic_prompts']} traffic prompts, real decoding on "
        f"{s['measure_prompts']} prompts per measured cell. Speedup = target-only request time / speculative "
        "request time (prefill included, EOS ignored).",
        "",
        "## Costs (ms) by context length",
        "",
        *costs_table(report),
        "",
        "c(γ) = one round of γ proposals / (γ target steps); v(n) = verify round of n tokens / target step.",
        "",
        "## Acceptance on the traffic (walk over target-greedy responses)",
        "",
        *acceptance_table(report),
        "",
        "## Best (draft, γ) per context and generation length (predicted)",
        "",
        *best_table(report),
        "",
        "## Measured vs predicted",
        "",
        *measured_table(report),
    ]
    g = report["gap"]
    lines += ["", f"Gap measured/predicted − 1: mean {g['mean']:+.1%}, mean |gap| {g['mean_abs']:.1%}, "
              f"max |gap| {g['max_abs']:.1%}.", ""]
    lines += tree_markdown(report)
    lines += size_markdown(report)
    lines += batch_markdown(report)
    lines += quantization_markdown(report)
    lines += recommendation_markdown(report["recommendation"])
    lines += [f"- note: {n}" for n in report.get("notes", [])]
    return "\n".join(lines) + "\n"


def costs_table(report: dict) -> list[str]:
    """The target's prefill, step and verify costs and each draft's prefill and c(γ), by context length."""
    s, costs, t = report["settings"], report["costs"], report["costs"]["target"]
    top = str(max(int(n) for n in t["v"]))
    g_low, g_high = str(min(s["gammas"])), str(max(s["gammas"]))
    header = ["context", "target prefill", "target step", "v(2)", f"v({top})",
              *(f"{d}: prefill, c(γ={g_low}), c(γ={g_high})" for d in report["drafts"])]
    rows = [[context, f"{t['prefill_s'][i] * 1e3:.1f}", f"{t['step_s'][i] * 1e3:.2f}", f"{t['v']['2'][i]:.2f}",
             f"{t['v'][top][i]:.2f}",
             *(f"{c['prefill_s'][i] * 1e3:.1f}, {c['c'][g_low][i]:.3f}, {c['c'][g_high][i]:.3f}"
               for c in costs["drafts"].values())]
            for i, context in enumerate(costs["contexts"])]
    return table(header, rows, "rrrrr" + "l" * len(report["drafts"]))


def acceptance_table(report: dict) -> list[str]:
    """α and τ of every draft and γ, by generation length."""
    lengths = report["settings"]["max_new_tokens"]
    rows = [[d, gamma, *(f"{rows[str(n)]['alpha']['value']:.3f} / {rows[str(n)]['tau']['value']:.2f}"
                         for n in lengths)]
            for d, per_draft in report["acceptance"].items() for gamma, rows in per_draft["per_gamma"].items()]
    return table(["draft", "γ", *(f"α / τ, {n} tok" for n in lengths)], rows, "lr" + "l" * len(lengths))


def best_table(report: dict) -> list[str]:
    """The best (draft, γ) of every cell, and each draft's best γ there."""
    header = ["context", "new tokens", "best draft", "γ", "speedup", "α", "break-even α",
              *(f"{d}: γ, speedup, break-even α" for d in report["drafts"])]
    rows = [[b["context"], b["max_new_tokens"], b["draft"], b["gamma"], f"{b['predicted_speedup']:.2f}x",
             f"{b['alpha']:.3f}", f"{b['break_even_alpha']:.3f}",
             *(f"{p['gamma']}, {p['predicted_speedup']:.2f}x, {p['break_even_alpha']:.3f}"
               for p in b["per_draft"].values())] for b in report["best"]]
    return table(header, rows, "rrlrrrr" + "l" * len(report["drafts"]))


def measured_table(report: dict) -> list[str]:
    """The cells decoded for real, beside their prediction."""
    rows = [[m["draft"], m["gamma"], m["context"], m["max_new_tokens"], interval(m["speedup"], 2, "x"),
             f"{m['predicted_speedup']:.2f}x", f"{m['gap']:+.0%}", f"{m['live_alpha']['value']:.3f}",
             f"{m['live_tau']['value']:.2f}", f"{m['same_output_as_target']}/{m['n_prompts']}"]
            for m in report["measured"]]
    return table(["draft", "γ", "context", "new tokens", "measured", "predicted", "gap", "live α̂", "live τ",
                  "same output"], rows, "lrrrlrrrrr")


def recommendation_markdown(r: dict) -> list[str]:
    """The recommended draft and γ schedule, and the token trees' node budgets where the sweep recommends them."""
    lines = [f"## Recommendation: --draft {r['draft']} with decode.gamma_schedule {r['gamma_schedule']}", ""]
    if "tree_budget_schedule" in r:
        shapes = ", ".join(f"budget {e['budget']} at context {e['context']}: {e['nodes']} nodes in {e['depth']} "
                           f"levels, widest {e['width']}" for e in r["tree_shapes"])
        lines += [f"Token trees: --draft {r['tree_draft']} with decode.tree_budget_schedule "
                  f"{r['tree_budget_schedule']} (best trees {shapes}; the decoder's tree reaches a shape with "
                  "decode.gamma ≥ its levels and decode.tree_branching ≥ its widest level).", ""]
    return lines


def tree_markdown(report: dict) -> list[str]:
    """The tree section: v_tree by context, rank acceptances, predicted tokens/s per node budget and context."""
    trees, costs, s = report["tree_budgets"], report["costs"], report["settings"]
    if not trees["rows"]:
        return []
    budgets = trees["budgets"]
    lines = ["## Token trees: node budget by context (predicted)", "",
             *table(["context", *(f"v_tree({b})" for b in budgets)],
                    [[context, *(f"{costs['target']['v_tree'][str(b)][i]:.2f}" for b in budgets)]
                     for i, context in enumerate(costs["contexts"])], "r" * (len(budgets) + 1))]
    lines += ["", "v_tree(B) = verify of the pending token and B tree nodes / target step. p_r: share of response "
              "positions where the target's token is the draft's r-th choice.", ""]
    for draft in dict.fromkeys(row["draft"] for row in trees["rows"]):
        p = report["acceptance"][draft]["rank_acceptance"]
        lines.append(f"- {draft}: p_1..p_{min(len(p), 6)} = " + ", ".join(f"{x:.3f}" for x in p[:6]))
    rows = []
    for chain in trees["chains"]:
        draft, context = chain["draft"], chain["context"]
        i = s["contexts"].index(context)
        rows.append([draft, context, f"{1 / costs['target']['step_s'][i]:.1f}",
                     f"{chain['gamma']}, {chain['predicted_tokens_per_s']:.1f}",
                     *(f"{row['predicted_tokens_per_s']:.1f} ({row['nodes']}: {row['depth']}×{row['width']})"
                       for row in trees["rows"] if row["draft"] == draft and row["context"] == context)])
    lines += ["", f"Predicted tokens/s of the best tree of B nodes, at most {trees['max_depth']} levels (in brackets: "
              "nodes that can be accepted, levels × widest level); the chain column is the best γ under the same "
              "acceptance model.", "",
              *table(["draft", "context", "target alone", "chain: γ, tok/s", *(f"B={b}" for b in budgets)], rows,
                     "lrrl" + "l" * len(budgets))]
    return lines + [""]


def size_markdown(report: dict) -> list[str]:
    """The draft-size section: every draft LM by layers, acceptance and cost, predicted and measured speedup."""
    sizes = report.get("draft_sizes")
    if not sizes:
        return []
    rows = []
    for r in sizes["rows"]:
        m = r["measured"]
        measured = ([f"{interval(m['speedup'], 2, 'x')} (γ={m['gamma']}, {m['context']}, {m['max_new_tokens']})",
                     f"{m['predicted_speedup']:.2f}x", f"{m['gap']:+.0%}",
                     f"{m['same_output_as_target']}/{m['n_prompts']}"] if m else ["-"] * 4)
        rows.append([r["draft"], r["layers"], f"{r['parameters'] / 1e6:.1f}M", interval(r["alpha"], 3), f"{r['c']:.3f}",
                     f"{r['v']:.2f}", r["gamma"], f"{r['break_even_alpha']:.3f}", f"{r['predicted_speedup']:.2f}x",
                     f"{r['mean_predicted_speedup']:.2f}x", *measured])
    header = ["draft", "layers", "parameters", "α (T=0)", "c", "v", "best γ", "break-even α", "predicted",
              "mean predicted (all cells)", "measured (γ, context, tokens)", "its prediction", "gap", "same output"]
    best = sizes["recommended"]
    return [f"## Draft size: acceptance against cost (context {sizes['context']}, {sizes['max_new_tokens']} new "
            "tokens)", "", *table(header, rows, "lrrlrrrrrrlrrr"),
            "", f"Recommended draft size on this machine: **{best['layers']} layers** ({best['draft']}): the "
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
    rows = [[b, f"{t['step_s'][i] * 1e3:.2f}", f"{t['step_s'][i] * 1e3 / b:.2f}",
             *(f"{t['v'][n][i]:.2f}" for n in widths), *(f"{d['c'][i]:.3f}" for d in costs["drafts"].values())]
            for i, b in enumerate(batches)]
    lines = [f"## Batch size: B sequences of {costs['context']} tokens decoded together (predicted)", "",
             *table(["B", "target step (ms)", "per sequence (ms)", *(f"v_B({n})" for n in widths),
                     *(f"c_B {d}" for d in costs["drafts"])], rows, "r" * (3 + len(widths) + len(costs["drafts"])))]
    rows = []
    for d in dict.fromkeys(r["draft"] for r in batch["rows"]):
        stop = batch["stops_paying_at"][d]
        rows.append([d, *(f"{r['predicted_speedup']:.2f}x (γ={r['gamma']}, break-even α {r['break_even_alpha']:.2f})"
                          for r in batch["rows"] if r["draft"] == d),
                     f"B={stop}" if stop else f"pays at every B ≤ {max(batches)}"])
    lines += ["", "Predicted speedup against the target alone at the same B (best γ, steady state: acceptance from the "
              f"walk over {max(report['settings']['max_new_tokens'])} new tokens, prefills left out).", "",
              *table(["draft", *(f"B={b}" for b in batches), "stops paying at"], rows, "l" * (len(batches) + 1) + "r")]
    if batch.get("measured"):
        rows = [[m["draft"], m["batch"], m["gamma"], m["new_tokens"], f"{m['measured_speedup']:.2f}x",
                 f"{m['predicted_speedup']:.2f}x", f"{m['gap']:+.0%}", f"{m['acceptance']:.3f}",
                 f"{m['same_output_as_target']}/{m['batch']}"] for m in batch["measured"]]
        lines += ["", "Decoded for real (`decode.measure.batched`: B sequences of the traffic at this context, the "
                  "target alone and speculative, decoding after the prefill timed once each):", "",
                  *table(["draft", "B", "γ", "new tokens", "measured", "predicted", "gap", "acceptance", "same output"],
                         rows, "lrrrrrrrr")]
    skipped = costs["skipped"]
    lines += [""] + ([f"Not on the batch axis (the lean forward does not run them): {', '.join(skipped)}.", ""]
                     if skipped else [])
    return lines


def quantization_markdown(report: dict) -> list[str]:
    """The quantization section: the int8 target and the speculative decoder against the fp32 target alone."""
    q = report.get("quantization")
    if not q:
        return []
    rows = [[QUANTIZATION_LABELS[name], f"{row['tokens_per_s']:.1f}", interval(row["speedup"], 2, "x"),
             f"{row['same_output_as_target']}/{q['n_prompts']}", f"{row['mean_shared_prefix']:.0f}"]
            for name, row in q["methods"].items()]
    lines = [f"## Quantized or drafted: the int8 target beside {q['draft']} at γ={q['gamma']} (measured)", "",
             f"{q['n_prompts']} prompts, {q['new_tokens']} new tokens each, interleaved; greedy.", "",
             *table(["method", "tokens/s", "speedup vs fp32 target", "same output as fp32 target",
                     "mean shared prefix"], rows, "lrlrr")]
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
