"""Analytic acceptance: α_t = Σ_x min(p_t(x), q_t(x)) = 1 − TVD(p_t, q_t) from one teacher-forced pass of both models.

Also the walk (speculative rounds replayed over per-token outcomes, as `SpeculativeDecoder` runs them: exact target
calls for greedy matches, a Monte-Carlo τ for acceptance probabilities) and the closed forms of Leviathan et al.
(2022) for i.i.d. acceptance α: expected tokens per target call, speedup and break-even α.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from decode.models.feature_draft import FeatureDraft
from decode.runtime.forward import target_features
from decode.sampling import Warp, to_student_columns, to_target_vocab


@dataclass
class AnalyticAcceptance:
    """per_position[i][t]: α at the t-th response token of sequence i; per_sequence: their means (nan if empty);
    ranks[i][t] (with `greedy_ranks`): where the target's greedy token t stands in the draft's order at that position
    (1: the draft's top choice; 0: outside the draft's vocabulary, never proposed); target_confidence[i][t]: the
    target's probability of its most likely token there (its softmax, unwarped); outside_vocabulary[i][t]: the
    target's probability there (warped as for α) on ids a reduced head lacks, which no draft of that vocabulary
    proposes: α_t ≤ 1 − outside_vocabulary[i][t] (greedy: 1 where the target's token is not in it; 0 for a full
    head)."""

    per_sequence: list[float]
    per_position: list[list[float]]
    target_confidence: list[list[float]]
    outside_vocabulary: list[list[float]]
    ranks: list[list[int]] | None = None

    @property
    def counts(self) -> list[int]:
        return [len(a) for a in self.per_position]

    @property
    def sums(self) -> list[float]:
        return [float(sum(a)) for a in self.per_position]


@torch.inference_mode()
def analytic_acceptance(
    target,
    draft,
    sequences: Sequence[Sequence[int]],
    response_starts: Sequence[int],
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    draft_token_ids: torch.Tensor | None = None,
    batch_size: int = 8,
    greedy_ranks: bool = False,
) -> AnalyticAcceptance:
    """α at every response token of each sequence (prompt + response; the response starts at response_starts[i]).

    Sequences are right-padded and batched; both models see the same tokens and the same logit warping. Only the
    logits from the first scored position on are computed, and they are warped one sequence at a time. A feature draft
    (`decode.models.feature_draft`) reads the target's features from the same pass; its α is that of its first draft
    position (its prediction of token t from the target's features at t - 2 and token t - 1).

    greedy_ranks: also rank the target's argmax among the draft's unwarped probabilities at every position, the order
    in which a greedy token tree offers the draft's candidates (`decode.drafters.tree_drafter.ModelTree`): a rank-r
    candidate is the one the greedy walk accepts exactly where this rank is r
    (`decode.tree_budget_prediction.rank_acceptance`).
    """
    if len(sequences) != len(response_starts):
        raise ValueError(f"{len(sequences)} sequences but {len(response_starts)} response starts")
    device = next(target.parameters()).device
    if isinstance(draft, FeatureDraft):
        draft_token_ids = draft.token_ids
    elif draft_token_ids is not None:
        draft_token_ids = torch.as_tensor(draft_token_ids, dtype=torch.long, device=device)
    warp = Warp(temperature, top_k, top_p)
    columns: tuple[list, ...] = ([], [], [], [])  # per sequence: α, target confidence, outside vocabulary, ranks
    for begin in range(0, len(sequences), batch_size):
        batch = [list(s) for s in sequences[begin : begin + batch_size]]
        starts = response_starts[begin : begin + batch_size]
        ids, mask = _right_padded(batch, device)
        # Logits at position j predict token j+1: response tokens start..len-1 are scored at start-1..len-2.
        first = min(max(start, 1) - 1 for start in starts)
        p_logits, q_logits = _both_logits(target, draft, ids, mask, first)
        for row, (seq, start) in enumerate(zip(batch, starts)):
            scored = slice(max(start, 1) - 1 - first, len(seq) - 1 - first)
            scores = ([], [], [], []) if scored.start >= scored.stop else _scored_positions(
                p_logits[row, scored], q_logits[row, scored], warp, draft_token_ids, greedy_ranks)
            for column, values in zip(columns, scores):
                column.append(values)
    per_position, confidence, outside, ranks = columns
    per_sequence = [sum(a) / len(a) if a else float("nan") for a in per_position]
    return AnalyticAcceptance(per_sequence, per_position, confidence, outside, ranks if greedy_ranks else None)


def _right_padded(batch: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) [len(batch), longest], right-padded with id 0."""
    width = max(len(s) for s in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long, device=device)
    mask = torch.zeros(len(batch), width, dtype=torch.long, device=device)
    for row, seq in enumerate(batch):
        ids[row, : len(seq)] = torch.tensor(seq, device=device)
        mask[row, : len(seq)] = 1
    return ids, mask


def _both_logits(target, draft, ids: torch.Tensor, mask: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's and the draft's logits at positions first.. of one batch, each position's prediction of the next
    token ([B, width - first, V] each); a feature draft reads the target's features from the same pass."""
    if not isinstance(draft, FeatureDraft):
        keep = ids.shape[1] - first
        return (target(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits,
                draft(input_ids=ids, attention_mask=mask, logits_to_keep=keep).logits)
    out = target(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    steps = draft.logits(draft.unroll(target_features(out.hidden_states, draft.feature_layers), ids, mask,
                                      steps=1)[0])
    # index i predicts token i + 2, so position j's prediction (of token j + 1) is index j - 1's
    return out.logits[:, first:], torch.cat([torch.zeros_like(steps[:, :1]), steps[:, :-1]], 1)[:, first:]


def _scored_positions(p_logits: torch.Tensor, q_logits: torch.Tensor, warp: Warp, draft_token_ids: torch.Tensor | None,
                      greedy_ranks: bool) -> tuple[list[float], list[float], list[float], list[int]]:
    """One sequence's α, target confidence, target probability outside the draft's vocabulary and (with
    greedy_ranks) greedy ranks at its scored positions, from both models' logits there [n, V]."""
    p = warp(p_logits)
    q = to_target_vocab(warp(q_logits), draft_token_ids, p.shape[-1])
    if draft_token_ids is None:
        outside = [0.0] * p.shape[0]
    else:
        outside = (1 - p.index_select(-1, draft_token_ids).sum(-1)).clamp(min=0).tolist()
    return (torch.minimum(p, q).sum(-1).tolist(), p_logits.float().softmax(-1).amax(-1).tolist(), outside,
            greedy_rank(p_logits, q_logits, draft_token_ids) if greedy_ranks else [])


def token_mean(rows: Sequence[Sequence[float]]) -> float:
    """The mean over every response token of every sequence (nan if there are none)."""
    values = [v for row in rows for v in row]
    return sum(values) / len(values) if values else float("nan")


CONFIDENCE_EDGES = (0.5, 0.8)  # the target's top probability: a near tie below 0.5, sure from 0.8


def alpha_by_target_confidence(per_position: Sequence[Sequence[float]], confidence: Sequence[Sequence[float]],
                               edges: Sequence[float] = CONFIDENCE_EDGES) -> list[dict]:
    """α over the response tokens in each band of the target's own confidence ([0, e1), [e1, e2), ..., [ek, 1]):
    {low, high, tokens, share, alpha (nan if none)} per band. A draft that misses tokens the target is sure of has
    something left to learn; where the target's first and second choices nearly tie, even a close copy of its
    distribution often ranks them the other way round."""
    alphas = [a for row in per_position for a in row]
    confidences = [c for row in confidence for c in row]
    if len(alphas) != len(confidences):
        raise ValueError(f"{len(alphas)} α values but {len(confidences)} confidences")
    bounds = [0.0, *edges, 1.0]
    bands = []
    for low, high in zip(bounds, bounds[1:]):  # the last band is closed: a confidence of 1.0 falls in it
        inside = [a for a, c in zip(alphas, confidences) if low <= c < high or c == high == 1.0]
        bands.append({"low": low, "high": high, "tokens": len(inside),
                      "share": len(inside) / len(alphas) if alphas else float("nan"),
                      "alpha": sum(inside) / len(inside) if inside else float("nan")})
    return bands


def greedy_rank(p_logits: torch.Tensor, q_logits: torch.Tensor, draft_token_ids: torch.Tensor | None) -> list[int]:
    """Per position (rows of p_logits [T, V] and the draft's q_logits [T, V_draft]): `draft_rank` of the target's
    argmax."""
    return draft_rank(q_logits.float().softmax(-1), p_logits.argmax(-1), draft_token_ids).tolist()


def draft_rank(probs: torch.Tensor, target_ids: torch.Tensor, draft_token_ids: torch.Tensor | None) -> torch.Tensor:
    """1 + the number of ids the draft's probs [..., V_draft] rank strictly above each target id [...] (its place in
    the order a greedy token tree offers the draft's candidates), or 0 where the id is outside a reduced vocabulary
    (or has probability 0: never proposed)."""
    columns = to_student_columns(target_ids, draft_token_ids, ignore_index=-1)
    mine = probs.gather(-1, columns.clamp(min=0).unsqueeze(-1))
    return torch.where((columns >= 0) & (mine[..., 0] > 0), 1 + (probs > mine).sum(-1), 0)


Block = Callable[[int, int], tuple[int, int]]  # (t, k) -> (drafted, accepted) of one round


@dataclass
class Walk:
    """Speculative decoding replayed over one response: rounds (target calls) and draft outcomes."""

    calls: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    rounds: Counter = field(default_factory=Counter)  # rounds by the number of tokens drafted in them


def walk(block: Block, n_tokens: int, gamma: int) -> Walk:
    """Replay speculative decoding of n_tokens tokens round by round, as `SpeculativeDecoder.generate` does.

    block(t, k) -> (drafted, accepted) of a round that starts with t response tokens known and drafts up to k. Like
    the decoder, a round drafts at most the tokens left but one (k = min(γ, n_tokens − t − 1)): the target's own
    token after the accepted drafts completes the generation, so the last token is never drafted.
    """
    w, t = Walk(), 0
    while t < n_tokens:
        drafted, accepted = block(t, min(gamma, n_tokens - t - 1))
        w.calls += 1
        w.rounds[drafted] += 1
        w.drafted += drafted
        w.verified += min(accepted + 1, drafted)
        w.accepted += accepted
        t += accepted + 1
    return w


def run_block(accepts: Callable[[int], bool]) -> Block:
    """Rounds that draft all k tokens and accept the run of positions from t on for which accepts(position)."""

    def block(t: int, k: int) -> tuple[int, int]:
        run = 0
        while run < k and accepts(t + run):
            run += 1
        return k, run

    return block


def greedy_block(matches: Sequence[float]) -> Block:
    """Rounds of a draft under greedy decoding: matches[t] is 1 when its argmax equals the target's token t."""
    return run_block(lambda position: matches[position] >= 0.5)


def sampled_block(alphas: Sequence[float], rng: random.Random) -> Block:
    """Rounds of a draft under sampling: the draft of token t is accepted with probability alphas[t].

    One rng.random() per accept/reject test, in order, none after a rejection.
    """
    return run_block(lambda position: rng.random() < alphas[position])


def simulated_tau(per_position: Sequence[Sequence[float]], gamma: int, *, rollouts: int = 16, seed: int = 0) -> float:
    """Tokens per target call from walking each response (`walk`), accepting position t with probability α_t.

    per_position[i][t]: acceptance of response i's token t (e.g. `AnalyticAcceptance.per_position`). A response with
    an α strictly between 0 and 1 is walked `rollouts` times, one of 0/1 values (greedy: the walk is exact) once;
    τ is all tokens over all target calls.
    """
    rng = random.Random(seed)
    tokens = calls = 0
    for alphas in per_position:
        repeats = rollouts if any(0.0 < a < 1.0 for a in alphas) else 1
        for _ in range(repeats):
            tokens += len(alphas)
            calls += walk(sampled_block(alphas, rng), len(alphas), gamma).calls
    return tokens / calls if calls else float("nan")


def expected_tokens_from_positions(alpha_at: Sequence[float], gamma: int) -> float:
    """Expected tokens per target call, 1 + Σ_{k=1..γ} Π_{i≤k} α_i, from acceptance at each block position.

    alpha_at[i] is the acceptance probability of block position i+1 given that the positions before it were accepted;
    a shorter list is extended with its last value.
    """
    if gamma < 1 or not alpha_at:
        raise ValueError("need gamma >= 1 and at least one acceptance value")
    alphas = list(alpha_at[:gamma]) + [alpha_at[-1]] * max(0, gamma - len(alpha_at))
    expected, survive = 1.0, 1.0
    for alpha in alphas:
        survive *= alpha
        expected += survive
    return expected


def expected_tokens(alpha: float, gamma: int) -> float:
    """Leviathan et al.: expected tokens per target call, (1 − α^(γ+1)) / (1 − α)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def expected_speedup(alpha: float, gamma: int, c: float, v: float = 1.0) -> float:
    """Wall-clock gain over target-only decoding, (1 − α^(γ+1)) / ((1 − α)(γc + v)).

    c: one draft step / one target step; v: one (γ+1)-token verify pass / one target step (1 in the paper).
    """
    return expected_tokens(alpha, gamma) / (gamma * c + v)


def break_even_alpha(gamma: int, c: float, v: float = 1.0) -> float:
    """Acceptance at which speculative decoding is exactly as fast as the target alone.

    Solves expected_speedup(alpha, gamma, c, v) = 1; 0.0 if it always pays, 1.0 if it never does (γc + v ≥ γ + 1).
    """
    from scipy.optimize import brentq

    def gain(alpha: float) -> float:
        return expected_speedup(alpha, gamma, c, v) - 1.0

    if gain(0.0) >= 0:
        return 0.0
    if gain(1.0) <= 0:
        return 1.0
    return float(brentq(gain, 0.0, 1.0, xtol=1e-10))
