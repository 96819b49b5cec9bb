"""`draftops`: one command line for the whole pipeline. Each package adds its own subcommands through the
`draftops.commands` entry points (pyproject.toml): this module, the bottom layer, names none of them.

Command handlers import the modules their command runs when they run: the one documented exception to imports at the
top, so that building `draftops`' parser loads neither torch, transformers nor mlflow (tests/code_shape/)."""
from __future__ import annotations

import argparse
import json
import sys
from importlib.metadata import entry_points

import numpy as np

from pipeline.command_options import config_options

# The entry-point group through which each package contributes subcommands: `add_commands(subparsers)`.
COMMANDS_GROUP = "draftops.commands"


def _print(payload: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(payload, indent=2))
        return
    width = max(len(k) for k in payload)
    for key, value in payload.items():
        print(f"{key:<{width}}  {json.dumps(value) if isinstance(value, (dict, list)) else value}")


def traffic_stats(args) -> int:
    from transformers import AutoTokenizer

    from pipeline.sources import locate
    from pipeline.traffic import encode_prompts, load_traffic, prompt_char_bound

    columns = dict(column.split("=", 1) for column in args.column)
    traffic = load_traffic(args.file, skip_malformed=args.skip_malformed, since=args.since, until=args.until,
                           max_prompt_chars=prompt_char_bound(args.max_tokens), columns=columns or None)
    tokenizer = AutoTokenizer.from_pretrained(locate(args.tokenizer).path)
    ids, truncated = encode_prompts(traffic.requests, tokenizer, max_prompt_tokens=args.max_tokens)
    lengths = np.array([len(x) for x in ids])
    payload = {
        "file": str(traffic.path),
        "requests": len(traffic.requests),
        "formats": traffic.formats,
        "categories": traffic.categories(),
        "train": len(traffic.split("train", args.heldout_fraction)),
        "heldout": len(traffic.split("heldout", args.heldout_fraction)),
        "prompt_tokens": {f"p{q}": int(np.percentile(lengths, q)) for q in (5, 25, 50, 75, 95, 100)},
        f"longer_than_{args.max_tokens}_tokens": truncated,
        "malformed": len(traffic.malformed),
        "duplicates": traffic.duplicates,
        "outside_window": traffic.outside_window,
        "malformed_lines": traffic.malformed[:20],
        "fingerprint": traffic.fingerprint(),
    }
    _print(payload, args.json)
    return 0


def config_show(args) -> int:
    import yaml

    from pipeline.config import load_config, reference_markdown

    if args.reference:
        print(reference_markdown(), end="")
    else:
        print(yaml.safe_dump(load_config(args.config, args.overrides).to_dict(), sort_keys=False), end="")
    return 0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be a positive integer")
    return value


def _column(text: str) -> str:
    from pipeline.traffic_records import COLUMN_NAMES

    field, _, column = text.partition("=")
    if field not in COLUMN_NAMES or not column:
        raise argparse.ArgumentTypeError(f"{text}: FIELD=COLUMN with FIELD one of {', '.join(COLUMN_NAMES)}")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftops",
        description="Keep speculative-decoding drafts fast as their targets change: distill, decode, monitor.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    traffic = sub.add_parser("traffic", help="inspect traffic logs").add_subparsers(dest="action", required=True)
    stats = traffic.add_parser("stats", help="requests, categories, split sizes, prompt lengths, malformed lines")
    stats.add_argument("file", help="traffic (JSONL, ShareGPT JSON, a saved `datasets` folder, parquet, arrow, or a "
                                    "glob of them), or 'default' for the shipped traffic")
    stats.add_argument("--column", action="append", default=[], type=_column, metavar="FIELD=COLUMN",
                       help="a data set's column for draftops' messages, id, category or time (traffic.columns)")
    stats.add_argument("--tokenizer", default="smollm2-135m-instruct", help="model source whose tokenizer counts")
    stats.add_argument("--heldout-fraction", type=float, default=0.1)
    stats.add_argument("--skip-malformed", action="store_true", help="skip and count bad lines instead of failing")
    stats.add_argument("--max-tokens", type=_positive_int, default=32768,
                       help="count a prompt's tokens up to this many (longer ones are counted as this many and "
                            "reported; what bounds the memory a huge request takes)")
    stats.add_argument("--since", help="only requests logged at or after this time (ISO-8601 or epoch s/ms)")
    stats.add_argument("--until", help="only requests logged before this time")
    stats.add_argument("--json", action="store_true")
    stats.set_defaults(handler=traffic_stats)

    config = sub.add_parser("config", help="show the resolved config, or the reference of every key")
    config.add_argument("--reference", action="store_true", help="Markdown table of every key, default and meaning")
    config_options(config)
    config.set_defaults(handler=config_show)

    for command in sorted(entry_points(group=COMMANDS_GROUP), key=lambda ep: ep.name):
        command.load()(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit codes: 0 done, 2 a one-line error (bad input, config, source, registry, traffic, an
    unreachable or failing tracking store, any `pipeline.errors.OperatorError`), 75 the registered model is busy
    (another process holds its lock); the monitor's own (3 DRIFT) are in `monitor.check.decision`."""
    from pipeline.config import ConfigError
    from pipeline.errors import OperatorError
    from pipeline.locks import EXIT_BUSY, ModelBusy
    from pipeline.registry import RegistryError
    from pipeline.sources import SourceError, TokenizerMismatch
    from pipeline.tracking import TrackingUnavailable, store_error_line
    from pipeline.traffic import TrafficError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse fills a command's key=value list in one run of positionals: after `SOURCE --format vllm` (a positional,
    # then options) it has closed, so later key=value words come back unrecognized and are the overrides' rest
    if extra and (not hasattr(args, "overrides") or any(word.startswith("-") or "=" not in word for word in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.handler(args)
    except (ConfigError, OperatorError, RegistryError, SourceError, TokenizerMismatch, TrackingUnavailable,
            TrafficError) as exc:
        print(f"draftops: error: {exc}", file=sys.stderr)
        return 2
    except ModelBusy as exc:
        print(f"draftops: {exc}", file=sys.stderr)
        return EXIT_BUSY
    except Exception as exc:
        line = store_error_line(exc)
        if line is None:
            raise
        print(f"draftops: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
