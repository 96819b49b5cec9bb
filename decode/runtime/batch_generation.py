"""Offline generation with continuous batching: many prompts through the lean forward, each row of the batch taken by
the next prompt as soon as its sequence ends.

`make distill` spends most of its time generating the target's responses to the traffic (`distill.data.responses`).
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


class _Prefills:
    """Prefilled prompts -> (keys and values per layer [kv_heads, n, head_dim], last logits [1, V], with `capture` the
    features [n, F] fp16 on the CPU): jobs sharing a prompt prefill it once. Kept up to `budget` bytes, the least
    recently used dropped first."""

    def __init__(self, lean: LeanDecoder, device: torch.device, capture: tuple[int, ...], budget: int):
        self.lean, self.device, self.capture, self.budget = lean, device, capture, budget
        self.kept: OrderedDict[tuple[int, ...], tuple] = OrderedDict()
        self.kept_bytes = 0

    def __call__(self, prompt: list[int]) -> tuple:
        key = tuple(prompt)
        if key in self.kept:
            self.kept.move_to_end(key)
            return self.kept[key]
        entry = self._prefill(prompt)
        self._keep(key, entry)
        return entry

    def _prefill(self, prompt: list[int]) -> tuple:
        alone = self.lean.new_cache(1)
        tokens = torch.tensor(prompt, dtype=torch.long, device=self.device)
        if self.capture:
            logits, features = self.lean.forward_features(tokens, alone, 0, self.capture, keep_last=True)
            features = features.half().cpu()
        else:
            logits, features = self.lean.forward_logits(tokens, alone, 0, keep_last=True), None
        n = len(prompt)
        return ([k[0, :, :n].clone() for k in alone.keys], [v[0, :, :n].clone() for v in alone.values], logits,
                features)

    def _keep(self, key: tuple[int, ...], entry: tuple) -> None:
        size = _entry_bytes(entry)
        if size > self.budget:
            return
        self.kept[key], self.kept_bytes = entry, self.kept_bytes + size
        while self.kept_bytes > self.budget:
            self.kept_bytes -= _entry_bytes(self.kept.popitem(last=False)[1])


def _entry_bytes(entry: tuple) -> int:
    keys, values, _, features = entry
    return _nbytes(keys + values + [features])


class _ContinuousBatch:
    """The rows of one preallocated cache, each holding one job's sequence at its own length: a row whose job ends is
    refilled at once with the next job of the queue."""

    def __init__(self, lean: LeanDecoder, jobs: Sequence[Job], *, max_new_tokens: int, stop_ids: Sequence[int],
                 batch_size: int, topk: int, capture: tuple[int, ...], prefills: _Prefills,
                 on_done: Callable[[int, Generated], None] | None, bar):
        self.lean, self.jobs, self.max_new_tokens, self.stops = lean, jobs, max_new_tokens, set(stop_ids)
        self.topk, self.capture, self.prefills, self.on_done, self.bar = topk, capture, prefills, on_done, bar
        self.rows = [_Row() for _ in range(min(batch_size, len(jobs)))]
        self.cache = lean.new_cache(len(self.rows))
        self.cache.reserve(max(len(job.prompt) for job in jobs) + max_new_tokens + 1)
        self.results: list[Generated | None] = [None] * len(jobs)
        self.lengths = torch.zeros(len(self.rows), dtype=torch.long, device=prefills.device)  # cache slots filled
        self.last = torch.zeros(len(self.rows), dtype=torch.long, device=prefills.device)  # the token fed next
        self.queue = iter(range(len(jobs)))

    def busy(self) -> bool:
        return any(row.job >= 0 for row in self.rows)

    def step(self) -> None:
        """Feed every row its last token: rows whose job had ended are refilled, the others take their next token."""
        logits, features = self.lean.forward_ragged_features(self.last[:, None], self.cache, self.lengths,
                                                             self.capture)
        active = [r for r, row in enumerate(self.rows) if row.job >= 0]
        self.lengths[active] += 1
        if self.capture:
            step_features = features[:, 0].half().cpu()
            for r in active:
                self.rows[r].features.append(step_features[r : r + 1])
        live = [r for r in active if not self.rows[r].ended]
        for r in active:
            if self.rows[r].ended:
                self.finish(r)
                self.refill(r)
        for r, token in zip(live, self.choose(logits[live, -1], live)):
            if self.advance(r, token):
                self.refill(r)

    def refill(self, r: int) -> None:
        """Start jobs in free row `r` until one outlives its first token (or no job is left)."""
        for index in self.queue:
            prompt = self.jobs[index].prompt
            keys, values, logits, features = self.prefills(prompt)
            for store, own in ((self.cache.keys, keys), (self.cache.values, values)):
                for entry, layer in zip(store, own):
                    entry[r, :, : len(prompt)] = layer
            self.rows[r].job, self.lengths[r] = index, len(prompt)
            if self.capture:
                self.rows[r].features.append(features)
            if not self.advance(r, self.choose(logits, [r])[0]):
                return
        self.lengths[r] = 0

    def choose(self, logits: torch.Tensor, live: list[int]) -> list[int]:
        """The next token of each live row from its logits [len(live), V], its top-k recorded."""
        logits = logits.float()
        values, indices = topk_log_probs(logits, self.topk)
        values, indices = values.half().cpu(), indices.int().cpu()
        jobs = [self.jobs[self.rows[r].job] for r in live]
        temperatures = torch.tensor([job.temperature for job in jobs])
        sampled = temperatures > 0
        every = bool(sampled.all())
        chosen = torch.empty(len(live), dtype=torch.long) if every else logits.argmax(-1).cpu()
        if sampled.any():
            uniforms = torch.tensor([_uniform(job, len(self.rows[r].tokens))
                                     for job, r, s in zip(jobs, live, sampled.tolist()) if s], dtype=torch.float64)
            drawn_from = logits if every else logits[sampled.to(logits.device)]
            chosen[sampled] = inverse_cdf_sample(drawn_from, temperatures[sampled], uniforms).cpu()
        for i, r in enumerate(live):
            self.rows[r].topk.append((values[i], indices[i]))
        return chosen.tolist()

    def advance(self, r: int, token: int) -> bool:
        """Append `token` to the row's job; True if the row is free again (its job ended and needs no last feed)."""
        row = self.rows[r]
        row.tokens.append(token)
        self.last[r] = token
        if token not in self.stops and len(row.tokens) < self.max_new_tokens:
            return False
        if self.capture:  # the last token is fed once more, for its features
            row.ended = True
            return False
        self.finish(r)
        return True

    def finish(self, r: int) -> None:
        row = self.rows[r]
        generated = Generated(row.tokens, torch.stack([v for v, _ in row.topk]), torch.stack([i for _, i in row.topk]),
                              torch.cat(row.features) if self.capture else None)
        self.results[row.job], self.rows[r] = generated, _Row()
        self.bar.update()
        if self.on_done is not None:
            self.on_done(row.job, generated)


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
    prefills = _Prefills(lean, next(model.parameters()).device, capture, prefix_bytes)
    with tqdm(total=len(jobs), desc="target responses", unit="seq", disable=not progress) as bar:
        batch = _ContinuousBatch(lean, jobs, max_new_tokens=max_new_tokens, stop_ids=stop_ids, batch_size=batch_size,
                                 topk=topk, capture=capture, prefills=prefills, on_done=on_done, bar=bar)
        for r in range(len(batch.rows)):
            batch.refill(r)
        while batch.busy():
            batch.step()
    return batch.results
