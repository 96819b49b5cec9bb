"""`draftops distill --config FILE [key=value ...]`: distill, evaluate, export and register a draft.

Command handlers import the modules their command runs when they run: the one documented exception to imports at the
top, so that building `draftops`' parser loads neither torch, transformers nor mlflow (tests/test_layout.py)."""
from __future__ import annotations

import subprocess
import sys


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
    from distill.responses import target_suffix_index
    from pipeline.config import load_config
    from pipeline.traffic import load_traffic

    try:
        cfg = load_config(args.config, args.overrides)
        traffic = load_traffic(args.traffic or cfg.traffic.path, skip_malformed=cfg.traffic.skip_malformed)
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


def add_commands(subparsers) -> None:
    parser = subparsers.add_parser(
        "distill", help="train a draft from the target's own responses and logits, export and register it",
        description="Generate (or reuse) the target's responses to the train split of the traffic, distill a draft "
                    "on them with accelerate, keep the best checkpoint by simulated τ on held-out requests, export "
                    "it and register a new version in MLflow. Killed runs resume from their last checkpoint.")
    parser.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml)")
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
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. distill.loss=tvd distill.epochs=2")
    parser.set_defaults(handler=distill_command)

    index = subparsers.add_parser(
        "suffix-index", help="a suffix index over the target's responses to a traffic file (for suffix decoding)",
        description="Generate (or reuse from the cache) the target's greedy responses to a split of a traffic file, "
                    "with distill's generation settings, and save a suffix index over them. `make distill` ships "
                    "one beside every draft; this builds one for other traffic (decode.suffix_index=FILE).")
    index.add_argument("--out", required=True, help="the index file to write (JSON)")
    index.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml)")
    index.add_argument("--target", default=None, help="target model source (default: the config's target)")
    index.add_argument("--traffic", default=None, help="traffic JSONL (default: the config's traffic.path)")
    index.add_argument("--split", choices=["heldout", "train", "all"], default="train")
    index.add_argument("--limit", type=int, default=None, help="the first N requests of the split")
    index.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. device=cpu")
    index.set_defaults(handler=suffix_index_command)
