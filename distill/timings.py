"""Wall-clock seconds per phase of a distill job (the summary line's `time:` and the MLflow run's `time_*`)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Timings:
    """Wall-clock seconds per phase of a job, summed over every time the phase ran."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def measure(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
