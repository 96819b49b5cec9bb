"""`distill.heldout_eval`: a feature draft's held-out evaluation reads the target's features of the held-out
responses from one target pass per job, and measures what a pass per evaluation measured."""
from __future__ import annotations

import json

import torch

from decode.models.feature_draft import feature_draft_from_target
from decode.runtime.forward import target_features
from distill.heldout_eval import feature_eval
from distill.step import FeatureStepLogits
from tests.conftest import make_tiny_model, make_tokenizer
from tests.distill.fsdp_step import responses


def counted_forwards(model) -> list[int]:
    calls = [0]
    model.model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_the_target_runs_once_for_every_evaluation_of_a_feature_draft():
    heldout = responses()
    target = heldout_target()
    calls = counted_forwards(target)
    step_logits = FeatureStepLogits(feature_draft_from_target(target), steps=3).eval()
    first = feature_eval(step_logits, target, heldout, None, gamma=3, chain_k=3)
    after_one = calls[0]
    again = feature_eval(step_logits, target, heldout, None, gamma=3, chain_k=3)
    assert after_one == 1 and calls[0] == after_one  # 6 responses in one teacher-forced batch, then none
    assert json.dumps(again, sort_keys=True) == json.dumps(first, sort_keys=True)  # NaN where no chain reached 3


def test_the_kept_features_are_the_targets_own_at_every_position():
    heldout, target = responses(), heldout_target()
    draft = feature_draft_from_target(target)
    feature_eval(FeatureStepLogits(draft, steps=2).eval(), target, heldout, None, gamma=2)
    for i in (0, len(heldout) - 1):
        seq = torch.tensor([heldout.prompt_ids[i] + heldout.response_ids[i]])
        with torch.no_grad():
            hidden = target.model(input_ids=seq, output_hidden_states=True).hidden_states
        expected = target_features(hidden, draft.feature_layers)[0]
        assert heldout.feature_rows(i).dtype == torch.float32  # the target's precision, not the training cache's fp16
        torch.testing.assert_close(heldout.feature_rows(i), expected, rtol=1e-5, atol=1e-5)


def test_features_of_other_layers_or_another_target_are_computed_again():
    """Kept features serve only the layers and the target they came from, even at the same width."""
    heldout, target = responses(), heldout_target()
    calls = counted_forwards(target)
    draft = feature_draft_from_target(target)
    feature_eval(FeatureStepLogits(draft, steps=2).eval(), target, heldout, None, gamma=2)
    kept = heldout.features.clone()
    draft.feature_layers = tuple(reversed(draft.feature_layers))  # the same width, other features
    feature_eval(FeatureStepLogits(draft, steps=2).eval(), target, heldout, None, gamma=2)
    assert calls[0] == 2 and not torch.equal(heldout.features, kept)
    other = heldout_target()
    feature_eval(FeatureStepLogits(draft, steps=2).eval(), other, heldout, None, gamma=2)
    assert heldout.feature_key[0] == id(other)


def heldout_target():
    return make_tiny_model(len(make_tokenizer()), seed=0)
