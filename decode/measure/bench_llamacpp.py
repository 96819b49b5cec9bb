"""bench's llama.cpp rows: llama-server on the target's GGUF alone and with the draft exported as GGUF, started
where llama.cpp is built, run interleaved with the other rows, and compared with each other."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch

from decode.models.feature_draft import FeatureDraft
from decode.serving.export import GGUF, draft_source, export_format
from decode.serving.llamacpp import Completion, LlamaCppError, LlamaServer, optional_rows, served_target
from pipeline.intervals import paired_speedup

LLAMA_CPP_TARGET_ONLY, LLAMA_CPP_SPECULATIVE = "llama_cpp_target_only", "llama_cpp_speculative"


def llama_cpp_rows(servers: dict[str, LlamaServer], max_new_tokens: int,
                   completions: dict[str, list[Completion]]) -> dict[str, Callable[[list[int]], list[int]]]:
    """Bench methods for started llama.cpp servers (row name -> server): greedy completions of the prompt's token
    ids, each kept in `completions[name]` for its acceptance."""
    def row(name: str, server: LlamaServer) -> Callable[[list[int]], list[int]]:
        def complete(prompt: list[int]) -> list[int]:
            completion = server.complete(prompt, max_new_tokens)
            completions[name].append(completion)
            return completion.tokens
        return complete

    for name in servers:
        completions[name] = []
    return {name: row(name, server) for name, server in servers.items()}


def gguf_draft(draft, vocabulary: Path, folder: Path) -> Path:
    """The layer `draft` (a loaded draft: its source and fingerprint) as a GGUF under `folder`, exported the first
    time and reused while the draft's fingerprint is the one recorded beside it."""
    out, recorded = folder / "draft", folder / "draft.fingerprint"
    if not (recorded.is_file() and recorded.read_text() == draft.fingerprint and any(out.glob("*.gguf"))):
        export_format(draft_source(str(draft.path)), GGUF, out, force=True, vocabulary=vocabulary)
        recorded.write_text(draft.fingerprint)
    return next(out.glob("*.gguf"))


def llama_cpp_servers(mode: str, target: str, draft, gamma: int, folder: Path,
                      stack: contextlib.ExitStack) -> tuple[dict[str, LlamaServer] | None, str | None]:
    """({row: started LlamaServer}, None) for the llama.cpp rows, or (None, why not), by `mode` as
    `decode.serving.llamacpp.optional_rows` takes it: they run where llama-server is built, the draft is a layer draft
    and the target has a GGUF. The servers stop when `stack` closes."""

    def start() -> dict[str, LlamaServer]:
        if draft is None or isinstance(draft.model, FeatureDraft):
            raise LlamaCppError("llama.cpp's draft-model speculation takes a layer draft, not "
                                f"{'prompt lookup' if draft is None else 'a feature draft'}")
        target_file = served_target(target)
        draft_file = gguf_draft(draft, target_file, folder)
        threads = torch.get_num_threads()
        alone = LlamaServer(target_file, threads=threads, log=folder / "target_only.log")
        spec = LlamaServer(target_file, draft=draft_file, draft_max=gamma, threads=threads,
                           log=folder / "speculative.log")
        return {LLAMA_CPP_TARGET_ONLY: stack.enter_context(alone), LLAMA_CPP_SPECULATIVE: stack.enter_context(spec)}

    return optional_rows(mode, start)


def llama_cpp_summary(outputs: dict, seconds: dict, completions: dict[str, list[Completion]], seed: int) -> dict:
    """llama.cpp's speculative row against its own target-only row: paired speedup, outputs equal to it, and the
    acceptance its server reported (drafted and accepted tokens summed over the timed prompts)."""
    spec, alone = outputs[LLAMA_CPP_SPECULATIVE], outputs[LLAMA_CPP_TARGET_ONLY]
    timed_runs = completions[LLAMA_CPP_SPECULATIVE][-len(spec):]  # the warm-up's completion came first
    drafted, accepted = sum(c.drafted for c in timed_runs), sum(c.accepted for c in timed_runs)
    return {
        "speedup_vs_llama_cpp_target_only": paired_speedup(
            [len(o) for o in spec], seconds[LLAMA_CPP_SPECULATIVE], [len(o) for o in alone],
            seconds[LLAMA_CPP_TARGET_ONLY], seed=seed),
        "same_output_as_llama_cpp_target_only": sum(a == b for a, b in zip(spec, alone)),
        "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else float("nan"),
    }
