"""Lossless speculative decoding (Leviathan et al. 2022; Chen et al. 2023) for batch size 1.

Cache invariant between rounds: the target's KV cache holds every token but the last one (the "pending" token), and
the drafter's state covers a prefix of the sequence; each model is fed exactly the tokens it has not seen yet, at
explicit positions, and rejected drafts are rolled back by cropping the caches. `speculative_round` is one round of
the algorithm; `SpeculativeDecoder.generate` runs rounds until a stop and keeps the statistics.

Proposals come from a drafter (`decode.drafters.chain`): a draft model, prompt lookup, or lookup first and the model
elsewhere. With a tree budget the decoder runs `tree_round`s instead: a tree drafter (`decode.drafters.tree_drafter`)
proposes many continuations at once, the target verifies them in one pass with a tree attention mask and
`decode.token_tree.accept` keeps one path of them. `decode.factory.build_decoder` builds the decoder a config describes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

import torch

from decode.drafters.chain import model_context, output_size
from decode.drafters.protocol import Drafter
from decode.drafters.tree_drafter import TreeDrafter
from decode.generation_stats import GenerationStats, PhaseClock
from decode.runtime.forward import ModelRunner, compact, rollback
from decode.sampling import Warp, sample
from decode.token_tree import accept
from pipeline.context_schedule import ContextSchedule


@dataclass(frozen=True)
class GammaPolicy:
    """How many tokens the drafter is asked for each round.

    fixed: always `gamma`; schedule: γ by the current sequence length (`pipeline.context_schedule`; `draftops sweep`
    recommends one); adaptive: start at `gamma`, +2 after a block accepted whole and −1 otherwise, within
    [min_gamma, max_gamma] (HF's "heuristic" schedule).
    """

    kind: Literal["fixed", "schedule", "adaptive"] = "fixed"
    gamma: int = 5
    schedule: tuple[tuple[int, int], ...] = ()
    min_gamma: int = 1
    max_gamma: int = 16

    def __post_init__(self):
        if self.kind not in ("fixed", "schedule", "adaptive"):
            raise ValueError(f"gamma policy must be fixed, schedule or adaptive, got {self.kind!r}")
        if self.gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {self.gamma}")
        if self.kind == "schedule":
            object.__setattr__(self, "schedule", ContextSchedule.parse(self.schedule, "gamma_schedule").entries)
        elif self.schedule:
            raise ValueError(f"a gamma schedule needs the 'schedule' policy, not {self.kind!r}")

    @classmethod
    def scheduled(cls, schedule: Sequence[Sequence[int]]) -> GammaPolicy:
        entries = ContextSchedule.parse(schedule, "gamma_schedule").entries
        return cls("schedule", entries[0][1], entries)

    def first(self, length: int) -> int:
        """γ of the first round, for a prompt of `length` tokens."""
        return ContextSchedule(self.schedule).at(length) if self.kind == "schedule" else self.gamma

    def next(self, gamma: int, length: int, drafted: int, accepted: int) -> int:
        """γ of the next round, after a round that drafted `drafted` and accepted `accepted`, at sequence `length`."""
        if self.kind == "schedule":
            return ContextSchedule(self.schedule).at(length)
        if self.kind == "adaptive":
            return max(self.min_gamma, min(self.max_gamma, gamma + (2 if accepted == drafted else -1)))
        return gamma

    def to_dict(self) -> dict:
        out: dict = {"gamma_policy": self.kind, "gamma": self.gamma}
        if self.kind == "schedule":
            out["gamma_schedule"] = [list(e) for e in self.schedule]
        return out


@dataclass
class GenerationResult:
    token_ids: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass(frozen=True)
class Round:
    """One round's outcome. A chain's `depth` is its `drafted` and its `tested` min(accepted + 1, drafted); a tree's
    are its deepest level and the positions at which candidates met a test (`decode.token_tree.Verdict`)."""

    tokens: list[int]  # the accepted drafts, then one token from the target
    drafted: int
    accepted: int
    draft_calls: int
    depth: int
    tested: int
    sources: tuple[str, ...] = ()  # per accepted draft, the tree source that proposed it (trees only)

    def record(self, stats: GenerationStats) -> None:
        stats.record_round(self.drafted, self.depth, self.tested, self.accepted, self.sources)
        stats.draft_calls += self.draft_calls


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
    `verify` (tested), which would draw random numbers over the whole vocabulary that greedy does not need."""
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


def speculative_round(target: ModelRunner, target_cache, drafter: Drafter, draft_state, seq: list[int], k: int,
                      warp: Warp, generator: torch.Generator | None,
                      lap: Callable[[str], None] = lambda phase: None) -> Round:
    """One round: the drafter proposes up to k tokens after `seq`, the target scores the pending token and the drafts
    in one pass, the accepted prefix plus one target token are kept, and both caches are cropped to them.
    `lap("draft")` and `lap("verify")` are called as those phases end (timing)."""
    drafts, q, draft_calls = drafter.propose(draft_state, seq, k, warp, generator)
    lap("draft")
    fed = torch.cat([torch.tensor(seq[-1:], device=drafts.device), drafts])
    layers = drafter.feature_layers
    if layers:
        logits, features = target.forward_features(fed, target_cache, len(seq) - 1, layers)
    else:
        logits = target.forward(fed, target_cache, len(seq) - 1, keep_last=False)
    accepted, next_tokens = check_drafts(logits, q, drafts, warp, generator)
    k = drafts.shape[0]
    host = torch.cat([accepted.long(), drafts, next_tokens]).tolist()  # the round's one device-to-host copy
    lap("verify")
    ok, proposed, target_tokens = host[:k], host[k : 2 * k], host[2 * k :]
    n = ok.index(0) if 0 in ok else k
    rollback(target_cache, len(seq) + n)
    drafter.rollback(draft_state, len(seq) + n)
    if layers:  # a feature drafter reads the target's hidden states of the kept tokens
        drafter.observe(draft_state, features[: n + 1])
    return Round(proposed[:n] + [target_tokens[n]], k, n, draft_calls, k, min(n + 1, k))


def tree_round(target: ModelRunner, target_cache, drafter: TreeDrafter, draft_state, seq: list[int], depth: int,
               warp: Warp, generator: torch.Generator | None,
               lap: Callable[[str], None] = lambda phase: None) -> Round:
    """One tree round: the drafter's tree of at most `depth` levels after `seq`; the target scores the pending token
    and every node in one pass (each node sees the prefix and its ancestors, at its depth's position); `accept` keeps
    one path and a token from the target; the target's cache keeps that path, compacted next to the prefix."""
    tree, draft_calls = drafter.grow(draft_state, seq, depth, warp, generator)
    lap("draft")
    device, start = next(target.model.parameters()).device, len(seq) - 1
    tokens, positions, mask = tree.pass_inputs(seq[-1], start, device)
    logits, features = target.forward_tree_features(tokens, target_cache, start, positions, mask,
                                                    drafter.feature_layers)
    verdict = accept(tree, logits, warp, generator)
    lap("verify")
    compact(target_cache, start + 1, [start + 1 + node for node in verdict.path])
    new = [tree.tokens[node] for node in verdict.path] + [verdict.next_token]
    drafter.commit(draft_state, seq + new)
    if features is not None:  # a feature draft reads the target's hidden states of the pending token and the path
        drafter.observe(draft_state, features[[0, *(1 + node for node in verdict.path)]])
    return Round(new, len(tree), len(verdict.path), draft_calls, tree.depth, verdict.tested,
                 tuple(tree.sources[node] for node in verdict.path))


@dataclass(frozen=True)
class Sampling:
    """What a decoder generates unless `generate` is told otherwise: length and the warp of both models' logits."""

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


GREEDY = Sampling()


class SpeculativeDecoder:
    """Speculative decoding of a target (an HF causal LM, run by its `ModelRunner`) with a drafter's proposals.
    `decode.factory` builds every decoder: `build_decoder` from a config, `model_decoder` from a draft model or drafter
    and explicit settings."""

    def __init__(
        self,
        target_runner: ModelRunner,
        drafter: Drafter | TreeDrafter,
        gamma: int | GammaPolicy = 5,
        *,
        eos_token_ids: Sequence[int] = (),
        sampling: Sampling = GREEDY,
        stop_strings: Sequence[str] | None = None,
        tokenizer=None,
    ):
        """target_runner: how the target runs (`decode.runtime.forward.ModelRunner`: lean or transformers' forward,
        compiled or eager), built by the factory once per decoder. drafter: a chain drafter (`decode.drafters.chain`,
        e.g. `decode.drafters.lookup.PromptLookupDrafter`) or a `decode.drafters.tree_drafter.TreeDrafter` (tree
        rounds). gamma: a fixed γ, or a `GammaPolicy` (schedule by context length, adaptive); in tree rounds, the
        deepest level. eos_token_ids: ids that end generation (() never stops). sampling: `generate`'s defaults.
        """
        if not isinstance(target_runner, ModelRunner):
            raise TypeError("SpeculativeDecoder takes the target's ModelRunner and a drafter; "
                            "decode.factory.model_decoder builds one from models")
        if isinstance(drafter, torch.nn.Module):
            raise TypeError("SpeculativeDecoder takes a drafter; decode.factory.model_decoder builds one from a model")
        self.gamma = gamma if isinstance(gamma, GammaPolicy) else GammaPolicy("fixed", gamma)
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer")
        self.target = target = target_runner.model
        self.device = next(target.parameters()).device
        self.vocab_size = output_size(target)
        self.target_runner = target_runner
        self.drafter: Drafter | TreeDrafter = drafter
        self.eos_token_ids = frozenset(eos_token_ids)
        self.sampling = sampling
        self.stop_strings = list(stop_strings or ())
        self.tokenizer = tokenizer
        contexts = [c for c in (model_context(target), drafter.context) if c]
        self.context = min(contexts) if contexts else None

    @property
    def settings(self) -> dict:
        """What decides this decoder's output and speed: its drafter, rounds, γ policy, stop ids and sampling."""
        return {"drafter": self.drafter.name, "rounds": "tree" if isinstance(self.drafter, TreeDrafter) else "chain",
                **self.gamma.to_dict(), "eos_token_ids": sorted(self.eos_token_ids),
                "stop_strings": self.stop_strings, **asdict(self.sampling)}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise ValueError("empty prompt: need at least one token")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if self.context is not None and len(prompt) >= self.context:
            raise ValueError(
                f"prompt has {len(prompt)} tokens but the model context is {self.context} positions; "
                f"at most {self.context - 1} prompt tokens leave room to generate"
            )

    def _stop(self, seq: list[int], n_prompt: int, n_old: int) -> str | None:
        """Cut `seq` at the first EOS among this round's tokens (those past n_prompt + n_old), or at a stop string;
        returns why it stopped, if it did."""
        reason = None
        cut = first_stop(seq[n_prompt + n_old :], self.eos_token_ids)
        if cut is not None:
            del seq[n_prompt + n_old + cut :]
            reason = "eos"
        if self.stop_strings:
            cut = stop_string_cut(self.tokenizer, seq[n_prompt:], n_old, self.stop_strings)
            if cut is not None:
                del seq[n_prompt + cut :]
                reason = "stop_string"
        return reason

    @torch.inference_mode()
    def generate(
        self,
        input_ids: Sequence[int] | torch.Tensor,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> GenerationResult:
        """Generate for one prompt; each of max_new_tokens, temperature, top_k and top_p left None is the decoder's
        own (`sampling`, from the config it was built from)."""
        given = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
        sampling = replace(self.sampling, **{key: value for key, value in given.items() if value is not None})
        prompt = self._prompt(input_ids, sampling.max_new_tokens)
        warp = Warp(sampling.temperature, sampling.top_k, sampling.top_p)
        generator = None if seed is None else torch.Generator(device=self.device).manual_seed(seed)
        wanted = len(prompt) + sampling.max_new_tokens
        limit = wanted if self.context is None else min(wanted, self.context)
        stats = GenerationStats(stop_reason="max_new_tokens" if wanted <= limit else "context")
        clock = PhaseClock(stats, self._sync)
        target_cache, draft_state = self._prefill(prompt)
        clock("prefill")

        seq, gamma = list(prompt), self.gamma.first(len(prompt))
        run = tree_round if isinstance(self.drafter, TreeDrafter) else speculative_round
        while len(seq) < limit:
            clock.restart()  # bookkeeping between rounds counts as overhead, not as drafting
            k = min(gamma, limit - len(seq) - 1)
            step = run(self.target_runner, target_cache, self.drafter, draft_state, seq, k, warp, generator, clock)
            step.record(stats)
            n_old = len(seq) - len(prompt)
            seq.extend(step.tokens)
            gamma = self.gamma.next(gamma, len(seq), step.depth, step.accepted)
            reason = self._stop(seq, len(prompt), n_old)
            if reason is not None:
                stats.stop_reason = reason
                break

        stats.total_s = clock.total()
        stats.new_tokens = len(seq) - len(prompt)
        return GenerationResult(seq[len(prompt) :], stats)

    def _prompt(self, input_ids: Sequence[int] | torch.Tensor, max_new_tokens: int) -> list[int]:
        input_ids = torch.as_tensor(input_ids)
        if input_ids.ndim > 2 or (input_ids.ndim == 2 and input_ids.shape[0] != 1):
            raise ValueError(f"batch size 1 only: got input_ids of shape {tuple(input_ids.shape)}")
        prompt = input_ids.reshape(-1).tolist()
        self._check(prompt, max_new_tokens)
        return prompt

    def _prefill(self, prompt: list[int]) -> tuple:
        """The target fed every prompt token but the last (the pending one), the drafter started on the prompt (and
        given the target's features, for a feature draft) -> (the target's cache, the drafter's state)."""
        target_cache = self.target_runner.new_cache()
        draft_state = self.drafter.start(prompt)
        layers = self.drafter.feature_layers
        if len(prompt) > 1 and layers:
            _, features = self.target_runner.forward_features(torch.tensor(prompt[:-1], device=self.device),
                                                              target_cache, 0, layers)
            self.drafter.observe(draft_state, features)
        elif len(prompt) > 1:
            self.target_runner.forward(torch.tensor(prompt[:-1], device=self.device), target_cache, 0, True)
        return target_cache, draft_state
