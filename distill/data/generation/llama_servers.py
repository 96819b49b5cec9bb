"""llama-server replicas on this machine, serving the target's GGUF to `distill.responses.engine: openai`.

`draftops engine serve --config configs/engine_llamacpp.yaml` starts one llama-server
(`decode.serving.llamacpp.LlamaServer`, the build `make llama-cpp` makes) per loopback URL of the config's
`distill.responses.servers`, each with `distill.responses.concurrency` slots, so that the config and the servers
agree; `--replicas N` starts N on consecutive ports from `--port` instead and prints the servers override to use.
They run until interrupted, or, with a command after `--`, until that command ends (`make distill-engine` runs
distill that way).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from urllib.parse import urlparse

from decode.serving.llamacpp import LlamaServer, served_target

LOOPBACK = ("127.0.0.1", "localhost")


def loopback_ports(servers: list[str]) -> list[int]:
    """The ports of `servers`, which must all be loopback URLs with a port (servers this machine starts)."""
    ports = []
    for url in servers:
        parsed = urlparse(url)
        if parsed.hostname not in LOOPBACK or parsed.port is None:
            raise ValueError(f"{url}: `draftops engine serve` starts servers on this machine, at "
                             "http://127.0.0.1:PORT URLs only")
        ports.append(parsed.port)
    return ports


def servers_override(ports: list[int]) -> str:
    """The config override naming the servers on `ports`."""
    return "distill.responses.servers=[" + ",".join(f"http://127.0.0.1:{p}" for p in ports) + "]"


def replica_threads(replicas: int, threads: int | None) -> int:
    """Threads per server: `threads`, else this machine's CPUs shared between the replicas (at least one)."""
    return threads or max(1, (os.cpu_count() or 1) // replicas)


def serve(target: str, ports: list[int], *, slots: int, slot_context: int = 1024, threads: int | None = None,
          log_dir: Path = Path("outputs/engine"), command: list[str] | None = None,
          model: Path | None = None) -> int:
    """Start a llama-server for `target`'s GGUF (or `model`) on each port, print them, then run `command` (its exit
    status is returned) or wait for an interrupt (0). The servers are stopped either way."""
    gguf = Path(model) if model else served_target(target)
    log_dir.mkdir(parents=True, exist_ok=True)
    per_server = replica_threads(len(ports), threads)
    with ExitStack() as stack:
        for port in ports:
            stack.enter_context(LlamaServer(gguf, slots=slots, context=slots * slot_context, threads=per_server,
                                            port=port, log=log_dir / f"llama-server-{port}.log",
                                            startup_timeout=300.0))
        print(f"draftops engine: {len(ports)} llama-server(s) serving {gguf} on 127.0.0.1 ports "
              f"{', '.join(map(str, ports))}, {slots} slots of {slot_context} tokens and {per_server} thread(s) "
              f"each; logs in {log_dir}\n  distill through them: distill.responses.engine=openai "
              f"{servers_override(ports)}", flush=True)
        if command:
            return subprocess.call(command)
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
        try:
            while not stop:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        print("draftops engine: stopping the servers", file=sys.stderr)
    return 0
