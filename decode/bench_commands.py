"""The handlers of `draftops bench` and `draftops sweep`: load, run the measurement (`decode.measure`), write its
report and log it to MLflow. Heavy modules are imported when a command runs (see `decode.commands`)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from decode.commands import decode_settings, error, load_target, load_target_and_draft, selected_requests


def _compared_decoders(args) -> dict:
    """bench's --compare "NAME key=value ...": the decode settings of each named decoder, the command's config with
    the command's overrides and then its own."""
    from decode.measure.bench_rows import reserved_rows
    from pipeline.config import load_config

    compared = {}
    for spec in args.compare or []:
        name, *overrides = spec.split()
        if name in compared or name in reserved_rows() or "=" in name:
            raise ValueError(f'--compare "{spec}": it needs a new row name first, then key=value overrides')
        if not all(override.startswith("decode.") for override in overrides):
            raise ValueError(f'--compare "{spec}": a compared row differs in decode.* settings only')
        compared[name] = decode_settings(load_config(args.config, [*args.overrides, *overrides]), args)
    return compared


def bench_command(args) -> int:
    import mlflow

    from decode.drafters.lookup import PROMPT_LOOKUP
    from decode.measure.bench import run_bench
    from decode.measure.bench_llamacpp import llama_cpp_servers
    from decode.measure.bench_report import flat_metrics as bench_metrics
    from decode.measure.bench_report import markdown
    from decode.serving.llamacpp import LlamaCppError
    from decode.serving.loading import load_draft
    from pipeline.metrics import DRAFT_FINGERPRINT_TAG, DRAFT_SOURCE_TAG, LATEST_BENCH_RUN_TAG, TARGET_FINGERPRINT_TAG
    from pipeline.registry import link_run
    from pipeline.tracking import start_run
    from pipeline.traffic import encode_prompts

    try:
        compare = _compared_decoders(args)
        if args.draft == PROMPT_LOOKUP:
            (cfg, target), draft = load_target(args, tracked=True), None
        else:
            cfg, target, draft = load_target_and_draft(args, tracked=True)
        challenger = load_draft(args.challenger, target, cpu_linear=cfg.cpu_linear) if args.challenger else None
        _, requests = selected_requests(cfg, args)
        prompts, _ = encode_prompts(requests, target.tokenizer, cfg.traffic.max_prompt_tokens)
        decode = decode_settings(cfg, args)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            servers, skipped = llama_cpp_servers(args.llama_cpp, target.source, draft, args.gamma or decode.gamma,
                                                 out / "llama.cpp", stack)
            report = run_bench(target, draft, prompts, [r.category for r in requests], decode, gamma=args.gamma,
                               seed=cfg.seed, llama_cpp=servers, compare=compare,
                               challenger=challenger, chain_k=args.chain_k)
        if skipped:
            report["notes"].append(f"no llama_cpp rows: {skipped}")
    except (ValueError, LlamaCppError) as exc:
        return error(exc)
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


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def sweep_command(args) -> int:
    from decode.measure.sweep import run_sweep
    from decode.measure.sweep_axes import llama_cpp_target_server
    from decode.measure.sweep_drafts import load_drafts
    from decode.measure.sweep_report import markdown, write_decode_config
    from decode.serving.llamacpp import LlamaCppError
    from pipeline.traffic import encode_prompts

    cfg, target = load_target(args, tracked=True)
    notes: list[str] = []
    try:
        _, requests = selected_requests(cfg, args)
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
        return error(exc)
    report.update(target=target.source, traffic=str(args.traffic or cfg.traffic.path),
                  notes=notes + report["notes"])
    config_path = write_decode_config(cfg, report["recommendation"], out / "decode_config.yaml",
                                      target.source)
    report["recommendation"]["config_path"] = str(config_path)
    (out / "sweep.json").write_text(json.dumps(report, indent=2))
    (out / "sweep.md").write_text(markdown(report))
    report["mlflow_run_id"] = _log_sweep(cfg, report, target, out)
    (out / "sweep.json").write_text(json.dumps(report, indent=2))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(markdown(report) + f"\nwritten to {out}; MLflow run {report['mlflow_run_id']}")
    return 0


def _log_sweep(cfg, report: dict, target, out: Path) -> str:
    """The sweep's MLflow run: its settings and recommendation, `sweep_metrics`, the files in `out` and the figures
    (also saved there) -> the run's id."""
    import mlflow

    from decode.measure.sweep_figures import figures
    from pipeline import metrics as M
    from pipeline.tracking import log_figure, start_run

    tags = {M.TARGET_FINGERPRINT_TAG: target.fingerprint, M.DRAFTS_TAG: ",".join(report["drafts"])}
    with start_run(cfg, "sweep", run_name="sweep", tags=tags) as run:
        s = report["settings"]
        mlflow.log_params({"drafts": ",".join(report["drafts"]), "gammas": s["gammas"], "contexts": s["contexts"],
                           "max_new_tokens": s["max_new_tokens"], "analytic_prompts": s["analytic_prompts"],
                           "measure_prompts": s["measure_prompts"],
                           "recommended_draft": report["recommendation"]["draft"],
                           "gamma_schedule": report["recommendation"]["gamma_schedule"]})
        mlflow.log_metrics(M.finite(sweep_metrics(report)))
        for name in ("sweep.json", "sweep.md", "decode_config.yaml"):
            mlflow.log_artifact(str(out / name), "sweep")
        for name, fig in figures(report).items():
            fig.savefig(out / name, dpi=120)
            log_figure(fig, f"sweep/{name}")
        return run.info.run_id


def sweep_metrics(report: dict) -> dict[str, float]:
    """The sweep's MLflow metrics: the gap, the best speedup and break-even α per cell, the quantized target, the
    batch axis and the draft-size axis."""
    from pipeline import metrics as M

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
    return metrics
