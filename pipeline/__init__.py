"""draftops' shared spine: config, model sources, traffic, MLflow tracking and the CLI."""
import os
from pathlib import Path

__version__ = "0.1.0"


def draftops_home() -> Path:
    """Where caches live: `$DRAFTOPS_HOME`, else `~/.cache/draftops`."""
    return Path(os.environ.get("DRAFTOPS_HOME") or Path.home() / ".cache" / "draftops")
