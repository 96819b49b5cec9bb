"""`draftops distill --config FILE [key=value ...]`: distill, evaluate, export and register a draft.

Command handlers import the modules their command runs when they run: the one documented exception to imports at the
top, so that building `draftops`' parser loads neither torch, transformers nor mlflow (tests/code_shape/)."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from pipeline.command_options import config_options


def distill_command(args) -> int:
    flags = ((["--config", args.config] if args.config else []) + (["--init-only"] if args.init_only else [])
             + (["--register-only"] if args.register_only else []) + (["--sizes", args.sizes] if args.sizes else []))
    if args.accelerate_config:
        # Several processes (DDP): accelerate starts them, each runs the same job (distill.train.main).
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.accelerate_config,
                   "-m", "distill.train"] + flags + args.overrides
        return subprocess.call(command)
    from distill.train import main

    return main(flags + args.overrides)


def suffix_index_command(args) -> int:
    from decode.serving.loading import load_model
    from distill.data.responses import target_suffix_index
    from pipeline.config import load_config
    from pipeline.traffic import load_traffic, reading_options

    try:
        cfg = load_config(args.config, args.overrides)
        traffic = load_traffic(args.traffic or cfg.traffic.path, **reading_options(cfg.traffic))
        requests = traffic.split(args.split, cfg.traffic.heldout_fraction)[:args.limit]
        if not requests:
            raise ValueError(f"{traffic.path}: no requests in the {args.split} split")
        target = load_model(args.target or cfg.target, device=cfg.device, dtype=cfg.dtype, cpu_linear=cfg.cpu_linear)
        index, seconds = target_suffix_index(target, requests, cfg)
        path = index.save(args.out)
    except (ValueError, OSError) as exc:
        print(f"draftops: error: {exc}", file=sys.stderr)
        return 2
    print(f"draftops suffix-index: {len(index)} target responses to the {args.split} split of {traffic.path} "
          f"({index.num_tokens} tokens); index built in {seconds:.2f} s, {path.stat().st_size / 2**20:.1f} MiB on "
          f"disk, {index.nbytes / 2**20:.1f} MiB in memory; written to {path}\n"
          f"use it with: decode.suffix=true decode.suffix_index={path} (and a tree "
          f"budget, docs/concepts.md#token-trees)")
    return 0


def engine_serve_command(args) -> int:
    from decode.serving.llamacpp import LlamaCppError
    from distill.data.generation.llama_servers import loopback_ports, serve
    from pipeline.config import load_config

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        cfg = load_config(args.config, [])
        if args.replicas:
            ports = list(range(args.port, args.port + args.replicas))
        else:
            ports = loopback_ports(cfg.distill.responses.servers)
            if not ports:
                raise ValueError(f"{args.config or 'the default config'} names no distill.responses.servers: give "
                                 "--replicas N, or a config such as configs/engine_llamacpp.yaml")
        return serve(cfg.target, ports, slots=args.slots or cfg.distill.responses.concurrency,
                     slot_context=args.slot_context, threads=args.threads, log_dir=args.log_dir, command=command,
                     model=args.model)
    except (LlamaCppError, ValueError, OSError) as exc:
        print(f"draftops: error: {exc}", file=sys.stderr)
        return 2


def add_commands(subparsers) -> None:
    """The distill package's subcommands (the `draftops.commands` entry point `distill`)."""
    _add_distill(subparsers)
    _add_suffix_index(subparsers)
    _add_engine_serve(subparsers)


def _add_distill(subparsers) -> None:
    parser = subparsers.add_parser(
        "distill", help="train a draft from the target's own responses and logits, export and register it",
        description="Generate (or reuse) the target's responses to the train split of the traffic, distill a draft "
                    "on them with accelerate, keep the best checkpoint by simulated τ on held-out requests, export "
                    "it and register a new version in MLflow. Killed runs resume from their last checkpoint.")
    parser.add_argument("--accelerate-config", default=None, metavar="FILE",
                        help="run under `accelerate launch --config_file FILE` "
                             "(e.g. configs/accelerate/cpu_2proc.yaml)")
    parser.add_argument("--init-only", action="store_true",
                        help="export the initialized, untrained draft to <job folder>/init (a benchmark baseline); "
                             "train and register nothing")
    parser.add_argument("--register-only", action="store_true",
                        help="register the draft of a finished job (same config and data) that is not registered yet; "
                             "a re-run does this by itself, without training again")
    parser.add_argument("--sizes", default=None, metavar="N,N,...",
                        help="a family of drafts at one budget, for `draftops sweep` to compare: one job per layer "
                             "count (the target's first N layers, everything else from the config), each registered "
                             "with the alias layers-N; e.g. --sizes 1,2,4,6 (make distill-sizes)")
    config_options(parser, overrides="e.g. distill.loss=tvd distill.epochs=2")
    parser.set_defaults(handler=distill_command)


def _add_suffix_index(subparsers) -> None:
    index = subparsers.add_parser(
        "suffix-index", help="a suffix index over the target's responses to a traffic file (for suffix decoding)",
        description="Generate (or reuse from the cache) the target's greedy responses to a split of a traffic file, "
                    "with distill's generation settings, and save a suffix index over them. `make distill` ships "
                    "one beside every draft; this builds one for other traffic (decode.suffix_index=FILE).")
    index.add_argument("--out", required=True, help="the index file to write (JSON)")
    index.add_argument("--target", default=None, help="target model source (default: the config's target)")
    index.add_argument("--traffic", default=None, help="traffic JSONL (default: the config's traffic.path)")
    index.add_argument("--split", choices=["heldout", "train", "all"], default="train")
    index.add_argument("--limit", type=int, default=None, help="the first N requests of the split")
    config_options(index)
    index.set_defaults(handler=suffix_index_command)


def _add_engine_serve(subparsers) -> None:
    engine = subparsers.add_parser(
        "engine", help="inference servers that generate distill's training data (docs/engines.md)").add_subparsers(
        dest="action", required=True)
    serve = engine.add_parser(
        "serve", help="start llama-server replicas of the target on this machine",
        description="Start one llama-server (make llama-cpp builds it) with the target's GGUF per loopback URL of "
                    "the config's distill.responses.servers (or --replicas N on consecutive ports), each with "
                    "distill.responses.concurrency slots. They run until interrupted, or until the command after "
                    "`--` ends: draftops engine serve --config configs/engine_llamacpp.yaml -- draftops distill "
                    "--config configs/engine_llamacpp.yaml")
    config_options(serve, overrides=None)
    serve.add_argument("--replicas", type=int, default=None, help="start N servers on ports --port, --port + 1, ...")
    serve.add_argument("--port", type=int, default=8081, help="the first port with --replicas (default 8081)")
    serve.add_argument("--slots", type=int, default=None,
                       help="parallel sequences per server (default: distill.responses.concurrency)")
    serve.add_argument("--slot-context", type=int, default=1024,
                       help="KV cache tokens per slot: the longest prompt + response (default 1024)")
    serve.add_argument("--threads", type=int, default=None, help="threads per server (default: CPUs / replicas)")
    serve.add_argument("--model", default=None, help="a GGUF to serve instead of the target's (e.g. a quantized one)")
    serve.add_argument("--log-dir", type=Path, default=Path("outputs/engine"), help="server logs (outputs/engine)")
    serve.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...: run it while the servers are up")
    serve.set_defaults(handler=engine_serve_command)
