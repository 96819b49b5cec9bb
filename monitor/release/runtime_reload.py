"""Reload actions that are HTTP requests, each whole within the reload's deadline: the plain reload request (the
deployment as its JSON body), and the weight-update endpoints through which vLLM and SGLang load a new draft into a
running engine, without a restart (`monitor.deploy.reload: url | vllm | sglang`, `reload_url` the engine's base URL).

vLLM, the draft bracket of its weight-transfer API (vllm-project/vllm#46725; the server runs with
VLLM_SERVER_DEV_MODE=1, which mounts these routes, and `--weight-transfer-config` naming a backend that loads a
checkpoint folder given as `{"path": ...}` and can update a draft):

    POST /pause?mode=keep                                   requests held in the queue, not dropped
    POST /start_draft_weight_update                         the session's weights go to the speculative draft
    POST /update_weights        {"update_info": {"path": FOLDER}}
    POST /finish_weight_update  {"weight_version": "NAME-vN"}
    POST /resume                                            also after a failure, given a few seconds more"""
# SGLang, `/update_weights_from_disk` with `draft_only` (the folder loaded into the draft worker alone, the target and
# its cache untouched; an SGLang that predates the field would load the folder into the target):
#
#     POST /update_weights_from_disk  {"model_path": FOLDER, "draft_only": true, "weight_version": "NAME-vN"}
#                                     -> {"success": true, "message": ...}
#
# Both are the engines' documented request shapes, tested against a fake server that records the requests; neither was
# run against a real engine here (docs/deploy.md).
#
# A request's deadline covers connecting, the headers and the body (`pipeline.deadline_http`, the one HTTP client), so
# a server that trickles its headers cannot hold the deploy (and the model lock it runs under) past `reload_timeout`.
#
from __future__ import annotations

import http.client
import json
import time

from pipeline.deadline_http import Answer, DeadlinePassed, exchange
from pipeline.url_credentials import redact

MAX_ANSWER_BYTES = 1 << 20  # an answer is a status and a few lines of JSON
RESUME_GRACE = 5.0  # seconds a failed vLLM update may still take to resume the engine it paused


class ReloadError(RuntimeError):
    """The reload action failed or ran out of time: one line saying which request or command, and what it answered."""


def request(method: str, url: str, body: dict | None, deadline: float, what: str) -> Answer:
    """One HTTP request, answered whole before `deadline` (a time.monotonic() value), or a ReloadError in one line
    (`pipeline.deadline_http`: connecting, headers and body within the deadline; a redirect is not followed)."""
    shown = redact(url)
    left = deadline - time.monotonic()
    if left <= 0:
        raise ReloadError(f"{what}: no time left within monitor.deploy.reload_timeout")
    data = None if body is None else json.dumps(body).encode()
    try:
        return exchange(url, data=data, method=method, timeout=left, max_bytes=MAX_ANSWER_BYTES,
                        headers={"Content-Type": "application/json"} if data else {})
    except DeadlinePassed:
        raise ReloadError(f"{what}: no whole answer from {shown} within monitor.deploy.reload_timeout") from None
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise ReloadError(f"{what}: {shown}: {type(exc).__name__}: {redact(str(exc))}") from None


def _ok(answer: Answer, what: str, url: str) -> Answer:
    if not 200 <= answer.status < 300:
        raise ReloadError(f"{what}: {redact(url)} answered {answer.said()}")
    return answer


def send_deployment(method: str, url: str, deployment: dict, deadline: float) -> str:
    """`reload: url`: the deployment as the request's JSON body (no body with GET)."""
    answer = _ok(request(method, url, None if method == "GET" else deployment, deadline, "reload request"),
                 "reload request", url)
    return f"{method} {url}: HTTP {answer.status}"


def _endpoint(base: str, path: str) -> str:
    return base.rstrip("/") + path


def push_to_vllm(base: str, folder: str, weight_version: str, deadline: float) -> str:
    """`reload: vllm`: pause, the draft's session (start, the folder, finish), resume (module docstring)."""
    session = [("/start_draft_weight_update", None), ("/update_weights", {"update_info": {"path": folder}}),
               ("/finish_weight_update", {"weight_version": weight_version})]
    _ok(request("POST", _endpoint(base, "/pause?mode=keep"), None, deadline, "vLLM pause"), "vLLM pause",
        _endpoint(base, "/pause"))
    try:
        for path, body in session:
            url = _endpoint(base, path)
            _ok(request("POST", url, body, deadline, f"vLLM {path}"), f"vLLM {path}", url)
    except ReloadError as exc:
        try:
            _resume(base, max(deadline, time.monotonic() + RESUME_GRACE))
        except ReloadError as resume:
            raise ReloadError(f"{exc}; and the engine is still paused: {resume} (POST {base}/resume by hand)") from None
        raise
    _resume(base, deadline)
    return f"vLLM at {base}: draft weights loaded from {folder} (weight version {weight_version})"


def _resume(base: str, deadline: float) -> None:
    url = _endpoint(base, "/resume")
    _ok(request("POST", url, None, deadline, "vLLM resume"), "vLLM resume", url)


def push_to_sglang(base: str, folder: str, weight_version: str, deadline: float) -> str:
    """`reload: sglang`: /update_weights_from_disk with draft_only; its JSON must say success."""
    url = _endpoint(base, "/update_weights_from_disk")
    body = {"model_path": folder, "draft_only": True, "weight_version": weight_version}
    answer = _ok(request("POST", url, body, deadline, "SGLang update_weights_from_disk"),
                 "SGLang update_weights_from_disk", url)
    if answer.json().get("success") is not True:
        raise ReloadError(f"SGLang update_weights_from_disk: {url} answered {answer.said()} without success: true")
    return f"SGLang at {base}: draft weights loaded from {folder} (weight version {weight_version})"
