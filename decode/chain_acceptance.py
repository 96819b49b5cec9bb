"""Per-position acceptance of chains of k drafts, counted as serving engines count it, and the mean acceptance length.

vLLM counts, for every draft (one round proposing k tokens), how many of its tokens were accepted
(`vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_accepted_tokens`) and, per position i, the drafts whose tokens
0..i were all accepted (`vllm:spec_decode_num_accepted_tokens_per_pos`). Its acceptance-length regression test
(tests/v1/spec_decode/test_acceptance_length.py) reports rate_i = accepted at i / drafts and the mean acceptance
length AL = 1 + accepted / drafts = 1 + Σ rate_i, at k = 3 and temperature 0; SpecForge and speculators publish the
same AL. `ChainAcceptance` holds those counts, so a draftops figure stands beside theirs.

At temperature 0 a draft token is accepted exactly when it is the target's greedy token after the accepted prefix, so
over the target's own greedy text the drafts of every round follow from teacher-forced passes: a layer draft's j-th
draft of a round starting at response token t is accepted given the earlier ones were when its prediction at t + j
is the target's (`layer_chains`), a feature draft's when its j-th unrolled step there is (`feature_chains`). The
rounds are then replayed as the decoder runs them (`walk_chains`).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from decode.acceptance import analytic_acceptance
from decode.models.feature_draft import FeatureDraft
from decode.runtime.forward import target_features
from pipeline.intervals import ratio_ci

ENGINE_CHAIN = 3  # the k of vLLM's acceptance-length test and of speculators' default proposals


@dataclass
class ChainAcceptance:
    """accepted[r][d]: the tokens accepted from the d-th draft of response r, in chains of k."""

    k: int
    accepted: list[list[int]]

    @property
    def drafts(self) -> int:
        return sum(len(row) for row in self.accepted)

    @property
    def per_position(self) -> list[float]:
        """rate_i for i = 0..k-1: the share of drafts whose tokens 0..i were all accepted (nan without drafts)."""
        drafts = self.drafts
        return [sum(a > i for row in self.accepted for a in row) / drafts if drafts else float("nan")
                for i in range(self.k)]

    @property
    def length(self) -> float:
        """AL = 1 + Σ rate_i: tokens per target call of the chains (the accepted drafts and the target's own)."""
        return 1 + sum(self.per_position)


def walk_chains(accepts: Callable[[int, int], bool], n_tokens: int, k: int) -> list[int]:
    """The accepted tokens of each draft when n_tokens response tokens are decoded in chain rounds of k: a round that
    starts with t tokens known drafts min(k, n_tokens - t - 1) (the last token is the target's own, as
    `decode.acceptance.walk`); accepts(j, t) tells whether its j-th draft is accepted given the ones before it were.
    A round with nothing to draft is no draft."""
    rounds, t = [], 0
    while t < n_tokens:
        drafted, run = min(k, n_tokens - t - 1), 0
        while run < drafted and accepts(run, t):
            run += 1
        if drafted:
            rounds.append(run)
        t += run + 1
    return rounds


def chains_from_matches(matches: Sequence[Sequence[float]], k: int) -> ChainAcceptance:
    """Chains of a draft that proposes the token the teacher-forced pass scored: matches[r][t] is 1 where its
    prediction of response r's token t is the target's greedy token (a layer draft's α at T=0,
    `decode.acceptance.AnalyticAcceptance.per_position`), so the j-th draft of a round at t is accepted when
    matches[r][t + j] is."""
    return ChainAcceptance(k, [walk_chains(lambda j, t, row=row: row[t + j] >= 0.5, len(row), k) for row in matches])


def chains_from_steps(steps: Sequence[tuple[torch.Tensor, int, int]], k: int) -> ChainAcceptance:
    """Chains of a feature draft: per response (matches [≥k, T] by unrolled step j and index i, the response's first
    and end positions), where matches[j, i] is 1 when step j at index i (which predicts token i + 2 + j) proposes
    the target's greedy token; a round starting at response token t begins at index start + t - 2."""
    rows = []
    for matches, start, end in steps:
        if matches.shape[0] < k:
            raise ValueError(f"chains of {k} need {k} unrolled steps, got {matches.shape[0]}")
        table = matches[:k].bool().tolist()
        rows.append(walk_chains(lambda j, t, table=table, start=start: start + t >= 2 and table[j][start + t - 2],
                                end - start, k))
    return ChainAcceptance(k, rows)


@torch.inference_mode()
def greedy_chains(target, draft, sequences: Sequence[Sequence[int]], response_starts: Sequence[int], k: int, *,
                  draft_token_ids: torch.Tensor | None = None, batch_size: int = 8) -> ChainAcceptance:
    """Chains of k drafts over the target's greedy text (prompt + response from response_starts[i] on), at T=0:
    from `analytic_acceptance`'s greedy agreement for a draft LM, from `feature_chains` for a feature draft."""
    if isinstance(draft, FeatureDraft):
        return chains_from_steps(feature_chains(target, draft, sequences, response_starts, k, batch_size), k)
    greedy = analytic_acceptance(target, draft, sequences, response_starts, temperature=0.0,
                                 draft_token_ids=draft_token_ids, batch_size=batch_size)
    return chains_from_matches(greedy.per_position, k)


def feature_chains(target, draft: FeatureDraft, sequences: Sequence[Sequence[int]], response_starts: Sequence[int],
                   k: int, batch_size: int = 8) -> list[tuple[torch.Tensor, int, int]]:
    """Per sequence (matches [k, len - 1], start, len): whether the feature draft's unrolled step j at index i
    (`FeatureDraft.unroll`, the right tokens fed in between, as decoding j tokens past index i once they were
    accepted) proposes the target's greedy token i + 2 + j, from one target pass with its hidden states."""
    device = next(target.parameters()).device
    out = []
    for begin in range(0, len(sequences), batch_size):
        batch = [list(s) for s in sequences[begin : begin + batch_size]]
        width = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq, device=device)
            mask[row, : len(seq)] = 1
        passed = target(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        greedy = passed.logits.argmax(-1)  # [B, T]: position p's greedy token p + 1
        matches = torch.zeros(k, len(batch), width, dtype=torch.bool, device=device)
        steps = draft.unroll(target_features(passed.hidden_states, draft.feature_layers), ids, mask, steps=k)
        for j, hidden in enumerate(steps):
            proposed = draft.logits(hidden).argmax(-1)
            if draft.token_ids is not None:
                proposed = draft.token_ids.to(device)[proposed]
            # step j at index i proposes token i + 2 + j, the target's greedy token at position i + 1 + j
            span = width - 1 - j
            matches[j, :, :span] = proposed[:, :span] == greedy[:, 1 + j :]
        for row, (seq, start) in enumerate(zip(batch, response_starts[begin : begin + batch_size])):
            out.append((matches[:, row, : len(seq)].cpu(), start, len(seq)))
    return out


def chain_summary(chain: ChainAcceptance, *, seed: int = 0) -> dict:
    """Chains of k as engines report them (`decode.chain_acceptance`): k, drafts, the rate at each position, and the
    mean acceptance length with its 95% interval over prompts (1 + the bootstrapped accepted / drafts)."""
    ci = ratio_ci([sum(row) for row in chain.accepted], [len(row) for row in chain.accepted], seed=seed)
    return {"k": chain.k, "drafts": chain.drafts, "per_position": chain.per_position, "length": chain.length,
            "length_low": 1 + ci.low, "length_high": 1 + ci.high}


def chain_text(chain: dict) -> str:
    """One line: `k=3 (vLLM's count, per draft): a_1 / a_2 / a_3, acceptance length L [low, high]`, each a_i the
    share of drafts whose tokens 1..i were all accepted."""
    rates = " / ".join(f"{rate:.2f}" for rate in chain["per_position"])
    return (f"k={chain['k']} (vLLM's count, per draft): {rates}, acceptance length {chain['length']:.2f} "
            f"[{chain['length_low']:.2f}, {chain['length_high']:.2f}]")
