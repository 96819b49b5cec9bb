"""Offline generation with continuous batching: many prompts through the lean forward, each row of the batch taken by
the next prompt as soon as its sequence ends.

`make distill` spends most of its time generating the target's responses to the traffic (`distill.responses`).
transformers' `generate` runs a batch until its longest sequence ends, finished rows riding along, and grows its KV
cache by concatenation at every step. Here every row of one preallocated cache (`decode.lean.KVCache`) holds one
sequence at its own length (`LeanLlama.forward_ragged`); a row whose sequence ends is refilled at once with the next
prompt (prefilled alone, its keys and values copied into the row). Each step records the top-k log-probs of every
row's next-token distribution at temperature 1, the teacher `distill` trains on.

Greedy jobs (temperature 0) take the argmax. Sampled jobs draw from softmax(logits / T) by its inverse CDF at a
uniform number drawn from the job's own seed and step, so a job's tokens do not depend on which row it ran in, what
ran beside it or the batch size: a run cut short and resumed, or run with another batch size, samples the same
responses.

Jobs that share a prompt (several samples per prompt) prefill it once: its keys, values and last logits are kept,
up to `prefix_bytes`, the oldest dropped first.
"""
from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from decode.lean import LeanLlama


@dataclass(frozen=True)
class Job:
    """One sequence to generate: its prompt, its temperature (0: greedy) and its sampling seed."""

    prompt: list[int]
    temperature: float = 0.0
    seed: int = 0


@dataclass
class Generated:
    """A job's new tokens (ending with a stop id, or `max_new_tokens` long) and the top-k log-probs ([n, k] fp16)
    and ids ([n, k] int32) of the distribution each token was chosen from."""

    tokens: list[int]
    topk_logprobs: torch.Tensor
    topk_indices: torch.Tensor


def supports(model) -> bool:
    """Whether `generate` runs this model (the lean forward's architectures)."""
    return LeanLlama.supports(model)


def _uniform(job: Job, step: int) -> float:
    """The uniform number in [0, 1) a sampled job draws its token at `step` from (hashes of ints are not salted)."""
    return random.Random(hash((job.seed, step))).random()


@torch.inference_mode()
def generate(model, jobs: Sequence[Job], *, max_new_tokens: int, stop_ids: Sequence[int], batch_size: int, topk: int,
             on_done: Callable[[int, Generated], None] | None = None, prefix_bytes: int = 2 << 30,
             progress: bool = False) -> list[Generated]:
    """Every job's continuation, in the order given -> [Generated] by job index.

    Jobs start in the order given (give them sorted by prompt length: rows of similar lengths waste less attention
    on the batch's longest row). `on_done(index, generated)` is called as each job ends, before the others have.
    """
    if not supports(model):
        raise ValueError("continuous batching runs the lean forward: it needs a Llama-architecture model in eval mode")
    if not jobs:
        return []
    lean = LeanLlama(model)
    device = next(model.parameters()).device
    rows = min(batch_size, len(jobs))
    cache = lean.new_cache(rows)
    cache.reserve(max(len(job.prompt) for job in jobs) + max_new_tokens)
    stops = set(stop_ids)
    results: list[Generated | None] = [None] * len(jobs)
    row_job = [-1] * rows  # the job each row holds, -1: none
    row_tokens: list[list[int]] = [[] for _ in range(rows)]
    row_topk: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(rows)]
    lengths = torch.zeros(rows, dtype=torch.long, device=device)  # cache slots each row has filled
    last = torch.zeros(rows, dtype=torch.long, device=device)  # the token each row feeds next
    queue = iter(range(len(jobs)))
    prefixes: OrderedDict[tuple[int, ...], tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]] = OrderedDict()
    kept = 0  # bytes held by `prefixes`
    bar = tqdm(total=len(jobs), desc="target responses", unit="seq", disable=not progress)

    def choose(logits: torch.Tensor, active: list[int]) -> list[int]:
        """The next token of each active row from its logits [len(active), V], its top-k recorded."""
        values, indices = torch.log_softmax(logits.float(), -1).topk(topk, dim=-1)
        values, indices = values.half().cpu(), indices.int().cpu()
        chosen = logits.argmax(-1).cpu()
        sampled = [i for i, row in enumerate(active) if jobs[row_job[row]].temperature > 0]
        if sampled:
            sampled_jobs = [jobs[row_job[active[i]]] for i in sampled]
            temperatures = torch.tensor([job.temperature for job in sampled_jobs], dtype=torch.float64)
            cdf = torch.softmax(logits[sampled].double().cpu() / temperatures[:, None], -1).cumsum(-1)
            draws = torch.tensor([[_uniform(job, len(row_tokens[active[i]]))] for job, i in zip(sampled_jobs, sampled)],
                                 dtype=torch.float64) * cdf[:, -1:]
            chosen[sampled] = torch.searchsorted(cdf, draws, right=True)[:, 0].clamp_(max=cdf.shape[-1] - 1)
        for i, row in enumerate(active):
            row_topk[row].append((values[i], indices[i]))
        return chosen.tolist()

    def advance(row: int, token: int) -> bool:
        """Append `token` to the row's sequence; True if that ended its job (the row is free again)."""
        row_tokens[row].append(token)
        if token not in stops and len(row_tokens[row]) < max_new_tokens:
            last[row] = token
            return False
        index = row_job[row]
        results[index] = Generated(row_tokens[row], torch.stack([v for v, _ in row_topk[row]]),
                                   torch.stack([i for _, i in row_topk[row]]))
        row_job[row], row_tokens[row], row_topk[row] = -1, [], []
        bar.update()
        if on_done is not None:
            on_done(index, results[index])
        return True

    def prefill(prompt: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """The prompt's keys and values per layer ([kv_heads, n, head_dim]) and its last logits [1, V]."""
        nonlocal kept
        key = tuple(prompt)
        if key in prefixes:
            prefixes.move_to_end(key)
            return prefixes[key]
        alone = lean.new_cache(1)
        logits = lean.forward_logits(torch.tensor(prompt, dtype=torch.long, device=device), alone, 0, keep_last=True)
        n = len(prompt)
        entry = ([k[0, :, :n].clone() for k in alone.keys], [v[0, :, :n].clone() for v in alone.values], logits)
        size = sum(t.numel() * t.element_size() for t in entry[0] + entry[1])
        if size <= prefix_bytes:
            prefixes[key], kept = entry, kept + size
            while kept > prefix_bytes:
                old_keys, old_values, _ = prefixes.popitem(last=False)[1]
                kept -= sum(t.numel() * t.element_size() for t in old_keys + old_values)
        return entry

    def refill(row: int) -> None:
        """Start jobs in a free row until one outlives its first token (or no job is left)."""
        for index in queue:
            keys, values, logits = prefill(jobs[index].prompt)
            n = len(jobs[index].prompt)
            for store, own in ((cache.keys, keys), (cache.values, values)):
                for entry, layer in zip(store, own):
                    entry[row, :, :n] = layer
            row_job[row], lengths[row] = index, n
            if not advance(row, choose(logits, [row])[0]):
                return
        lengths[row] = 0

    for row in range(rows):
        refill(row)
    while any(job >= 0 for job in row_job):
        logits = lean.forward_ragged(last[:, None], cache, lengths)[:, -1]
        active = [row for row in range(rows) if row_job[row] >= 0]
        lengths[active] += 1
        for row, token in zip(active, choose(logits[active], active)):
            if advance(row, token):
                refill(row)
    bar.close()
    return results
