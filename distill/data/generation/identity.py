"""Which model an inference server serves, asked of the server itself: part of the response cache's key and of the
distilled draft's lineage in MLflow, so that responses of a Q4 server are never read as those of the fp32 target.

- llama-server: `/props` (the GGUF's path, its file type: F32, Q8_0, Q4_K_M ...) and `/v1/models` (its id, size and
  parameter count). Where the GGUF lies on this machine (a loopback server) its content is fingerprinted too.
- SGLang: `/get_model_info` (the weights' path) and `/get_server_info` (quantization, dtype).
- vLLM: `/version` and `/v1/models` (the served id and `root`, the weights it was started from).

Every server of one job must serve the same model: one teacher per data set.
"""
from __future__ import annotations

import hashlib
import http.client
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.deadline_http import DeadlinePassed, exchange
from pipeline.errors import OperatorError

API_KINDS = ("vllm", "sglang", "llamacpp")
FINGERPRINT_BYTES = 4 << 20  # a GGUF is fingerprinted by its size and its first and last 4 MiB


class EngineUnavailable(OperatorError):
    """A server that cannot be reached or does not say what it serves: the message names it."""


class DifferentTeachers(OperatorError):
    """Servers of one job that serve different models."""


def get_json(url: str, timeout: float = 10.0) -> dict | list | None:
    """GET `url` -> its JSON, or None for a 404/405 or a body that is not JSON (the server has no such endpoint);
    EngineUnavailable when nothing answers whole within `timeout` seconds (connecting, headers and body)."""
    try:
        answer = exchange(url, timeout=timeout)
    except DeadlinePassed as exc:
        raise EngineUnavailable(f"{url}: {exc}") from None
    except (OSError, http.client.HTTPException) as exc:
        raise EngineUnavailable(f"{url}: {type(exc).__name__}: {exc}") from None
    if answer.status in (404, 405, 501):
        return None
    if not 200 <= answer.status < 300:
        raise EngineUnavailable(f"{url}: HTTP {answer.status} {answer.reason}")
    try:
        return json.loads(answer.body)
    except (ValueError, RecursionError):
        return None


def _object(value) -> dict:
    """A JSON object a server answered, or {} for anything else (an endpoint it does not have)."""
    return value if isinstance(value, dict) else {}


def file_fingerprint(path: Path) -> str:
    """sha256 over a file's size and its first and last FINGERPRINT_BYTES: cheap on a multi-GB GGUF, and any
    re-quantization or other weights change them."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(0, size - FINGERPRINT_BYTES))
        digest.update(f.read(FINGERPRINT_BYTES))
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class EngineIdentity:
    """What a server generates with: its API kind, the served model id, the weights (path, and a content
    fingerprint where the file is readable here), their quantization and the engine's version ("" where the server
    does not say)."""

    api: str
    model: str
    weights: str = ""
    fingerprint: str = ""
    quantization: str = ""
    version: str = ""

    def key(self) -> dict:
        """The part of the response cache key that names the teacher."""
        return asdict(self)

    def tag(self) -> str:
        """One line for MLflow's lineage tag, e.g. `llamacpp smollm2.gguf (Q8_0, 1a2b3c4d5e6f7a8b)`."""
        details = ", ".join(part for part in (self.quantization, self.fingerprint) if part)
        name = Path(self.weights).name if self.weights else self.model
        return f"{self.api} {name}" + (f" ({details})" if details else "")


def detect_api(base: str, timeout: float = 10.0) -> str:
    """Which server answers at `base`: llama-server (its /props), SGLang (/get_model_info), else vLLM's format (any
    OpenAI-compatible server with /v1/completions)."""
    props = _object(get_json(f"{base}/props", timeout))
    if "model_path" in props or "build_info" in props:
        return "llamacpp"
    info = _object(get_json(f"{base}/get_model_info", timeout))
    if "model_path" in info:
        return "sglang"
    return "vllm"


def _served_models(base: str, timeout: float) -> list[dict]:
    listed = _object(get_json(f"{base}/v1/models", timeout)).get("data")
    return [model for model in listed if isinstance(model, dict)] if isinstance(listed, list) else []


def _pick_model(base: str, models: list[dict], wanted: str | None) -> dict:
    ids = [m.get("id") for m in models]
    if wanted is None:
        if not models:
            raise EngineUnavailable(f"{base}/v1/models lists no model")
        return models[0]
    for model in models:
        aliases = model.get("aliases")
        if wanted == model.get("id") or (isinstance(aliases, list) and wanted in aliases):
            return model
    raise EngineUnavailable(f"{base} does not serve {wanted!r} (it serves {', '.join(map(str, ids)) or 'nothing'})")


def probe(base: str, api: str = "auto", model: str | None = None, timeout: float = 10.0) -> EngineIdentity:
    """The identity of the server at `base` (its API kind detected when `api` is "auto"; `model`: the served model
    name to use, None: the first listed)."""
    kind = detect_api(base, timeout) if api == "auto" else api
    if kind not in API_KINDS:
        raise ValueError(f"unknown server API {api!r} (one of auto, {', '.join(API_KINDS)})")
    listed = _served_models(base, timeout)
    served = _pick_model(base, listed, model) if listed or model or kind != "sglang" else {}
    if kind == "llamacpp":
        props = _object(get_json(f"{base}/props", timeout))
        path = str(props.get("model_path", ""))
        local = Path(path)
        fingerprint = file_fingerprint(local) if path and local.is_file() else ""
        if not fingerprint:  # a remote server: what it says of the file stands in for its content
            meta = _object(served.get("meta"))
            fingerprint = f"size-{meta.get('size', '?')}-params-{meta.get('n_params', '?')}"
        return EngineIdentity("llamacpp", str(served.get("id", "")), path, fingerprint,
                              str(props.get("model_ftype", "")), str(props.get("build_info", "")))
    if kind == "sglang":
        info = _object(get_json(f"{base}/get_model_info", timeout))
        server = _object(get_json(f"{base}/get_server_info", timeout)) or _object(
            get_json(f"{base}/server_info", timeout))
        quantization = "/".join(str(server.get(key) or "") for key in ("quantization", "dtype", "kv_cache_dtype"))
        return EngineIdentity("sglang", str(served.get("id") or info.get("model_path", "")),
                              str(info.get("model_path", "")), quantization=quantization.strip("/"),
                              version=str(server.get("version", "")))
    version = _object(get_json(f"{base}/version", timeout))
    return EngineIdentity("vllm", str(served.get("id", "")), str(served.get("root") or served.get("id", "")),
                          version=str(version.get("version", "")))


def common_identity(identities: dict[str, EngineIdentity]) -> EngineIdentity:
    """The one identity all servers share; DifferentTeachers naming two that differ."""
    items = list(identities.items())
    first_url, first = items[0]
    for url, identity in items[1:]:
        if identity.key() != first.key():
            raise DifferentTeachers(f"the servers serve different models: {first_url} {first.tag()}, {url} "
                             f"{identity.tag()}; one data set has one teacher")
    return first
