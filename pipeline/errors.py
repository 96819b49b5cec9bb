"""The error an operator acts on: said in one line, never a traceback.

Every `draftops` command prints an `OperatorError` as `draftops: error: <message>` and exits 2 (`pipeline.cli.main`);
a package above this one subclasses it for its own failures (an inference server that answers what it should not, a
deployment step) so that no command has to list them.
"""
from __future__ import annotations


class OperatorError(RuntimeError):
    """A failure whose message, one line, tells the operator what went wrong and what is kept."""
