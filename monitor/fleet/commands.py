"""`draftops engine sweep`: where speculation stops paying in a running engine, by concurrency
(monitor.fleet.engine_sweep), written as engine_sweep.json (what `monitor.engine_boundary` reads) and
engine_sweep.md, and logged as an MLflow run (experiment `draftops-engine`, run name `engine-sweep`)."""
from __future__ import annotations

import argparse
import json

from pipeline.command_options import config_options

DEFAULT_OUT = "outputs/engine-sweep"  # beside `make sweep`'s outputs/sweep


def _body(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: a JSON object, e.g. '{{\"speculative.n_max\": 0}}'")
    return value


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text}: a positive integer")
    return int(text)


def _counts(text: str) -> list[int]:
    return [_positive(part.strip()) for part in text.split(",")]


def _engine_actions(subparsers):
    """The actions of `draftops engine` (distill's `engine serve` may have made it already: then its own)."""
    engine = subparsers.choices.get("engine")
    if engine is None:
        return subparsers.add_parser("engine", help="inference servers").add_subparsers(dest="action", required=True)
    return next(a for a in engine._actions if isinstance(a, argparse._SubParsersAction))


def add_commands(subparsers) -> None:
    """`draftops engine sweep`."""
    actions = _engine_actions(subparsers)
    p = config_options(actions.add_parser(
        "sweep", help="tokens/s, throughput, time per output token and acceptance by concurrency, with and without "
                      "the draft; where speculation stops paying, and a setting per concurrency"))
    p.add_argument("--url", required=True, help="base URL of the engine serving the target with the draft")
    p.add_argument("--plain-url", default=None, help="base URL of the same engine serving the target alone")
    p.add_argument("--plain-body", type=_body, default=None, help=(
        "or: JSON merged into each request to the --url engine to turn drafting off (llama-server: "
        "'{\"speculative.n_max\": 0}')"))
    p.add_argument("--kind", choices=("vllm", "llamacpp", "sglang"), required=True, help="the engine")
    p.add_argument("--draft-tokens", type=_counts, default=[5], help=(
        "draft tokens a round the engine runs with; several, comma-separated (llama-server: each request's "
        "speculative.n_max), each swept and the fastest recommended per concurrency"))
    p.add_argument("--metrics-url", default=None, help="its /metrics (default: URL/metrics)")
    p.add_argument("--model", default=None, help="model name sent in each request (vLLM, SGLang)")
    p.add_argument("--max-concurrency", type=_positive, default=8, help="concurrency 1, 2, 4, ... up to this")
    p.add_argument("--requests", type=_positive, default=16, help="requests a pass (at least the concurrency)")
    p.add_argument("--max-tokens", type=_positive, default=64, help="new tokens a request")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take, whole")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"folder of the results (default {DEFAULT_OUT})")
    p.set_defaults(handler=engine_sweep)


def engine_sweep(args) -> int:
    from pathlib import Path

    import mlflow
    from tqdm.auto import tqdm

    from monitor.fleet.engine_sweep import RESULT_FILE, TABLE_FILE, SweepError, levels, sweep
    from pipeline.config import load_config
    from pipeline.files import write_text_atomic
    from pipeline.tracking import start_run
    from pipeline.traffic import load_traffic

    if (args.plain_url is None) == (args.plain_body is None):
        raise SweepError("engine sweep: give --plain-url (the engine without the draft) or --plain-body (its "
                         "per-request switch), one of them")
    cfg = load_config(args.config, args.overrides)
    heldout = load_traffic(cfg.traffic.path).split("heldout", cfg.traffic.heldout_fraction)
    if not heldout:
        raise SweepError(f"{cfg.traffic.path}: no held-out requests to send (traffic.heldout_fraction)")
    prompts = [list(r.messages) for r in heldout]
    metrics_url = args.metrics_url or f"{args.url.rstrip('/')}/metrics"
    passes = (len(args.draft_tokens) + 1) * len(levels(args.max_concurrency))
    with tqdm(total=passes, desc="engine sweep") as bar:
        draft_tokens = args.draft_tokens[0] if len(args.draft_tokens) == 1 else args.draft_tokens
        result = sweep(url=args.url, plain_url=args.plain_url, plain_body=args.plain_body or {}, kind=args.kind,
                       draft_tokens=draft_tokens, model=args.model, prompts=prompts,
                       max_concurrency=args.max_concurrency, requests=args.requests, max_tokens=args.max_tokens,
                       timeout=args.timeout, metrics_url=metrics_url, progress=bar.update)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = result.markdown(f"Engine sweep: {args.kind} at {args.url}")
    write_text_atomic(out / RESULT_FILE, json.dumps(result.to_dict(), indent=1))
    write_text_atomic(out / TABLE_FILE, table)
    with start_run(cfg, "engine", run_name="engine-sweep", tags={"draftops.engine.kind": args.kind}):
        mlflow.log_params({"engine.url": args.url, "engine.kind": args.kind,
                           "engine.draft_tokens": ",".join(map(str, args.draft_tokens)),
                           "engine.max_concurrency": args.max_concurrency, "engine.requests": args.requests,
                           "engine.max_tokens": args.max_tokens})
        for p in result.passes:
            name = f"engine/{'plain' if not p.draft else f'draft{p.draft_tokens}' if p.draft_tokens else 'draft'}"
            mlflow.log_metric(f"{name}/throughput", p.throughput, step=p.concurrency)
            mlflow.log_metric(f"{name}/time_per_output_token", p.time_per_output_token, step=p.concurrency)
            if p.acceptance is not None:
                mlflow.log_metric(f"{name}/acceptance", p.acceptance, step=p.concurrency)
        if result.boundary is not None:
            mlflow.log_metric("engine/boundary_concurrency", result.boundary)
        mlflow.log_dict(result.to_dict(), "engine/engine_sweep.json")
        mlflow.log_text(table, "engine/engine_sweep.md")
    print(table, end="")
    print(f"written: {out / RESULT_FILE}, {out / TABLE_FILE}")
    return 0
