"""An OpenAI-compatible inference server in-process (http.server on 127.0.0.1) for the engine client's tests: vLLM's,
llama-server's or SGLang's endpoints, deterministic responses, and faults on request (errors, hangs, fewer top-k
entries, unknown tokens, responses cut short, answers of the wrong types, bodies that are not JSON, a trickle)."""
from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

VOCAB = 40
STOP = 2


def answer(prompt: list[int], temperature: float, seed: int, max_tokens: int, k: int) -> tuple[list[int], list]:
    """The deterministic response to a request: tokens (ending with STOP unless max_tokens long) and per token its
    top-k [(logprob, id)], best first, holding the token."""
    rng = random.Random(f"{prompt}|{temperature}|{seed if temperature > 0 else 0}")
    length = rng.randint(1, max_tokens)
    tokens = [rng.randrange(3, VOCAB) for _ in range(length)]
    if length < max_tokens or rng.random() < 0.5:
        tokens[-1] = STOP
    top = []
    for token in tokens:
        others = rng.sample([t for t in range(VOCAB) if t != token], k - 1)
        logprobs = sorted((-rng.uniform(0.05, 6.0) for _ in range(k)), reverse=True)
        top.append(list(zip(logprobs, [token, *others])))
    return tokens, top


@dataclass
class Faults:
    """What the server does wrong: `error_first` requests get HTTP 503, `hang_first` sleep `hang_s` first, `cut_first`
    get a body cut short; `topk_cap` entries at most; `bad_token` puts an id outside the vocabulary; `truncate`
    drops the last token of responses that ended with the stop token; `delay_s` before every answer;
    `max_logprobs` rejects requests for more top-k as vLLM does. From request `bad_from` on: `error_status` answers
    that HTTP error, `string_logprobs` writes every log-prob as a string, `no_topk` leaves every top-k row empty,
    `short_topk` cuts one token's row to one entry, `not_json` answers a body that is not JSON, `trickle_s` sends the
    answer (status line and headers too) one byte per that many seconds, `answer_model` names another model. Request
    `string_entry_at` gets a string where one top-k entry belongs."""

    error_first: int = 0
    hang_first: int = 0
    hang_s: float = 5.0
    cut_first: int = 0
    topk_cap: int | None = None
    bad_token: bool = False
    truncate: bool = False
    delay_s: float = 0.0
    max_logprobs: int | None = None  # vLLM's --max-logprobs: a request asking for more gets HTTP 400
    bad_from: int = 1
    error_status: int | None = None
    string_logprobs: bool = False
    no_topk: bool = False
    short_topk: bool = False
    not_json: bool = False
    trickle_s: float = 0.0
    answer_model: str | None = None
    string_entry_at: int = 0


