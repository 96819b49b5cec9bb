"""The response + top-k teacher cache (`distill.data.responses`' format) filled through inference servers.

The cache entry's key holds the engine's identity (`identity.EngineIdentity`: served model, weights and their
fingerprint, quantization, engine version) and the top-k asked, beside the prompts, the generation settings and the
target's fingerprint, so an engine's responses and those of the target in this process never share an entry; the
entry's `engine.json` records the identity, and an entry whose `engine.json` names another engine is refused.

Sample rounds are those of the built-in generator (the first greedy, the others sampled at the generation
temperature, each request with its own seed), saved as `sample-<i>/` when complete. Until then finished responses
are kept in the entry's journal (`journal.Journal`): a run killed and started again loses only the requests in
flight and asks for each missing response once.
"""
from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock

from distill.data.generation import engine
from distill.data.generation.identity import EngineIdentity, common_identity, probe
from distill.data.generation.journal import Journal, Record
from distill.data.responses import (
    ENGINE_FILE,
    DamagedCache,
    ResponseSet,
    concat,
    load_responses,
    prompts_hash,
    response_cache_dir,
    response_set,
    save_responses,
)
from pipeline.config.engine import ResponsesConfig
from pipeline.errors import OperatorError
from pipeline.files import recover_dir, write_text_atomic

JOURNAL_FILE = "engine-journal.jsonl"
log = logging.getLogger(__name__)


class ForeignCache(OperatorError):
    """A cache entry made by another teacher than the one asked for."""


@dataclass
class EngineResponses:
    """What `engine_cached_responses` returns: the responses, their cache entry, whether all came from it, the
    engine that made them and, for the requests sent now, the client's statistics."""

    responses: ResponseSet
    path: Path
    hit: bool
    identity: EngineIdentity
    stats: engine.RunStats | None = None


def connect(cfg: ResponsesConfig) -> tuple[list[engine.Server], EngineIdentity]:
    """Ask every server what it serves: the servers to send to and the identity they share (`identity
    .DifferentTeachers` if they serve different models; `identity.EngineUnavailable` if one does not answer)."""
    identities = {url: probe(url, cfg.api, cfg.model, timeout=min(cfg.timeout, 30.0)) for url in cfg.servers}
    identity = common_identity(identities)
    return [engine.Server(url, ident.api, ident.model) for url, ident in identities.items()], identity


def request_seed(seed: int, sample: int, index: int) -> int:
    """The sampling seed of one request: a function of the job's seed, the round and the prompt (a uint31)."""
    return ((seed + sample) * 1_000_003 + index * 7_919) % (2 ** 31)


def check_entry(path: Path, identity: EngineIdentity) -> None:
    """ForeignCache when the entry at `path` records another engine than `identity`."""
    recorded = path / ENGINE_FILE
    if recorded.exists():
        saved = json.loads(recorded.read_text()).get("identity")
        if saved != identity.key():
            raise ForeignCache(f"{path} holds responses of another teacher ({saved}), not of {identity.tag()}")


def _finished_rounds(path: Path, samples: int) -> list[ResponseSet | None]:
    parts: list[ResponseSet | None] = [None] * samples
    for sample in range(samples):
        part_dir = recover_dir(path / f"sample-{sample}")
        if part_dir.exists():
            try:
                parts[sample] = load_responses(part_dir)
            except DamagedCache as exc:
                log.warning("damaged response cache entry, generated again: %s", exc)
                shutil.rmtree(part_dir)
    return parts


def engine_cached_responses(cfg: ResponsesConfig, target_fingerprint: str, requests: list, prompts: list[list[int]],
                            *, samples: int, max_new_tokens: int, temperature: float, seed: int, topk: int,
                            stop_ids: list[int], vocab_size: int, progress: bool = False) -> EngineResponses:
    """The servers' responses to `prompts` (`samples` each: the first greedy, the rest sampled) with their top-k
    teacher, cached as `distill.data.responses.cached_responses` caches the target's (request ids `<id>#<sample>`).
    The teacher rows hold `cfg.topk` (else `topk`) columns; a position the server returned fewer for is padded with
    log-prob -inf and id -1, which the loss counts in its tail bucket."""
    servers, identity = connect(cfg)
    asked = cfg.topk or topk
    key = prompts_hash(prompts, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                       engine=identity.key(), engine_topk=asked)
    path = response_cache_dir(target_fingerprint, key)
    path.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        check_entry(path, identity)
        write_text_atomic(path / ENGINE_FILE, json.dumps(
            {"identity": identity.key(), "tag": identity.tag(), "servers": cfg.servers, "topk": asked,
             "max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}, indent=1))
        parts = _finished_rounds(path, samples)
        missing = [s for s in range(samples) if parts[s] is None]
        if not missing:
            return EngineResponses(concat(parts), path, True, identity)
        journal = Journal(path / JOURNAL_FILE)
        records = journal.load()
        n = len(prompts)

        def finalize(sample: int) -> None:
            rows = [records[(sample, i)] for i in range(n)]
            part = response_set(prompts, [r.tokens for r in rows], [(r.logprobs, r.indices) for r in rows])
            part.request_ids = [f"{req.id}#{sample}" for req in requests]
            save_responses(part, path / f"sample-{sample}")
            parts[sample] = part

        for sample in missing:
            if all((sample, i) in records for i in range(n)):
                finalize(sample)
        todo = [engine.EngineRequest((s, i), f"{requests[i].id}#{s}", prompts[i], 0.0 if s == 0 else temperature,
                                     request_seed(seed, s, i))
                for s in missing if parts[s] is None for i in range(n) if (s, i) not in records]

        def keep(request: engine.EngineRequest, parsed) -> None:
            values, ids = parsed.teacher_rows(asked)
            record = Record(parsed.tokens, values, ids)
            journal.append(request.key, record)
            records[request.key] = record
            sample = request.key[0]
            if all((sample, i) in records for i in range(n)):
                finalize(sample)

        settings = engine.Settings(max_new_tokens, asked, tuple(stop_ids), vocab_size)
        try:
            stats = engine.generate(servers, todo, settings, on_result=keep, concurrency=cfg.concurrency,
                                    timeout=cfg.timeout, retries=cfg.retries, give_up_after=cfg.give_up_after,
                                    progress=progress)
        finally:
            journal.close()
        unsaved = [s for s in missing if parts[s] is None]
        if unsaved:  # never without an error from the client; the journal stays for the rerun either way
            raise engine.EngineError(f"sample rounds {unsaved} of {path} are incomplete; the journal keeps the "
                                     "finished responses: run again")
        journal.remove()  # every round is saved: the journal has served
        return EngineResponses(concat(parts), path, False, identity, stats)
