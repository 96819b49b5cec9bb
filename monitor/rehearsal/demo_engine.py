"""The serving side of `make serve-demo`: llama-server as the engine, a reload endpoint that restarts it with the
deployed draft, a bounded traffic replayer, and the target update written as the GGUF it serves.

`ServedEngine` runs `llama-server` (decode.serving.llamacpp) on one loopback port for its whole life, so that the
monitor's `server_metrics_url` stays valid across restarts (each restart starts the counters at zero, which the engine
check reads as a restart). A small HTTP endpoint on another loopback port is the deploy's reload action
(`monitor.deploy.reload_url`): `POST /reload` with the deployment's JSON body restarts llama-server with the body's
`file` as the draft and answers once it is healthy. `pin_draft` makes it restart with another file than it is told
(a deployment that went wrong), to rehearse what the post-deploy check catches.

`Replayer` sends the shipped held-out prompts to the engine, cycling through them, greedy (top-k 1) up to
decode.max_new_tokens each, as the offline measurement decodes them: a fixed number of requests per engine-check
window (the demo's windows are a number of requests, not seconds), and never more than `max_requests` in all.
"""
from __future__ import annotations

import http.server
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from decode.serving.gguf import write_llama_gguf
from decode.serving.llamacpp import Completion, LlamaServer, free_port
from pipeline.files import temporary_sibling

log = logging.getLogger("draftops.monitor")


class ServedEngine:
    """llama-server for `target` (and `draft`) on a fixed loopback port, restartable; a reload endpoint beside it."""

    def __init__(self, target: Path, *, draft: Path | None = None, draft_max: int = 5, threads: int | None = None,
                 log_dir: Path, draft_p_min: float = 0.0):
        self.target, self.draft, self.draft_max, self.threads = Path(target), draft, draft_max, threads
        self.draft_p_min = draft_p_min
        self.port = free_port()
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.server: LlamaServer | None = None
        self.starts = 0
        self.pin_draft: Path | None = None  # restart with this file whatever the reload asks (a wrong deployment)
        self.reloads: list[dict] = []
        self._control: http.server.ThreadingHTTPServer | None = None
        self._lock = threading.Lock()

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    @property
    def reload_url(self) -> str:
        return f"http://127.0.0.1:{self._control.server_port}/reload"

    def restart(self, *, target: Path | None = None, draft: Path | None = None) -> None:
        """Stop llama-server (if running) and start it again with the given target and draft (else the same)."""
        with self._lock:
            self.target = Path(target) if target is not None else self.target
            self.draft = Path(draft) if draft is not None else self.draft
            if self.server is not None:
                self.server.__exit__(None, None, None)
            self.starts += 1
            self.server = LlamaServer(self.target, draft=self.draft, draft_max=self.draft_max, threads=self.threads,
                                      port=self.port, draft_p_min=self.draft_p_min,
                                      log=self.log_dir / f"llama-server-{self.starts}.log").__enter__()
            log.info("engine: llama-server on port %d with target %s, draft %s", self.port, self.target.name,
                     self.draft.name if self.draft else None)

    def __enter__(self) -> ServedEngine:
        engine = self

        class Reload(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                try:
                    asked = Path(body["file"])
                    engine.restart(draft=engine.pin_draft or asked)
                    engine.reloads.append({**body, "served": str(engine.draft)})
                    code, answer = 200, {"served": str(engine.draft)}
                except Exception as exc:  # the deploy reports the error it gets
                    code, answer = 500, {"error": f"{type(exc).__name__}: {exc}"}
                data = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self._control = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Reload)
        threading.Thread(target=self._control.serve_forever, daemon=True).start()
        self.restart()
        return self

    def __exit__(self, *exc) -> None:
        if self._control is not None:
            self._control.shutdown()
            self._control.server_close()
            self._control = None
        if self.server is not None:
            self.server.__exit__(None, None, None)
            self.server = None

    def complete(self, prompt: list[int], max_new_tokens: int) -> Completion:
        with self._lock:
            return self.server.complete(prompt, max_new_tokens)


@dataclass
class Replayer:
    """Held-out prompts replayed to the engine, `per_window` requests per engine-check window."""

    engine: ServedEngine
    prompts: list[list[int]]
    max_new_tokens: int
    per_window: int = 6
    max_requests: int = 2000
    sent: int = 0
    completions: list[Completion] = field(default_factory=list)
    seconds: float = 0.0

    def window(self, seconds: float = 0.0) -> None:
        """One window's traffic (the `wait` of the engine check; its length in seconds is not used here)."""
        start = time.perf_counter()
        for _ in range(self.per_window):
            if self.sent >= self.max_requests:
                break
            self.completions.append(self.engine.complete(self.prompts[self.sent % len(self.prompts)],
                                                         self.max_new_tokens))
            self.sent += 1
        self.seconds += time.perf_counter() - start


def write_target_gguf(checkpoint: Path, vocabulary: Path, out: Path, dtype: str = "f16") -> Path:
    """An updated target's Hugging Face checkpoint as the GGUF llama-server serves (its vocabulary from the original
    target's GGUF, whose tokenizer it kept), written beside `out` and renamed into place. f16 by default: the engine
    then computes the target the checkpoint is, as the f16 draft beside it (a Q8_0 target costs a copy of itself as
    draft part of its engine acceptance, near-tied tokens flipping: docs/deploy.md)."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    scratch = temporary_sibling(out)
    scratch.mkdir()
    written = write_llama_gguf(model.state_dict(), model.config, vocabulary, scratch / out.name, dtype=dtype,
                               name=f"updated target {checkpoint.name}")
    written.replace(out)
    scratch.rmdir()
    return out