@dataclass
class FakeEngine:
    """The server: `api` is vllm, llamacpp or sglang; `served` its model id; `seen` counts requests per prompt+seed."""

    api: str = "vllm"
    served: str = "fake/model"
    ftype: str = "F32"
    faults: Faults = field(default_factory=Faults)
    seen: Counter = field(default_factory=Counter)
    answered: Counter = field(default_factory=Counter)
    requests: int = 0

    def __post_init__(self):
        self.lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                engine.handle_get(self)

            def do_POST(self):
                engine.handle_post(self)

        class Quiet(ThreadingHTTPServer):
            def handle_error(self, request, client_address):  # a client that timed out and left: not news
                pass

        self.server = Quiet(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeEngine:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ---------------------------------------------------------------- endpoints

    def _send(self, handler, status: int, payload, raw: bytes | None = None, length: int | None = None) -> None:
        """`payload` as JSON, or `raw` bytes announced as `length` (default: twice theirs, a body cut short)."""
        body = raw if raw is not None else json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body) if raw is None else length or len(body) * 2))
        handler.end_headers()
        handler.wfile.write(body)

    @staticmethod
    def _trickle(handler, body: bytes, seconds: float) -> None:
        """The whole answer, status line and headers included, one byte every `seconds`."""
        whole = (f"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                 .encode() + body)
        for i in range(len(whole)):
            handler.wfile.write(whole[i:i + 1])
            handler.wfile.flush()
            time.sleep(seconds)

    def handle_get(self, handler) -> None:
        model = {"id": self.served, "object": "model", "owned_by": self.api, "root": f"/weights/{self.served}",
                 "meta": {"n_vocab": VOCAB, "size": 1234, "n_params": 567}}
        pages = {"/v1/models": {"object": "list", "data": [model]}}
        if self.api == "llamacpp":
            pages["/props"] = {"model_path": f"/nowhere/{self.served}.gguf", "model_ftype": self.ftype,
                               "build_info": "b1-fake", "total_slots": 4}
        if self.api == "sglang":
            pages["/get_model_info"] = {"model_path": f"/weights/{self.served}", "is_generation": True}
            pages["/get_server_info"] = {"quantization": None, "dtype": "bfloat16", "version": "0.0-fake"}
        if self.api == "vllm":
            pages["/version"] = {"version": "0.0-fake"}
        if handler.path in pages:
            self._send(handler, 200, pages[handler.path])
        else:
            self._send(handler, 404, {"error": "not found"})

    def handle_post(self, handler) -> None:
        body = json.loads(handler.rfile.read(int(handler.headers["Content-Length"])))
        f = self.faults
        with self.lock:
            self.requests += 1
            number = self.requests
        if number <= f.error_first:
            return self._send(handler, 503, {"error": "loading model"})
        bad = number >= f.bad_from
        if bad and f.error_status is not None:
            return self._send(handler, f.error_status, {"error": "internal error"})
        if bad and f.not_json:
            page = b"<html>502 Bad Gateway</html>"
            return self._send(handler, 200, None, raw=page, length=len(page))
        if bad and f.trickle_s:
            return self._trickle(handler, json.dumps(self.complete(handler.path, body)).encode(), f.trickle_s)
        if number <= f.hang_first:
            time.sleep(f.hang_s)
        time.sleep(f.delay_s)
        if f.max_logprobs is not None and body.get("logprobs", 0) > f.max_logprobs:
            return self._send(handler, 400, {"object": "error", "message": f"Requested sample logprobs of "
                                             f"{body['logprobs']}, which is greater than max allowed: "
                                             f"{f.max_logprobs}", "type": "BadRequestError", "code": 400})
        try:
            payload = self.complete(handler.path, body, bad=bad, string_entry=number == f.string_entry_at)
        except KeyError as exc:
            return self._send(handler, 400, {"error": f"missing {exc}"})
        if number <= f.cut_first:
            return self._send(handler, 200, None, raw=json.dumps(payload).encode()[:40])
        self._send(handler, 200, payload)

    def complete(self, path: str, body: dict, bad: bool = False, string_entry: bool = False) -> dict:
        if path == "/completion":
            prompt, t, seed = body["prompt"], body["temperature"], body["seed"]
            n, k = body["n_predict"], body["n_probs"]
        elif path == "/generate":
            s = body["sampling_params"]
            prompt, t, seed, n, k = (body["input_ids"], s["temperature"], s["sampling_seed"], s["max_new_tokens"],
                                     body["top_logprobs_num"])
        else:
            prompt, t, seed, n, k = (body["prompt"], body["temperature"], body.get("seed", 0), body["max_tokens"],
                                     body["logprobs"])
        with self.lock:
            self.seen[(tuple(prompt), seed if t > 0 else 0)] += 1
        tokens, top = answer(prompt, t, seed, n, k)
        f = self.faults
        if f.topk_cap is not None:
            top = [row[:f.topk_cap] for row in top]
        if f.bad_token:
            tokens[0] = 100_000
        if f.truncate and tokens[-1] == STOP:
            tokens, top = tokens[:-1], top[:-1]
        if bad and f.no_topk:
            top = [[] for _ in top]
        if bad and f.short_topk and len(top) > 1:
            top[len(top) // 2] = top[len(top) // 2][:1]
        with self.lock:
            self.answered[(tuple(prompt), seed if t > 0 else 0)] += 1
        finish = "stop" if tokens and tokens[-1] == STOP else "length"
        if path == "/completion":
            return {"tokens": tokens, "stop_type": "eos" if finish == "stop" else "limit", "truncated": False,
                    "completion_probabilities": [
                        {"id": tok, "logprob": row[0][0], "top_logprobs": [{"id": i, "logprob": lp} for lp, i in row]}
                        for tok, row in zip(tokens, top)]}
        if path == "/generate":
            return {"output_ids": tokens, "meta_info": {
                "finish_reason": {"type": finish}, "output_token_logprobs": [[row[0][0], tok, None]
                                                                             for tok, row in zip(tokens, top)],
                "output_top_logprobs": [[[lp, i, None] for lp, i in row] for row in top]}}
        rows: list = [{f"token_id:{i}": str(lp) if bad and f.string_logprobs else lp for lp, i in row} for row in top]
        if string_entry:
            rows[0] = "token_id:5"
        return {"object": "text_completion", "model": f.answer_model if bad and f.answer_model else self.served,
                "choices": [{"index": 0, "text": "", "finish_reason": finish, "logprobs": {
                    "tokens": [f"token_id:{tok}" for tok in tokens], "top_logprobs": rows}}]}
