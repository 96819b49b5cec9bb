"""Stand-in checks for the service tests, referenced by import path like the real one."""
import time
from pathlib import Path


def _log(cfg, line: str) -> None:
    Path(cfg.monitor.state_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(cfg.monitor.state_dir) / "runs.log", "a") as f:
        f.write(f"{line} {time.time():.3f}\n")


def append_marker(cfg) -> int:
    _log(cfg, "ran")
    return 0


def slow_marker(cfg) -> int:
    _log(cfg, "start")
    time.sleep(1.0)
    _log(cfg, "end")
    return 0


def crash(cfg) -> int:
    _log(cfg, "crash")
    raise RuntimeError("boom")
