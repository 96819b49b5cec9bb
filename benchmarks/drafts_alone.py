"""Each draft alone against the compiled target alone, interleaved on the same prompts: the draft-alone speedup column
of the drafts-against-the-peers table (docs/results.md), for several drafts in one run.

    PYTHONPATH=$PWD DRAFTOPS_HOME=... python benchmarks/drafts_alone.py --out outputs/drafts-alone \\
        --traffic default --traffic ../shared/data/spec_bench.jsonl \\
        --draft layer=LAYER_DRAFT --draft feature=FEATURE_DRAFT --draft peer=IMPORTED_HEAD

Per traffic (held-out split of the shipped traffic, all of a file given by path; 5 prompts per category; greedy; 128
new tokens, as `make bench`): `plain`, greedy decoding through the target's compiled lean forward, and per draft its
`draft_only` row as `draftops bench` builds it (the draft model alone in trees with the auto budget; the target's
passes compiled, a layer draft's too, a feature draft's own eager), every row taking its turn prompt by prompt
(`run_interleaved`); the speedup of each draft over `plain` paired over prompts with a bootstrap interval, whether its
text is `plain`'s on every prompt, its acceptance α̂ and tokens per round τ, and its chains of k = 3 over `plain`'s
text as vLLM counts them (acceptance at each draft position, mean acceptance length); each row's seconds and tokens
per prompt. bench's own rows compare one
draft and a challenger; this script puts any number beside each other without HF's rows.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

from decode.chain_acceptance import chain_text
from decode.drafters.protocol import DRAFT
from decode.factory import build_decoder
from decode.generation_stats import aggregate_stats
from decode.measure.bench import text_chains
from decode.runtime.forward import greedy_decode
from decode.runtime.timing import run_interleaved
from decode.serving.loading import load_draft, load_model
from pipeline.config import load_config
from pipeline.intervals import paired_speedup
from pipeline.sources import eos_token_ids
from pipeline.traffic import encode_prompts, first_per_category, load_traffic, reading_options

PLAIN = "plain"


def requests_of(cfg, traffic: str, per_category: int):
    """The prompts `make bench` takes: the shipped traffic's held-out split ("default"), or all of a file."""
    path, split = (cfg.traffic.path, "heldout") if traffic == "default" else (traffic, "all")
    requests = load_traffic(path, **reading_options(cfg.traffic)).split(split, cfg.traffic.heldout_fraction)
    return first_per_category(requests, per_category)


def run(cfg, target, drafts: dict, prompts: list[list[int]], seed: int, chain_k: int = 3) -> dict:
    """The interleaved rows on `prompts`, and per draft its paired speedup over `plain`, identity, α̂, τ and its
    chains of `chain_k` over `plain`'s text."""
    decode = cfg.decode.model_copy(update={"temperature": 0.0, "compiled": True})
    decoders = {name: build_decoder(target, draft, decode, kind=DRAFT) for name, draft in drafts.items()}
    runner, eos = next(iter(decoders.values())).target_runner, eos_token_ids(target.model, target.tokenizer)
    methods = {PLAIN: lambda p: greedy_decode(runner, p, decode.max_new_tokens, eos)}
    methods.update({name: (lambda d: lambda p: d.generate(p, max_new_tokens=decode.max_new_tokens))(d)
                    for name, d in decoders.items()})
    for method in methods.values():  # warm-up: compiles the passes, untimed
        method(prompts[0])
    runs = run_interleaved(methods, tqdm(prompts, desc="drafts alone", unit="prompt"), next(
        target.model.parameters()).device)
    texts = {name: [o if isinstance(o, list) else o.token_ids for o in outs] for name, outs in runs.outputs.items()}
    tokens = {name: [len(t) for t in outs] for name, outs in texts.items()}
    # each prompt's seconds and tokens kept, so that an interval pulled wide by a few prompts can be traced to them
    rows = {PLAIN: {"tokens_per_s": sum(tokens[PLAIN]) / sum(runs.seconds[PLAIN]),
                    "per_prompt": {"seconds": runs.seconds[PLAIN], "tokens": tokens[PLAIN]}}}
    for name in decoders:
        summary = aggregate_stats([o.stats for o in runs.outputs[name]], ["all"] * len(prompts), seed=seed)
        rows[name] = {"tokens_per_s": sum(tokens[name]) / sum(runs.seconds[name]),
                      "speedup_vs_plain": paired_speedup(tokens[name], runs.seconds[name], tokens[PLAIN],
                                                         runs.seconds[PLAIN], seed=seed),
                      "same_text_as_plain": sum(a == b for a, b in zip(texts[name], texts[PLAIN])),
                      "alpha": summary["acceptance_rate"], "tau": summary["tau"],
                      "drafter": decoders[name].drafter.name,
                      "per_prompt": {"seconds": runs.seconds[name], "tokens": tokens[name]},
                      "chain": text_chains(target, drafts[name], prompts, texts[PLAIN], chain_k, seed)}
    return {"prompts": len(prompts), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--out", default="outputs/drafts-alone")
    parser.add_argument("--traffic", action="append", required=True,
                        help='"default" (the shipped traffic\'s held-out split) or a JSONL path; repeatable')
    parser.add_argument("--draft", action="append", required=True, metavar="NAME=SOURCE", help="repeatable")
    parser.add_argument("--per-category", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    target = load_model(cfg.target, device=cfg.device, dtype=cfg.dtype, cpu_linear=cfg.cpu_linear)
    drafts = {}
    for spec in args.draft:
        name, _, source = spec.partition("=")
        if not source:
            parser.error(f"--draft {spec}: give NAME=SOURCE")
        drafts[name] = load_draft(source, target, cpu_linear=cfg.cpu_linear)
    report = {}
    for traffic in args.traffic:
        prompts, _ = encode_prompts(requests_of(cfg, traffic, args.per_category), target.tokenizer,
                                    cfg.traffic.max_prompt_tokens)
        report[traffic] = result = run(cfg, target, drafts, prompts, cfg.seed)
        for name, row in result["rows"].items():
            speedup = row.get("speedup_vs_plain")
            said = "" if speedup is None else (
                f"  {speedup['value']:.2f}x [{speedup['low']:.2f}, {speedup['high']:.2f}] over plain, same text "
                f"{row['same_text_as_plain']}/{result['prompts']}, α̂ {row['alpha']['value']:.3f}, "
                f"τ {row['tau']['value']:.2f}; {chain_text(row['chain'])}")
            print(f"{traffic} {name}: {row['tokens_per_s']:.1f} tokens/s{said}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "drafts_alone.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
