"""Drafts side by side on the target's greedy replies, each against a baseline paired over prompts: the ablation table
of docs/results.md ("Training for acceptance").

    PYTHONPATH=$PWD python benchmarks/draft_ablation.py --out outputs/ablation \\
        --traffic default --traffic ../shared/data/spec_bench.jsonl \\
        --draft kl=outputs/distill/... --draft log_acceptance=outputs/lk/... --draft peer=outputs/peer/imported

Per traffic (the held-out split of the shipped traffic as `make distill` evaluates it, or the first 5 prompts per
category of a file given by path) the target's greedy reply to each prompt, cached as `make distill` caches its
held-out replies, and per draft what a job ends with (`distill.heldout_eval`: `exact_eval` for a layer draft,
`feature_eval` for a feature draft): α(T=0), α(T=1) (exact for a layer draft; a feature draft's from the cached
top-64, a lower bound), the acceptance at each position of chains of 3 and their acceptance length. Every draft after
the first is compared with the first (`--baseline` names another): the difference in α(T=0) and α(T=1) and the
ratio of accepted tokens per chain (acceptance length − 1), each with a paired bootstrap interval over prompts.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from decode.chain_acceptance import ENGINE_CHAIN, chain_text
from decode.models.feature_draft import FeatureDraft
from decode.serving.loading import load_draft, load_model
from distill.data.responses import cached_responses
from distill.heldout_eval import exact_eval, feature_eval
from distill.step import FeatureStepLogits
from pipeline.config import load_config
from pipeline.intervals import paired_ratio_difference
from pipeline.traffic import encode_configured, first_per_category, load_traffic, reading_options

COMPARED = (("alpha_t0", "difference"), ("alpha_t1", "difference"), ("chain_accepted", "ratio"))


def greedy_replies(cfg, target, traffic: str, per_category: int):
    """The target's greedy replies with their top-k (a `ResponseSet`): the shipped traffic's held-out prompts as
    `make distill` takes them, or the first `per_category` prompts per category of a JSONL file."""
    d = cfg.distill
    if traffic == "default":
        requests = load_traffic(cfg.traffic.path, **reading_options(cfg.traffic)).split(
            "heldout", cfg.traffic.heldout_fraction)[:d.eval_prompts]
    else:
        requests = first_per_category(load_traffic(traffic, **reading_options(cfg.traffic)).split("all", 0.0),
                                      per_category)
    prompts = encode_configured(requests, target.tokenizer, cfg.traffic)[0]
    responses, _, _ = cached_responses(
        target.model, target.tokenizer, target.fingerprint, requests, prompts, samples=1,
        max_new_tokens=d.max_new_tokens, temperature=d.generation_temperature, batch_size=d.generation_batch_size,
        seed=cfg.seed, topk=d.topk, progress=True)
    return responses


@torch.inference_mode()
def evaluate(draft, target, responses, gamma: int) -> dict:
    """What `draftops distill` measures at the end of a job, with per-prompt sums."""
    model = draft.model.float().eval()
    if isinstance(model, FeatureDraft):
        return feature_eval(FeatureStepLogits(model, ENGINE_CHAIN), target.model, responses, model.token_ids, gamma,
                            chain_k=ENGINE_CHAIN)
    return exact_eval(target.model, model, responses, draft.token_ids, gamma, chain_k=ENGINE_CHAIN)


def compare(rows: dict, baseline: str, seed: int) -> dict:
    """Each draft against the baseline, paired over prompts (`COMPARED`)."""
    base = rows[baseline]["per_response"]
    return {name: {metric: paired_ratio_difference(row["per_response"][metric], base[metric], seed=seed)[kind]
                   for metric, kind in COMPARED}
            for name, row in rows.items() if name != baseline}


def table(report: dict, baseline: str) -> str:
    """Markdown: one row per traffic and draft."""
    lines = ["| traffic | draft | α(T=0) | α(T=1) | chains of 3 | acceptance length | vs " + baseline + ": Δα(T=0); "
             "accepted per chain ×", "|---|---|---:|---:|---|---:|---|"]
    for traffic, result in report.items():
        for name, row in result["rows"].items():
            versus = result["compared"].get(name)
            said = "" if versus is None else (
                "{d[value]:+.3f} [{d[low]:+.3f}, {d[high]:+.3f}]; {r[value]:.2f}× [{r[low]:.2f}, {r[high]:.2f}]"
                .format(d=versus["alpha_t0"], r=versus["chain_accepted"]))
            chain = row["chain"]
            lines.append(f"| {traffic} | {name} | {row['alpha_t0']:.3f} | {row['alpha_t1']:.3f} | "
                         f"{' / '.join(f'{x:.2f}' for x in chain['per_position'])} | {chain['length']:.2f} | {said} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--out", default="outputs/ablation")
    parser.add_argument("--traffic", action="append", required=True,
                        help='"default" (the shipped traffic\'s held-out split) or a JSONL path; repeatable')
    parser.add_argument("--draft", action="append", required=True, metavar="NAME=SOURCE", help="repeatable")
    parser.add_argument("--baseline", default=None, help="the draft the others are compared with (default: the first)")
    parser.add_argument("--per-category", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, ["device=cpu", *args.overrides])
    target = load_model(cfg.target, device="cpu", dtype="float32", cpu_linear="torch")
    sources = dict(spec.partition("=")[::2] for spec in args.draft)
    if not all(sources.values()):
        parser.error("--draft: give NAME=SOURCE")
    baseline = args.baseline or next(iter(sources))
    report = {}
    for traffic in args.traffic:
        responses = greedy_replies(cfg, target, traffic, args.per_category)
        rows = {}
        for name, source in sources.items():
            rows[name] = evaluate(load_draft(source, target, cpu_linear="torch"), target, responses,
                                  cfg.decode.gamma)
            print(f"{traffic} {name}: α(T=0) {rows[name]['alpha_t0']:.3f}  α(T=1) {rows[name]['alpha_t1']:.3f}  "
                  f"{chain_text(rows[name]['chain'])}", file=sys.stderr, flush=True)
        report[traffic] = {"prompts": len(responses), "rows": rows, "compared": compare(rows, baseline, cfg.seed)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablation.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "ablation.md").write_text(table(report, baseline) + "\n")
    print(table(report, baseline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
