"""The handlers of `draftops decode | eval | export | llama-cpp | models info | models import`, and the loading and
traffic selection every decode command shares (`load_target`, `load_target_and_draft`, `selected_requests`).

Handlers import the modules their command runs when they run: the one documented exception to imports at the top, so
that building `draftops`' parser loads neither torch, transformers nor mlflow (tests/code_shape/)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pipeline.registry import is_registry_uri


def load_target(args, tracked: bool = False):
    """Config (with overrides) and the target; `tracked`: the command logs to MLflow, so its store must answer
    first (`check_tracking`), before any model is loaded or any work done. A `models:/` target or draft is looked up
    before the target loads: a version the store lacks, or a store that fails, ends the command before its work."""
    from decode.serving.loading import load_model
    from pipeline.config import load_config
    from pipeline.registry import find_version
    from pipeline.tracking import check_tracking, setup_mlflow

    cfg = load_config(args.config, args.overrides)
    if tracked:
        check_tracking(cfg)
    sources = [args.target or cfg.target, getattr(args, "draft", None) or getattr(args, "drafts", None) or ""]
    if any(is_registry_uri(source) for source in sources):
        setup_mlflow(cfg)  # registry sources resolve against the configured store
    for source in (sources[0], getattr(args, "draft", None) or ""):
        if is_registry_uri(source):
            find_version(source)
    return cfg, load_model(args.target or cfg.target, device=cfg.device, dtype=cfg.dtype, cpu_linear=cfg.cpu_linear)


def load_target_and_draft(args, tracked: bool = False):
    """Config (with overrides), then target and draft on the same device and dtype, tokenizers checked (`tracked`:
    as `load_target`)."""
    from decode.drafters.lookup import PROMPT_LOOKUP
    from decode.serving.loading import load_draft

    if args.draft == PROMPT_LOOKUP:
        raise ValueError(f"--draft {PROMPT_LOOKUP} works with `draftops decode`, `bench` and `sweep`; "
                         "this command needs a draft model")
    cfg, target = load_target(args, tracked)
    return cfg, target, load_draft(args.draft, target, cpu_linear=cfg.cpu_linear)


def pick(value, default):
    return default if value is None else value


def decode_settings(cfg, args):
    """cfg.decode with the command line's sampling and length options applied (--gamma is passed to the factory)."""
    update = {name: getattr(args, name) for name in ("max_new_tokens", "temperature", "top_k", "top_p")
              if getattr(args, name, None) is not None}
    from pipeline.config import validated_update

    return validated_update(cfg.decode, update, prefix="decode.")  # the schema's checks, as key=value gets them


def selected_requests(cfg, args):
    from pipeline.traffic import first_per_category, load_traffic, reading_options

    traffic = load_traffic(pick(args.traffic, cfg.traffic.path), **reading_options(cfg.traffic))
    requests = traffic.split(args.split, cfg.traffic.heldout_fraction)
    if getattr(args, "per_category", None):
        requests = first_per_category(requests, args.per_category)
    if args.limit:
        requests = requests[: args.limit]
    if not requests:
        raise ValueError(f"no requests in the {args.split} split of {traffic.path}")
    return traffic, requests


def error(exc: Exception) -> int:
    print(f"draftops: error: {exc}", file=sys.stderr)
    return 2


def models_info(args) -> int:
    """`draftops models info SOURCE [--kernels]`: the checkpoint's facts; with --kernels also the CPU linear kernels
    `cpu_linear: auto` picks for its weight shapes on this machine."""
    from pipeline.sources import checkpoint_info, locate
    from pipeline.tracking import check_tracking

    if is_registry_uri(args.source):
        check_tracking()  # the store MLFLOW_TRACKING_URI names answers now, or the command fails at once, naming it
    info = checkpoint_info(locate(args.source))
    if args.kernels:
        return models_info_kernels(args, info)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    width = max(len(k) for k in info)
    for key, value in info.items():
        print(f"{key:<{width}}  {json.dumps(value) if isinstance(value, (dict, list)) else value}")
    return 0


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


