"""The options every config-driven `draftops` subcommand takes, one definition for every package's command line."""
from __future__ import annotations

import argparse

OVERRIDES_EXAMPLE = "config overrides, e.g. device=cpu"


def config_options(parser: argparse.ArgumentParser, *, overrides: str | None = OVERRIDES_EXAMPLE
                   ) -> argparse.ArgumentParser:
    """`--config FILE` and, unless `overrides` (their help) is None, the dotted key=value overrides on top of it: the
    last positional argument, so add it after a command's own."""
    parser.add_argument("--config", default=None, help="YAML config (default: configs/default.yaml)")
    if overrides is not None:
        parser.add_argument("overrides", nargs="*", metavar="key=value", help=overrides)
    return parser
