"""Lossless speculative decoding (Leviathan et al. 2022; Chen et al. 2023) for batch size 1.

Cache invariant between rounds: the target's KV cache holds every token but the last one (the "pending" token), and
the draft's cache holds a prefix of the sequence that misses one or two tokens; each model is fed exactly the tokens
it has not seen yet, at explicit positions, and rejected drafts are rolled back with `cache.crop`.

The proposals come from a drafter: `ModelDrafter` wraps a draft LM; a model-free proposer (decode.ngram) has the
same three methods, `start`, `propose` and `rollback`, and returns one-hot q for its deterministic proposals.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from decode.ngram import LookupThenModelDrafter, lookup_first_drafter
from decode.runtime import ModelRunner, rollback
from decode.sampling import sample, to_target_vocab, warp_logits
from decode.stats import GenerationStats


@dataclass(frozen=True)
class Warp:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return warp_logits(logits, self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def confident(draft_logits: torch.Tensor, min_confidence: float) -> bool:
    """Whether the draft's top probability (softmax at temperature 1) reaches `min_confidence`: a weak draft's
    confidence predicts its acceptance, so stopping a block where it is unsure saves draft steps and verify width."""
    return draft_logits.float().softmax(-1).max().item() >= min_confidence


@dataclass
class AdaptiveGamma:
    """Stop a draft block early when the draft is unsure, and move γ with the last block's outcome.

    The draft stops once its max probability falls under `min_confidence` (`confident`); after each block γ grows by 2
    when every draft was accepted and shrinks by 1 otherwise (HF's "heuristic" schedule).
    """

    min_confidence: float = 0.4
    min_gamma: int = 1
    max_gamma: int = 16

    def next_gamma(self, gamma: int, n_drafted: int, n_accepted: int) -> int:
        step = 2 if n_accepted == n_drafted else -1
        return max(self.min_gamma, min(self.max_gamma, gamma + step))


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)


def verify(
    p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling test of k drafts, all on device.

    p: target probs [k+1, V]; q: draft probs [k, V]; drafts: [k].
    Returns (accepted [k] bool, per-position next token [k+1]): for i < k the token drawn from norm(max(0, p_i − q_i))
    used if draft i is the first rejection, and for i = k the bonus token drawn from p_k. With greedy warping p and q
    are one-hot, so this reduces to "accept iff draft == target argmax" and the correction is the target argmax.
    """
    k = drafts.shape[0]
    rows = torch.arange(k, device=drafts.device)
    p_draft = p[rows, drafts]
    q_draft = q[rows, drafts]
    uniform = torch.rand(k, device=p.device, generator=generator)
    accepted = uniform * q_draft < p_draft  # u < p/q without dividing by q
    residual = (p[:k] - q).clamp_(min=0)
    mass = residual.sum(-1, keepdim=True)
    # A zero residual (p ≤ q everywhere, reachable only through rounding) falls back to p.
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p[:k])
    next_tokens = sample(torch.cat([residual, p[k:]]), generator)
    return accepted, next_tokens


