"""bench's report as markdown (bench.md) and as flat MLflow metrics."""

from __future__ import annotations

from decode.chain_acceptance import chain_text
from decode.measure.bench_llamacpp import LLAMA_CPP_SPECULATIVE, LLAMA_CPP_TARGET_ONLY
from decode.measure.bench_rows import TARGET_ONLY, TARGET_ONLY_TORCH
from decode.measure.markdown import interval, table
from pipeline import metrics as M


def markdown(report: dict) -> str:
    lines = [*_heading(report), *_methods_table(report), "", *_speculative_figures(report), *_draft_lines(report),
             *_llama_cpp_lines(report), *_decoders_table(report), *_categories_table(report)]
    lines += [f"- note: {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def _heading(report: dict) -> list[str]:
    s, baseline = report["settings"], report["baseline"]
    return [
        "# draftops bench",
        "",
        f"{report['n_prompts']} prompts, greedy, γ={s['gamma']}, max_new_tokens={s['max_new_tokens']}, "
        f"device {s['device']}. Intervals: 95% bootstrap over prompts.",
        "",
        f"Speedups are against {baseline}, the faster target-only row (the denominator): target_only is HF "
        + (f"generate on draftops' linear kernels (cpu_linear {s['cpu_linear']})" if s["device"] == "cpu"
           else f"generate on {s['device']}")
        + (", target_only_torch on torch's stock kernels." if TARGET_ONLY_TORCH in report["methods"] else "."),
        "",
    ]


def _methods_table(report: dict) -> list[str]:
    rows = [[name, r["new_tokens"], f"{r['seconds']:.2f}", interval(r["tokens_per_s"], 1),
             interval(r["speedup"], 2, "x") if r.get("speedup") else "1 (denominator)",
             f"{r['same_output_as_target']}/{report['n_prompts']}"] for name, r in report["methods"].items()]
    return table(["method", "new tokens", "seconds", "tokens/s", f"speedup vs {report['baseline']}",
                  "same output as target_only"], rows, "lrrllr")


def _speculative_figures(report: dict) -> list[str]:
    """The speculative decoder against plain and chain decoding, its acceptance, its costs and the bounds on them."""
    a, t, k, r = report["alpha"], report["tau"], report["costs"], report["in_run_costs"]
    speculative = report["methods"]["speculative"]
    time_s = report["speculative_time_s"]
    return [
        f"- speculative / plain (the same forward without a draft): "
        f"{speculative['tokens_per_s']['value'] / report['methods']['plain']['tokens_per_s']['value']:.2f}x",
        *([f"- speculative (trees) / chain (the same decoder in chain rounds, paired over prompts): "
           f"{interval(report['trees_vs_chain'], 2, 'x')}"] if report.get("trees_vs_chain") else []),
        *[f"- {name} (--compare) / {against.removeprefix('vs_')}, paired over prompts: {interval(r, 2, 'x')}"
          for name, ratios in report.get("compared", {}).items() for against, r in ratios.items()],
        f"- acceptance of this decoder ({report['drafters']['speculative']}) α̂ = {interval(a, 3)}; tokens per "
        f"target call τ = {interval(t, 2)}",
        f"- step costs: target {k['target_step_s'] * 1e3:.2f} ms, draft {k['draft_step_s'] * 1e3:.2f} ms, "
        f"verify of γ+1 tokens {k['verify_s'] * 1e3:.2f} ms -> c = {k['c']:.3f}, v = {k['v']:.3f}"
        + (" (this decoder's rounds call no draft model)" if not k["draft_step_s"] else ""),
        *([f"- tree verify of {k['tree_budget']} nodes (the first prompt's budget) {k['tree_verify_s'] * 1e3:.2f} ms "
           f"-> v_tree = {k['v_tree']:.3f}; overhead-free bound τ/(d·c+v_tree) = {report['overhead_free_bound']:.2f}x "
           f"with d = {r['drafts_per_round']:.2f} draft calls per round, the run's (costs isolated at the first "
           "prompt's context; Leviathan's prediction is a chain's, not given for trees)"] if "v_tree" in k else
          [f"- Leviathan's prediction (1−α^(γ+1))/((1−α)(γc+v)) = {report['predicted_speedup']:.2f}x; "
           f"overhead-free bound τ/(γc+v) = {report['overhead_free_bound']:.2f}x (costs isolated at the first "
           "prompt's context)"]),
        f"- in-run costs (each call at its real context): one target step {r['target_step_s'] * 1e3:.2f} ms, "
        f"c = {r['c']:.3f}, v = {r['v']:.3f}, {r['drafts_per_round']:.2f} drafts per round; overhead-free bound "
        f"{r['overhead_free_bound']:.2f}x, reached {speculative['speedup']['value'] / r['overhead_free_bound']:.2f} "
        f"of it (time in model calls {r['model_time_share']:.1%})",
        _break_even_line(report),
        f"- speculative time split: draft {time_s['draft_s']:.2f} s, verify {time_s['verify_s']:.2f} s, "
        f"prefill {time_s['prefill_s']:.2f} s, overhead {time_s['overhead_s']:.2f} s",
    ]


def _break_even_line(report: dict) -> str:
    even = report.get("break_even_costs") or {"row": "speculative", **report["in_run_costs"]}
    return (f"- break-even acceptance {report['break_even_alpha']:.2f} at the in-run costs of {even['row']} "
            f"(c = {even['c']:.3f}, v = {even['v']:.3f}): below it the draft makes decoding slower; the monitor "
            "holds the draft's acceptance against it")


def _draft_lines(report: dict) -> list[str]:
    """The draft model alone, and a challenger draft beside it."""
    lines = []
    if report["alpha_draft"] is not None:
        lines.append(f"- acceptance of the draft model alone α̂ = {interval(report['alpha_draft'], 3)}")
        lines.append("- its acceptance by draft position (given the earlier ones accepted): " + ", ".join(
            f"{a:.2f}" for a in report.get("alpha_draft_at_position") or []))
    if report.get("chain"):
        lines.append(f"- the draft model in chains of {chain_text(report['chain'])}, over target_only's text")
    if report.get("challenger"):
        ch = report["challenger"]
        costs = ch["costs"]
        lines.append(f"- challenger draft {ch['source']}: draft step {costs['draft_step_s'] * 1e3:.2f} ms, "
                     f"c = {costs['c']:.3f}"
                     + (f"; alone α̂ = {interval(ch['alpha_draft'], 3)}, by draft position "
                        + ", ".join(f"{a:.2f}" for a in ch["alpha_draft_at_position"]) if ch["alpha_draft"] else "")
                     + f"; its decoder over the draft's (paired over prompts): {interval(ch['vs_draft'], 2, 'x')}"
                     + (f"; in chains of {chain_text(ch['chain'])}" if ch.get("chain") else ""))
    return lines


def _llama_cpp_lines(report: dict) -> list[str]:
    if not report.get("llama_cpp"):
        return []
    ll = report["llama_cpp"]
    return [f"- llama.cpp: speculative / its target alone {interval(ll['speedup_vs_llama_cpp_target_only'], 2, 'x')}"
            f", acceptance {ll['acceptance']:.3f} ({ll['accepted']} of {ll['drafted']} drafted tokens), same output "
            f"as its target alone {ll['same_output_as_llama_cpp_target_only']}/{report['n_prompts']}"]


def _decoders_table(report: dict) -> list[str]:
    if len(report["decoders"]) <= 1:
        return []
    rows = [[name, report["drafters"][name], interval(d["acceptance_rate"], 3), interval(d["tau"], 2),
             ", ".join(f"{source} {n}" for source, n in sorted(d["accepted_by_source"].items())) or "–"]
            for name, d in report["decoders"].items()]
    return ["", *table(["decoder", "drafter", "α̂", "τ", "accepted tokens by tree source"], rows, "lllll")]


def _categories_table(report: dict) -> list[str]:
    if not report["per_category"]:
        return []
    rows = [[name, c["n_prompts"], interval(c["acceptance_rate"], 3), f"{c['tau']['value']:.2f}"]
            for name, c in report["per_category"].items()]
    return ["", *table(["category", "prompts", "α̂", "τ"], rows, "lrll")]


def flat_metrics(report: dict) -> dict[str, float]:
    """MLflow metrics under `pipeline.metrics` names: speedup vs the strongest target-only baseline, throughput (of
    both target-only rows), c and v, live α and τ."""

    methods, costs = report["methods"], report["costs"]
    speculative = methods["speculative"]
    out = {
        M.SPEEDUP: speculative["speedup"]["value"],
        M.SPEEDUP_LOW: speculative["speedup"]["low"],
        M.SPEEDUP_HIGH: speculative["speedup"]["high"],
        M.TOKENS_PER_S: speculative["tokens_per_s"]["value"],
        M.TARGET_TOKENS_PER_S: methods[TARGET_ONLY]["tokens_per_s"]["value"],
        M.COST_RATIO_C: costs["c"],
        M.VERIFY_RATIO_V: costs["v"],
        M.OVERHEAD_FREE_BOUND: report["overhead_free_bound"],
        M.IN_RUN_COST_RATIO_C: report["in_run_costs"]["c"],
        M.IN_RUN_VERIFY_RATIO_V: report["in_run_costs"]["v"],
        M.IN_RUN_BOUND: report["in_run_costs"]["overhead_free_bound"],
        M.BREAK_EVEN_ALPHA: report["break_even_alpha"],
        M.ACCEPTANCE_DECODER: report["alpha"]["value"],
        M.tau_at(report["settings"]["gamma"]): report["tau"]["value"],
    }
    if report["predicted_speedup"] is not None:  # chain rounds only
        out[M.SPEEDUP_PREDICTED] = report["predicted_speedup"]
    if "v_tree" in costs:
        out[M.VERIFY_RATIO_V_TREE] = costs["v_tree"]
    if report["alpha_draft"] is not None:
        out[M.ACCEPTANCE_DRAFT] = report["alpha_draft"]["value"]
    if report.get("chain"):
        out.update(M.chain_metrics(report["chain"]))
    if TARGET_ONLY_TORCH in methods:
        out[M.TARGET_TORCH_KERNELS_TOKENS_PER_S] = methods[TARGET_ONLY_TORCH]["tokens_per_s"]["value"]
    if "hf_assisted" in methods:
        out[M.SPEEDUP_HF_ASSISTED] = methods["hf_assisted"]["speedup"]["value"]
    if report.get("trees_vs_chain"):
        out[M.TREES_VS_CHAIN] = report["trees_vs_chain"]["value"]
    for name in report["decoders"]:
        if name != "speculative":
            out[M.decoder_speedup(name)] = methods[name]["speedup"]["value"]
    if report.get("llama_cpp"):
        out[M.LLAMA_CPP_TOKENS_PER_S] = methods[LLAMA_CPP_TARGET_ONLY]["tokens_per_s"]["value"]
        out[M.LLAMA_CPP_SPECULATIVE_TOKENS_PER_S] = methods[LLAMA_CPP_SPECULATIVE]["tokens_per_s"]["value"]
        out[M.LLAMA_CPP_SPEEDUP] = report["llama_cpp"]["speedup_vs_llama_cpp_target_only"]["value"]
        out[M.ACCEPTANCE_LLAMA_CPP] = report["llama_cpp"]["acceptance"]
    for name, summary in report["per_category"].items():
        out[M.per_category(M.ACCEPTANCE_DECODER, name)] = summary["acceptance_rate"]["value"]
    return M.finite(out)
