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