def verify_greedy(p: torch.Tensor, drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify` for one-hot (greedy) p and q, without drawing random numbers: accept a draft iff it is the target's
    argmax; every next token is the target's argmax. p may be the target's logits (same argmax). Same result as
    `verify` (tested), which on a 49k vocabulary spends ~1 ms a round drawing exponentials it does not need."""
    targets = p.argmax(-1)
    return drafts == targets[: drafts.shape[0]], targets


def check_drafts(target_logits: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, warp: Warp,
                 generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One round's test of the drafts against the target's logits [k+1, V]: `verify_greedy` when greedy, else
    `verify` on the warped distributions. The decoder and `draftops sweep`'s cost measurement both run this."""
    if warp.greedy:
        return verify_greedy(target_logits, drafts)
    return verify(warp(target_logits), q, drafts, generator)


def first_stop(tokens: list[int], eos_token_ids: frozenset[int]) -> int | None:
    """Index just past the first EOS in tokens, or None."""
    for i, token in enumerate(tokens):
        if token in eos_token_ids:
            return i + 1
    return None


def stop_string_cut(tokenizer, generated: list[int], n_old: int, stop_strings: Sequence[str]) -> int | None:
    """Smallest length > n_old of `generated` whose decoded text contains a stop string, or None."""
    if not any(s in tokenizer.decode(generated) for s in stop_strings):
        return None
    for length in range(n_old + 1, len(generated) + 1):
        text = tokenizer.decode(generated[:length])
        if any(s in text for s in stop_strings):
            return length
    return None


def _model_context(model) -> int | None:
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def _output_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def scheduled_gamma(schedule: Sequence[tuple[int, int]], length: int) -> int:
    """γ of the first (max_context, γ) entry whose max_context is at least `length`; the last γ beyond them."""
    for max_context, gamma in schedule:
        if length <= max_context:
            return gamma
    return schedule[-1][1]


def check_gamma_schedule(schedule: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    schedule = [(int(m), int(g)) for m, g in schedule]
    if not schedule or any(g < 1 for _, g in schedule) or any(a[0] >= b[0] for a, b in zip(schedule, schedule[1:])):
        raise ValueError(
            f"gamma_schedule must be non-empty [(max_context, gamma), ...] with increasing max_context and gamma >= 1, "
            f"got {schedule}")
    return schedule


class ModelDrafter:
    """A draft LM proposing tokens autoregressively through its own KV cache (the drafter the decoder wraps)."""

    def __init__(self, draft, vocab_size: int, device: torch.device, *, token_ids: torch.Tensor | None = None,
                 min_confidence: float | None = None, lean: bool = True):
        """min_confidence: end a block at the first draft token after the first whose top probability is below this
        (`confident`); lean: see `ModelRunner`."""
        if next(draft.parameters()).device != device:
            raise ValueError(f"target is on {device} but draft on {next(draft.parameters()).device}")
        draft_size = _output_size(draft)
        draft_inputs = draft.get_input_embeddings().num_embeddings
        if draft_inputs < vocab_size:
            raise ValueError(
                f"vocab mismatch: draft embeds {draft_inputs} token ids but the target emits {vocab_size}"
            )
        if token_ids is None:
            if draft_size != vocab_size:
                raise ValueError(
                    f"vocab mismatch: draft predicts {draft_size} tokens, target {vocab_size}; "
                    "pass draft_token_ids for a reduced-vocab draft"
                )
        else:
            token_ids = torch.as_tensor(token_ids, dtype=torch.long)
            if token_ids.ndim != 1 or token_ids.numel() != draft_size:
                raise ValueError(
                    f"vocab mismatch: draft predicts {draft_size} tokens but draft_token_ids has "
                    f"{token_ids.numel()} entries"
                )
            if not bool((token_ids[1:] > token_ids[:-1]).all()) or not (
                0 <= int(token_ids[0]) and int(token_ids[-1]) < vocab_size
            ):
                raise ValueError(f"draft_token_ids must be sorted, unique and inside [0, {vocab_size})")
            token_ids = token_ids.to(device)
        self.model, self.vocab_size, self.device = draft, vocab_size, device
        self.token_ids, self.min_confidence = token_ids, min_confidence
        self.context = _model_context(draft)
        self.runner = ModelRunner(draft, lean)

    def start(self, prompt: list[int]):
        """The draft's cache after every prompt token but the last."""
        cache = self.runner.new_cache()
        if len(prompt) > 1:
            self.runner.forward(torch.tensor(prompt[:-1], device=self.device), cache, 0, True)
        return cache

    def propose(self, cache: DynamicCache, seq: list[int], k: int, warp: Warp, generator):
        """Up to k drafts, feeding the draft the tokens it has not seen yet.

        Returns (drafts [k'], q [k', V] on the target vocab, number of draft forwards); q is None when greedy: the
        greedy test reads the drafts only, so a one-hot scattered over the target vocabulary per draft is not built.
        """
        unseen = torch.tensor(seq[cache.get_seq_length() :], device=self.device)
        drafts, probs, calls = [], [], 0
        for i in range(k):
            logits = self.runner.forward(unseen, cache, len(seq) - unseen.shape[0] + i, True)[-1]
            calls += 1
            if i > 0 and self.min_confidence is not None and not confident(logits, self.min_confidence):
                break
            if warp.greedy:
                token = logits.argmax() if self.token_ids is None else self.token_ids[logits.argmax()]
            else:
                probs.append(to_target_vocab(warp(logits), self.token_ids, self.vocab_size))
                token = sample(probs[-1], generator)
            drafts.append(token)
            unseen = token[None]
        if warp.greedy:
            q = None
        else:
            q = torch.stack(probs) if probs else torch.empty(0, self.vocab_size, device=self.device)
        if not drafts:
            return torch.empty(0, dtype=torch.long, device=self.device), q, calls
        return torch.stack(drafts), q, calls

    def rollback(self, cache: DynamicCache, length: int) -> None:
        rollback(cache, length)


class SpeculativeDecoder:
    """Speculative decoding of `target` with `draft` (HF causal LMs sharing the target's token ids)."""

    def __init__(
        self,
        target,
        draft,
        gamma: int = 5,
        *,
        draft_token_ids: torch.Tensor | None = None,
        adaptive: AdaptiveGamma | None = None,
        gamma_schedule: Sequence[tuple[int, int]] | None = None,
        lookup_min_ngram: int | None = None,
        draft_min_confidence: float | None = None,
        lean: bool = True,
        eos_token_ids: Sequence[int] | int | None = None,
        stop_strings: Sequence[str] | None = None,
        tokenizer=None,
    ):
        """draft: an HF causal LM, or a model-free drafter (e.g. decode.ngram.PromptLookupDrafter).

        gamma_schedule: [(max_context, γ), ...] picks γ per round from the current sequence length (prompt + generated
        so far) instead of the fixed `gamma`; see `draftops sweep`, which recommends one.
        lookup_min_ngram: with a draft model, take prompt-lookup proposals first wherever an n-gram of at least this
        many tokens repeats (decode.ngram.LookupThenModelDrafter).
        draft_min_confidence: a draft model ends its block where it is less sure than this (`confident`); with
        `adaptive` and no value here, the adaptive policy's `min_confidence`.
        lean: run target and draft models through `ModelRunner`'s lean forward where possible (False: transformers').
        """
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer")
        if gamma_schedule is not None:
            if adaptive is not None:
                raise ValueError("use either adaptive or gamma_schedule, not both")
            gamma_schedule = check_gamma_schedule(gamma_schedule)
        self.target, self.gamma, self.adaptive, self.gamma_schedule = target, gamma, adaptive, gamma_schedule
        self.device = next(target.parameters()).device
        self.vocab_size = _output_size(target)
        self.target_runner = ModelRunner(target, lean)
        if isinstance(draft, torch.nn.Module):
            if draft_min_confidence is None and adaptive is not None:
                draft_min_confidence = adaptive.min_confidence
            draft = ModelDrafter(draft, self.vocab_size, self.device, token_ids=draft_token_ids,
                                 min_confidence=draft_min_confidence, lean=lean)
            if lookup_min_ngram is not None:
                draft = LookupThenModelDrafter(lookup_first_drafter(self.vocab_size, self.device, lookup_min_ngram),
                                               draft)
        elif draft_token_ids is not None or lookup_min_ngram is not None or draft_min_confidence is not None:
            raise ValueError("draft_token_ids, lookup_min_ngram and draft_min_confidence apply to draft models only")
        self.drafter = draft
        if isinstance(eos_token_ids, int):
            eos_token_ids = [eos_token_ids]
        self.eos_token_ids = frozenset(eos_token_ids or ())
        self.stop_strings = list(stop_strings or ())
        self.tokenizer = tokenizer
        contexts = [c for c in (_model_context(target), draft.context) if c]
        self.context = min(contexts) if contexts else None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def generate(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> GenerationResult:
        input_ids = torch.as_tensor(input_ids)
        if input_ids.ndim > 2 or (input_ids.ndim == 2 and input_ids.shape[0] != 1):
            raise ValueError(f"batch size 1 only: got input_ids of shape {tuple(input_ids.shape)}")
        prompt = input_ids.reshape(-1).tolist()
        if not prompt:
            raise ValueError("empty prompt: need at least one token")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if self.context is not None and len(prompt) >= self.context:
            raise ValueError(
                f"prompt has {len(prompt)} tokens but the model context is {self.context} positions; "
                f"at most {self.context - 1} prompt tokens leave room to generate"
            )
        warp = Warp(temperature, top_k, top_p)
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        stats = GenerationStats()
        limit = len(prompt) + max_new_tokens
        if self.context is not None:
            limit = min(limit, self.context)

        self._sync()
        start = time.perf_counter()
        target_cache = self.target_runner.new_cache()
        if len(prompt) > 1:
            self.target_runner.forward(torch.tensor(prompt[:-1], device=self.device), target_cache, 0, True)
        draft_state = self.drafter.start(prompt)
        self._sync()
        stats.prefill_s = time.perf_counter() - start

        seq, gamma = list(prompt), self.gamma
        stats.stop_reason = "max_new_tokens" if len(prompt) + max_new_tokens <= limit else "context"
        while len(seq) < limit:
            t0 = time.perf_counter()
            if self.gamma_schedule is not None:
                gamma = scheduled_gamma(self.gamma_schedule, len(seq))
            k = min(gamma, limit - len(seq) - 1)
            drafts, q, draft_calls = self.drafter.propose(draft_state, seq, k, warp, generator)
            k = drafts.shape[0]
            stats.draft_calls += draft_calls
            self._sync()
            t1 = time.perf_counter()

            fed = torch.cat([torch.tensor(seq[-1:], device=self.device), drafts])
            logits = self.target_runner.forward(fed, target_cache, len(seq) - 1, False)
            accepted, next_tokens = check_drafts(logits, q, drafts, warp, generator)
            flat = torch.cat([accepted.long(), drafts, next_tokens]).tolist()  # the one sync per round
            self._sync()
            t2 = time.perf_counter()

            n = next((i for i, ok in enumerate(flat[:k]) if not ok), k)
            block = flat[k : k + n] + [flat[2 * k + n]]
            stats.record_block(k, n)
            rollback(target_cache, len(seq) + n)
            self.drafter.rollback(draft_state, len(seq) + n)
            if self.adaptive is not None:
                gamma = self.adaptive.next_gamma(gamma, k, n)

            n_old = len(seq) - len(prompt)
            seq.extend(block)
            cut = first_stop(block, self.eos_token_ids)
            if cut is not None:
                del seq[len(seq) - len(block) + cut :]
                stats.stop_reason = "eos"
            if self.stop_strings:
                cut = stop_string_cut(self.tokenizer, seq[len(prompt) :], n_old, self.stop_strings)
                if cut is not None:
                    del seq[len(prompt) + cut :]
                    stats.stop_reason = "stop_string"
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            if stats.stop_reason in ("eos", "stop_string"):
                break

        self._sync()
        stats.total_s = time.perf_counter() - start
        stats.new_tokens = len(seq) - len(prompt)
        return GenerationResult(seq[len(prompt) :], stats)
