"""A recommended speculative-decoding setting per concurrency, in the engine's own terms, from an engine sweep.

Below the boundary (the lowest concurrency where the draft's aggregate throughput fell below the target alone's)
speculation is kept, with the number of draft tokens the sweep ran at; from the boundary on it is turned off:

    vLLM       --speculative-config '{..., "num_speculative_tokens": k, "disable_by_batch_size": B}': vLLM's own rule
               turns drafting off once B requests run at once (the boundary), where the installed version has the
               key; each concurrency's own line says whether to draft at all
    llama.cpp  --draft-max k --draft-min 0 (and --model-draft), or no --model-draft past the boundary
    SGLang     --speculative-num-steps k --speculative-num-draft-tokens k+1 --speculative-eagle-topk 1, or no
               --speculative-algorithm past the boundary
"""
from __future__ import annotations

import json

KINDS = ("vllm", "llamacpp", "sglang")


def setting(kind: str, draft_tokens: int, speculate: bool, boundary: int | None) -> str:
    """The command-line setting of engine `kind` at one concurrency (module docstring)."""
    if kind == "vllm":
        if not speculate:
            return "no --speculative-config (speculation off)"
        config = {"num_speculative_tokens": draft_tokens}
        if boundary is not None:
            config["disable_by_batch_size"] = boundary
        return f"--speculative-config '{json.dumps(config)}'"
    if kind == "llamacpp":
        return f"--draft-max {draft_tokens} --draft-min 0" if speculate else "no --model-draft (speculation off)"
    if kind == "sglang":
        if not speculate:
            return "no --speculative-algorithm (speculation off)"
        return (f"--speculative-num-steps {draft_tokens} --speculative-num-draft-tokens {draft_tokens + 1} "
                "--speculative-eagle-topk 1")
    raise ValueError(f"engine kind {kind!r}: one of {', '.join(KINDS)}")


def recommendations(kind: str, draft_tokens: int | dict[int, int], speedups: dict[int, float | None],
                    boundary: int | None) -> dict[int, str]:
    """{concurrency: its setting}: drafting where it paid (speedup >= 1), off where it did not; `draft_tokens` one
    number, or the fastest per concurrency."""
    tokens = draft_tokens if isinstance(draft_tokens, dict) else dict.fromkeys(speedups, draft_tokens)
    return {c: setting(kind, tokens[c], s is not None and s >= 1.0, boundary) for c, s in sorted(speedups.items())}
