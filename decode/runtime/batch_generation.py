"""Offline generation with continuous batching: many prompts through the lean forward, each row of the batch taken by
the next prompt as soon as its sequence ends.

`make distill` spends most of its time generating the target's responses to the traffic (`distill.responses`).
transformers' `generate` runs a batch until its longest sequence ends, finished rows riding along, and grows its KV
cache by concatenation at every step. Here every row of one preallocated cache (`decode.runtime.lean.KVCache`) holds one
sequence at its own length (`LeanDecoder.forward_ragged`); a row whose sequence ends is refilled at once with the next
prompt (prefilled alone, its keys and values copied into the row). Each step records the top-k log-probs of every
row's next-token distribution at temperature 1, the teacher `distill` trains on.

Greedy jobs (temperature 0) take the argmax. Sampled jobs draw from softmax(logits / T) by its inverse CDF at a
uniform number drawn from the job's own seed and step, so a job's tokens do not depend on which row it ran in, what
ran beside it or the batch size: a run cut short and resumed, or run with another batch size, samples the same
responses.

Jobs that share a prompt (several samples per prompt) prefill it once: its keys, values, last logits and captured
features are kept, up to `prefix_bytes`, the oldest dropped first.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from decode.runtime.lean import LeanDecoder, attention_dtype, require_lean
from decode.runtime.step_sampler import inverse_cdf_sample, topk_log_probs


@dataclass(frozen=True)
class Job:
    """One sequence to generate: its prompt, its temperature (0: greedy) and its sampling seed."""

    prompt: list[int]
    temperature: float = 0.0
    seed: int = 0


@dataclass
class Generated:
    """A job's new tokens (ending with a stop id, or `max_new_tokens` long), the top-k log-probs ([n, k] fp16) and
    ids ([n, k] int32) of the distribution each token was chosen from, and with `capture` the hidden states entering
    the captured layers at every position of prompt + tokens ([len(prompt) + n, len(layers) * H] fp16)."""

    tokens: list[int]
    topk_logprobs: torch.Tensor
    topk_indices: torch.Tensor
    features: torch.Tensor | None = None


def _uniform(job: Job, step: int) -> float:
    """The uniform number in [0, 1) a sampled job draws its token at `step` from (hashes of ints are not salted)."""
    return random.Random(hash((job.seed, step))).random()


@dataclass
class _Row:
    """What one row of the batch holds: a job's index (-1: none), its tokens and records so far, and whether its
    last token is still to be fed (only for its features: the job has ended)."""

    job: int = -1
    tokens: list[int] = field(default_factory=list)
    topk: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)
    ended: bool = False


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@torch.inference_mode()
def generate(model, jobs: Sequence[Job], *, max_new_tokens: int, stop_ids: Sequence[int], batch_size: int, topk: int,
             capture: tuple[int, ...] = (), on_done: Callable[[int, Generated], None] | None = None,
             prefix_bytes: int = 2 << 30, progress: bool = False) -> list[Generated]:
    """Every job's continuation, in the order given -> [Generated] by job index.

    Jobs start in the order given (give them sorted by prompt length: rows of similar lengths waste less attention
    on the batch's longest row). `capture`: the layers whose input hidden states are recorded (a feature draft's,
    `decode.models.feature_draft`); a job's last token is then fed once more, for its features alone. `on_done(index,
    generated)` is called as each job ends, before the others have.
    """
    require_lean(model, "continuous batching")
    if not jobs:
        return []
    lean = LeanDecoder(model, cache_dtype=attention_dtype(model))
    device = next(model.parameters()).device
    rows = [_Row() for _ in range(min(batch_size, len(jobs)))]
    cache = lean.new_cache(len(rows))
    cache.reserve(max(len(job.prompt) for job in jobs) + max_new_tokens + 1)
    stops = set(stop_ids)
    results: list[Generated | None] = [None] * len(jobs)
    lengths = torch.zeros(len(rows), dtype=torch.long, device=device)  # cache slots each row has filled
    last = torch.zeros(len(rows), dtype=torch.long, device=device)  # the token each row feeds next
    queue = iter(range(len(jobs)))
    prefixes: OrderedDict[tuple[int, ...], tuple] = OrderedDict()  # prompt -> (keys, values, logits, features)
    kept = 0  # bytes held by `prefixes`
    bar = tqdm(total=len(jobs), desc="target responses", unit="seq", disable=not progress)

    def prefill(prompt: list[int]) -> tuple:
        """The prompt's keys and values per layer ([kv_heads, n, head_dim]), its last logits [1, V] and, with
        `capture`, its features [n, F] (fp16, CPU)."""
        nonlocal kept
        key = tuple(prompt)
        if key in prefixes:
            prefixes.move_to_end(key)
            return prefixes[key]
        alone = lean.new_cache(1)
        tokens = torch.tensor(prompt, dtype=torch.long, device=device)
        if capture:
            logits, features = lean.forward_features(tokens, alone, 0, capture, keep_last=True)
            features = features.half().cpu()
        else:
            logits, features = lean.forward_logits(tokens, alone, 0, keep_last=True), None
        n = len(prompt)
        entry = ([k[0, :, :n].clone() for k in alone.keys], [v[0, :, :n].clone() for v in alone.values], logits,
                 features)
        size = _nbytes(entry[0] + entry[1] + [features])
        if size <= prefix_bytes:
            prefixes[key], kept = entry, kept + size
            while kept > prefix_bytes:
                old_keys, old_values, _, old_features = prefixes.popitem(last=False)[1]
                kept -= _nbytes(old_keys + old_values + [old_features])
        return entry

    def choose(logits: torch.Tensor, live: list[int]) -> list[int]:
        """The next token of each live row from its logits [len(live), V], its top-k recorded."""
        logits = logits.float()
        values, indices = topk_log_probs(logits, topk)
        values, indices = values.half().cpu(), indices.int().cpu()
        temperatures = torch.tensor([jobs[rows[r].job].temperature for r in live])
        sampled = temperatures > 0
        every = bool(sampled.all())
        chosen = torch.empty(len(live), dtype=torch.long) if every else logits.argmax(-1).cpu()
        if sampled.any():
            uniforms = torch.tensor([_uniform(jobs[rows[r].job], len(rows[r].tokens))
                                     for r, s in zip(live, sampled.tolist()) if s], dtype=torch.float64)
            drawn_from = logits if every else logits[sampled.to(logits.device)]
            chosen[sampled] = inverse_cdf_sample(drawn_from, temperatures[sampled], uniforms).cpu()
        for i, r in enumerate(live):
            rows[r].topk.append((values[i], indices[i]))
        return chosen.tolist()

    def finish(r: int) -> None:
        row = rows[r]
        results[row.job] = Generated(row.tokens, torch.stack([v for v, _ in row.topk]),
                                     torch.stack([i for _, i in row.topk]),
                                     torch.cat(row.features) if capture else None)
        index, rows[r] = row.job, _Row()
        bar.update()
        if on_done is not None:
            on_done(index, results[index])

    def advance(r: int, token: int) -> bool:
        """Append `token` to the row's job; True if the row is free again (its job ended and needs no last feed)."""
        row = rows[r]
        row.tokens.append(token)
        last[r] = token
        if token not in stops and len(row.tokens) < max_new_tokens:
            return False
        if capture:  # the last token is fed once more, for its features
            row.ended = True
            return False
        finish(r)
        return True

    def refill(r: int) -> None:
        """Start jobs in a free row until one outlives its first token (or no job is left)."""
        for index in queue:
            keys, values, logits, features = prefill(jobs[index].prompt)
            n = len(jobs[index].prompt)
            for store, own in ((cache.keys, keys), (cache.values, values)):
                for entry, layer in zip(store, own):
                    entry[r, :, :n] = layer
            rows[r].job, lengths[r] = index, n
            if capture:
                rows[r].features.append(features)
            if not advance(r, choose(logits, [r])[0]):
                return
        lengths[r] = 0

    for r in range(len(rows)):
        refill(r)
    while any(row.job >= 0 for row in rows):
        logits, features = lean.forward_ragged_features(last[:, None], cache, lengths, capture)
        active = [r for r, row in enumerate(rows) if row.job >= 0]
        lengths[active] += 1
        if capture:
            step_features = features[:, 0].half().cpu()
            for r in active:
                rows[r].features.append(step_features[r : r + 1])
        live = [r for r in active if not rows[r].ended]
        for r in active:
            if rows[r].ended:
                finish(r)
                refill(r)
        for r, token in zip(live, choose(logits[live, -1], live)):
            if advance(r, token):
                refill(r)
    bar.close()
    return results
