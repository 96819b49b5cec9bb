"""`draftops distill --config FILE [key=value ...]`: distill, evaluate, export and register a draft.
`draftops target finetune --config FILE [key=value ...]`: an updated target (LoRA in another style, merged)."""
from __future__ import annotations

import subprocess
import sys


def distill_command(args) -> int:
    flags = (["--config", args.config] if args.config else []) + (["--init-only"] if args.init_only else [])
    if args.accelerate_config:
        # Several processes (DDP): accelerate starts them, each runs the same job (distill.train.main).
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.accelerate_config,
                   "-m", "distill.train"] + flags + args.overrides
        return subprocess.call(command)
    from distill.train import main

    return main(flags + args.overrides)


def target_finetune_command(args) -> int:
    from distill.finetune import run_finetune
    from pipeline.config import load_config
    from pipeline.tracking import tracking_uri

    cfg = load_config(args.config, args.overrides)
    result = run_finetune(cfg)
    print(f"draftops target finetune: done ({cfg.target_update.style} style, {result.examples} examples, "
          f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f})")
    print("  time: " + "  ".join(f"{k} {v:.0f}s" for k, v in result.timings.items())
          + f"  (total {sum(result.timings.values()):.0f}s)")
    print(f"  target {cfg.target} ({result.base_fingerprint}) -> {result.path} ({result.fingerprint})")
    print(f"  MLflow: {tracking_uri(cfg)}  run {result.run_id}  (experiment draftops-target)")
    print(f"  check the champion against it: draftops monitor check{f' --config {args.config}' if args.config else ''}"
          f" target={result.path}")
    return 0


def add_commands(subparsers) -> None:
    parser = subparsers.add_parser(
        "distill", help="train a draft from the target's own responses and logits, export and register it",
        description="Generate (or reuse) the target's responses to the train split of the traffic, distill a draft "
                    "on them with accelerate, keep the best checkpoint by simulated τ on held-out requests, export "
                    "it and register a new version in MLflow. Killed runs resume from their last checkpoint.")
    parser.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml)")
    parser.add_argument("--accelerate-config", default=None, metavar="FILE",
                        help="run under `accelerate launch --config_file FILE` (e.g. configs/accelerate/cpu_2proc.yaml)")
    parser.add_argument("--init-only", action="store_true",
                        help="export the initialized, untrained draft to <job folder>/init (a benchmark baseline); "
                             "train and register nothing")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. distill.loss=tvd distill.epochs=2")
    parser.set_defaults(handler=distill_command)

    target = subparsers.add_parser("target", help="target model updates (to rehearse a target change)")
    actions = target.add_subparsers(dest="action", required=True)
    finetune = actions.add_parser(
        "finetune", help="fine-tune the target with LoRA on its own responses in another style, merge and save",
        description="The configured target answers prompts (target_update.prompts; distill's response cache is "
                    "reused), the responses are restyled (target_update.style), a LoRA adapter is trained on them "
                    "and merged, and the result is saved to target_update.output_dir as a new checkpoint.")
    finetune.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml)")
    finetune.add_argument("overrides", nargs="*", metavar="key=value",
                          help="e.g. target_update.steps=60 target_update.style=prefix")
    finetune.set_defaults(handler=target_finetune_command)