def models_import(args) -> int:
    """`draftops models import SOURCE`: check a head made elsewhere, write it as a draftops feature draft, register
    it (`decode.serving.draft_import`)."""
    from decode.serving.draft_import import HeadImportError, import_head, register_import
    from pipeline import registry
    from pipeline.tracking import TrackingUnavailable, check_tracking

    cfg, target = load_target(args)
    if args.target:
        cfg = cfg.model_copy(update={"target": args.target})
    try:
        if not args.no_register:
            check_tracking(cfg)  # before the work, not at registration after it
        out = Path(args.out or Path("outputs/imported") / Path(args.source).resolve().name)
        imported = import_head(args.source, target, out, cfg)
    except (HeadImportError, TrackingUnavailable) as exc:
        return error(exc)
    print(f"imported the {imported.layout} head {imported.source} as a feature draft: {imported.path}")
    for check in imported.checks:
        print(f"  checked: {check}")
    source = str(imported.path)
    if not args.no_register:
        version, alias = register_import(cfg, imported, target, alias=args.alias)
        source = registry.version_uri(cfg.tracking.registered_model, version)
        print(f"registered: {source}  alias {alias}")
    print(f"next: draftops bench --draft {source}; draftops export {source} --format vllm --out DIR; "
          "draftops monitor check (on the champion)")
    return 0


def decode_command(args) -> int:
    from decode.drafters.lookup import PROMPT_LOOKUP
    from decode.drafters.protocol import DECODER, LOOKUP
    from decode.factory import build_decoder
    from pipeline.traffic import Request, encode_prompt

    try:
        messages = [{"role": "user", "content": args.prompt}] if args.prompt is not None else json.loads(args.messages)
    except json.JSONDecodeError as exc:
        return error(f"--messages is not valid JSON: {exc}")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        return error('--messages must be a JSON list of {"role": ..., "content": ...} objects')
    if args.draft == PROMPT_LOOKUP:
        (cfg, target), draft = load_target(args), None
    else:
        cfg, target, draft = load_target_and_draft(args)
    d = decode_settings(cfg, args)
    prompt = encode_prompt(Request("cli", "cli", tuple(messages)), target.tokenizer, cfg.traffic.max_prompt_tokens)
    try:
        decoder = build_decoder(target, draft, d, kind=LOOKUP if draft is None else DECODER, gamma=args.gamma)
        result = decoder.generate(prompt, seed=pick(args.seed, cfg.seed))
    except ValueError as exc:
        return error(exc)
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
    from decode.measure.evaluate import evaluate
    from pipeline.traffic import encode_prompts

    try:
        cfg, target, draft = load_target_and_draft(args, tracked=True)
    except ValueError as exc:
        return error(exc)
    try:
        traffic, requests = selected_requests(cfg, args)
        prompts, truncated = encode_prompts(requests, target.tokenizer, cfg.traffic.max_prompt_tokens)
        report = evaluate(target, draft, prompts, [r.category for r in requests], decode_settings(cfg, args),
                          gamma=args.gamma, seed=cfg.seed, chain_k=args.chain_k)
    except ValueError as exc:
        return error(exc)
    report.update(target=target.source, draft=draft.source, traffic=str(traffic.path), split=args.split,
                  truncated_prompts=truncated)
    report["mlflow_run_id"] = _log_eval(cfg, report, target, draft,
                                        traffic.fingerprint(args.split, cfg.traffic.heldout_fraction))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_eval(report)
    return 0


