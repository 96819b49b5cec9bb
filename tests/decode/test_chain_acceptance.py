"""Chains of k as engines count them (decode.chain_acceptance): vLLM's per-position rates and acceptance length, and
the same counts from teacher-forced passes as from decoding for real."""
from __future__ import annotations

import pytest
import torch

from decode.chain_acceptance import (
    ChainAcceptance,
    chain_summary,
    chain_text,
    chains_from_matches,
    greedy_chains,
    walk_chains,
)
from decode.factory import model_decoder
from decode.models.feature_draft import feature_draft_from_target
from decode.models.layer_draft import draft_from_target_layers
from decode.runtime.forward import ModelRunner, greedy_decode
from pipeline import metrics as M
from tests.conftest import make_tiny_model
from tests.decode.models.test_feature_draft import make_feature_draft

VOCAB = 40


def test_a_position_counts_where_every_token_before_it_in_the_draft_was_accepted():
    chain = ChainAcceptance(3, [[3, 0, 1], [2, 3]])  # accepted tokens of each draft
    assert chain.drafts == 5
    assert chain.per_position == [4 / 5, 3 / 5, 2 / 5]
    # vLLM: AL = 1 + accepted / drafts = 1 + Σ rate_i
    assert chain.length == pytest.approx(1 + 9 / 5)


def test_the_walk_replays_rounds_of_k_and_never_drafts_the_last_token():
    matches = [1, 1, 0, 1, 1, 1, 1, 0, 1, 1]
    # t=0: accepts 1, 1 then rejects at 2 -> next t=3; t=3: 1, 1, 1 -> t=7; t=7: rejects at 7 -> t=8;
    # t=8: one token left to draft (9 is the target's own) -> accepted -> t=10
    assert walk_chains(lambda j, t: matches[t + j] >= 0.5, len(matches), 3) == [2, 3, 0, 1]
    assert chains_from_matches([matches], 3).accepted == [[2, 3, 0, 1]]
    assert walk_chains(lambda j, t: True, 1, 3) == []  # one token: the target's, nothing drafted


def test_the_summary_holds_an_interval_around_the_length_and_names_its_metrics():
    chain = ChainAcceptance(3, [[3, 2, 1], [0, 1, 3], [2, 2], [1, 0, 0, 3]])
    summary = chain_summary(chain)
    assert summary["length_low"] <= summary["length"] <= summary["length_high"]
    named = M.chain_metrics(summary)
    assert named[M.chain_position(3, 1)] == summary["per_position"][0]
    assert named[M.acceptance_length(3)] == summary["length"]
    assert "k=3" in chain_text(summary)


@pytest.fixture(scope="module")
def target():
    return make_tiny_model(VOCAB, seed=3, layers=4)


def decoded_counts(target, draft, prompts, k: int, new_tokens: int):
    """Per position, the decoder's rounds (chains of k, greedy) that accepted it, its rounds with a draft, and texts."""
    decoder = model_decoder(target, draft, gamma=k, eos_token_ids=())
    accepted, drafts, texts = [0] * k, 0, []
    for prompt in prompts:
        result = decoder.generate(prompt, max_new_tokens=new_tokens)
        stats = result.stats
        accepted = [a + b for a, b in zip(accepted, stats.accepted_at + [0] * k)]
        drafts += stats.drafted_at[0] if stats.drafted_at else 0
        texts.append(prompt + result.token_ids)
    return accepted, drafts, texts


@pytest.mark.parametrize("kind", ["layers", "features"])
def test_teacher_forced_chains_count_what_decoding_in_chains_counts(target, kind):
    # drafts from the target's weights: some of their drafts are accepted, some not
    draft = feature_draft_from_target(target) if kind == "features" else draft_from_target_layers(target, [0, 3])
    draft.eval()
    prompts = [[1, 5, 9, 3], [1, 7, 2, 8, 8], [4, 4, 4]]
    accepted, drafts, texts = decoded_counts(target, draft, prompts, 3, 24)
    assert 0 < accepted[-1] < accepted[0] < drafts
    chain = greedy_chains(target, draft, texts, [len(p) for p in prompts], 3)
    assert chain.drafts == drafts
    assert [round(rate * drafts) for rate in chain.per_position] == accepted


def test_the_target_as_its_own_draft_accepts_every_draft(target):
    prompt = [1, 5, 9, 3]
    text = prompt + greedy_decode(ModelRunner(target), prompt, 16)
    chain = greedy_chains(target, target, [text], [len(prompt)], 3)
    assert chain.per_position[0] == 1.0
    assert chain.accepted[0][:-1] == [3] * (len(chain.accepted[0]) - 1)


def test_a_reduced_head_maps_its_rows_to_the_targets_ids(target):
    prompt = [1, 5, 9, 3]
    text = prompt + greedy_decode(ModelRunner(target), prompt, 16)
    draft = make_feature_draft(target, seed=1, token_ids=torch.arange(VOCAB))  # every id, as rows of a "reduced" head
    full = make_feature_draft(target, seed=1)
    assert greedy_chains(target, draft, [text], [4], 3).accepted == greedy_chains(target, full, [text], [4], 3).accepted