def _log_eval(cfg, report: dict, target, draft, traffic_fingerprint: str) -> str:
    """eval's MLflow run (its settings, `flat_metrics`, the report and its figures), linked from the draft's registry
    version -> the run's id."""
    import mlflow

    from decode.measure.evaluate import flat_metrics, per_category_figure, per_position_figure
    from pipeline.metrics import DRAFT_FINGERPRINT_TAG, DRAFT_SOURCE_TAG, LATEST_EVAL_RUN_TAG, TARGET_FINGERPRINT_TAG
    from pipeline.registry import link_run
    from pipeline.tracking import log_figure, start_run

    tags = {DRAFT_SOURCE_TAG: draft.source, DRAFT_FINGERPRINT_TAG: draft.fingerprint,
            TARGET_FINGERPRINT_TAG: target.fingerprint}
    with start_run(cfg, "eval", run_name=f"eval-{Path(draft.source).name}", tags=tags) as run:
        mlflow.log_params({"split": report["split"], "n_prompts": report["n_prompts"], **report["settings"],
                           **{f"drafter_{kind}": name for kind, name in report["drafters"].items()},
                           "traffic_fingerprint": traffic_fingerprint})
        mlflow.log_metrics(flat_metrics(report))
        mlflow.log_dict(report, "eval/report.json")
        log_figure(per_position_figure(report), "eval/per_position.png")
        if report["analytic"]["per_category"]:
            log_figure(per_category_figure(report), "eval/per_category.png")
        link_run(draft.source, LATEST_EVAL_RUN_TAG, run.info.run_id)
        return run.info.run_id


def _print_eval(report: dict) -> None:
    """eval's report for people: both acceptances with their intervals, τ, per category and by target confidence."""
    from decode.chain_acceptance import chain_text
    from decode.drafters.protocol import DECODER, DRAFT

    analytic, drafters = report["analytic"]["alpha"], report["drafters"]
    print(f"prompts: {report['n_prompts']} ({report['split']})")
    for kind, label in ((DRAFT, "draft acceptance α̂:  "), (DECODER, "decoder acceptance: ")):
        live = report["live"][kind]["acceptance_rate"]
        print(f"{label} {live['value']:.3f} [{live['low']:.3f}, {live['high']:.3f}]  "
              f"({drafters.get(kind, drafters[DRAFT])})")
    print(f"analytic α:          {analytic['value']:.3f} [{analytic['low']:.3f}, {analytic['high']:.3f}]")
    predicted = report["predicted_tau"]["from_analytic_alpha"]
    print(f"τ of the draft alone: {report['live'][DRAFT]['tau']['value']:.2f} "
          f"(predicted from analytic α: {predicted:.2f})")
    if report["chain"]:
        print(f"the draft in chains of {chain_text(report['chain'])}")
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


def export_command(args) -> int:
    from decode.serving.export import (
        FEATURES,
        GGUF,
        ExportError,
        draft_source,
        export_format,
        folder_vocab_size,
        serving_commands,
        target_gguf,
    )
    from decode.serving.llamacpp import LlamaCppError, converter_script
    from pipeline.config import load_config
    from pipeline.sources import SourceError, locate

    cfg = load_config(args.config, args.overrides)
    if any(is_registry_uri(source or "") for source in (args.source, args.target)):
        from pipeline.tracking import setup_mlflow

        setup_mlflow(cfg)  # registry sources resolve against the configured store
    try:
        draft = draft_source(args.source)
        target = args.target or draft.target or cfg.target
        gguf, eagle3 = args.format == GGUF, args.format == GGUF and draft.family == FEATURES
        out = export_format(draft, args.format, Path(args.out), force=args.force,
                            target_vocab_size=folder_vocab_size(target),
                            vocabulary=target_gguf(target) if gguf and not eagle3 else None,
                            gguf_dtype=args.gguf_dtype,
                            target_dir=locate(target).path if eagle3 else None,
                            converter=converter_script() if eagle3 else None)
    except (ExportError, SourceError, LlamaCppError) as exc:
        return error(exc)
    print(f"exported the {draft.family} draft {draft.source} as {args.format} to {out}")
    print("\n".join(serving_commands(draft.family, args.format, out, target, args.gamma or draft.gamma
                                     or cfg.decode.gamma)))
    return 0


def llama_cpp_command(args) -> int:
    from decode.serving.llamacpp import LlamaCppError, build

    try:
        folder = build(Path(args.sdist) if args.sdist else None, jobs=args.jobs)
    except (LlamaCppError, OSError) as exc:
        return error(exc)
    print(f"llama.cpp binaries for this CPU: {folder}")
    return 0
