"""distill.step: the loss step over the cached or the online teacher, and the logits training scores, which are the ones
the draft decodes with (`ResponseLogits`, `FeatureStepLogits`) in every family (`tests.families`): Gemma 2's final
soft-capping, Gemma's embedding scale and tied heads included."""
import math
from types import SimpleNamespace

import pytest
import torch

from decode.models.architectures import head_logits
from decode.models.feature_draft import FeatureDraft, feature_draft_from_target
from decode.models.layer_draft import draft_from_target_layers, reduce_vocabulary
from decode.runtime.forward import ModelRunner, target_features
from distill.losses import TopKTeacher
from distill.step import FeatureStepLogits, ResponseLogits, feature_loss_step, loss_step, shifted, step_mask
from pipeline.config import DistillConfig
from tests.conftest import make_tiny_model
from tests.families import FAMILIES, tiny_family

NEG_INF = float("-inf")


class UniformDraft(torch.nn.Module):
    """A stand-in for `ResponseLogits`: equal logits over 3 draft columns (q = 1/3 each) at every response position."""

    def __init__(self):
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(3))
        self.seen_masks = []

    def forward(self, input_ids, attention_mask, loss_mask):
        self.seen_masks.append(loss_mask)
        return self.logits.expand(int(loss_mask.sum()), -1)


def one_response_position(teacher: TopKTeacher | None = None) -> dict:
    """Prompt [1, 5] and response [7]: position 1 predicts the response token (label: draft column 0); position 0
    (the prompt) and 2 (padding) carry a teacher that must be ignored."""
    batch = {"input_ids": torch.tensor([[1, 5, 7, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 0]]),
             "loss_mask": torch.tensor([[False, True, False, False]]), "labels": torch.tensor([[-100, 0, -100, -100]])}
    if teacher is not None:
        batch["teacher"] = teacher
    return batch


def cached_top1() -> TopKTeacher:
    """The cached teacher keeps only its top-1 at each position: column 0 with p = 1/2 at the response position."""
    return TopKTeacher(torch.tensor([[[0.0], [math.log(0.5)], [NEG_INF], [NEG_INF]]]),
                       torch.tensor([[[2], [0], [-1], [-1]]]))


def online_target(input_ids, attention_mask):
    """The target's logits on the batch: p = (1/2, 1/4, 1/4) at the response position, something else elsewhere."""
    logits = torch.tensor([[[5.0, 0.0, 0.0], [math.log(0.5), math.log(0.25), math.log(0.25)], [0.0, 5.0, 0.0],
                            [0.0, 0.0, 5.0]]])
    return SimpleNamespace(logits=logits)


def step(batch, num_tokens, target=None, **settings):
    draft = UniformDraft()
    loss = loss_step(draft, batch, DistillConfig(**settings), num_tokens=num_tokens, token_ids=None, device="cpu",
                     target=target)
    assert torch.equal(draft.seen_masks[0], batch["loss_mask"])
    return draft, loss


def test_loss_step_with_the_cached_top_k_teacher_is_the_bucketed_divergence_over_the_global_token_count():
    # buckets: the cached column 0 and the tail. p = (1/2, 1/2), q = (1/3, 2/3)
    # forward KL = 1/2 ln(3/2) + 1/2 ln(3/4) = 1/2 ln(9/8); over 4 tokens of the global batch
    _, loss = step(one_response_position(cached_top1()), num_tokens=4)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(0.5 * math.log(9 / 8) / 4, abs=1e-7)
    # TVD = 1 − (min(1/2, 1/3) + min(1/2, 2/3)) = 1/6
    _, loss = step(one_response_position(cached_top1()), num_tokens=1, loss="tvd")
    assert loss.item() == pytest.approx(1 / 6, abs=1e-6)
    # + 0.5 · cross-entropy on the response token (draft column 0, q = 1/3): 0.5 ln 3
    _, loss = step(one_response_position(cached_top1()), num_tokens=2, loss="tvd", ce_weight=0.5)
    assert loss.item() == pytest.approx((1 / 6 + 0.5 * math.log(3)) / 2, abs=1e-6)


def test_loss_step_with_the_online_teacher_runs_the_target_and_gives_the_gradient_of_the_token_mean():
    # full vocabulary: p = (1/2, 1/4, 1/4), q = (1/3, 1/3, 1/3)
    # forward KL = 1/2 ln(3/2) + 2 · 1/4 ln(3/4) = 1/2 ln(9/8), as with the cached top-1 (same coarse-grained p)
    draft, loss = step(one_response_position(), num_tokens=4, target=online_target)
    assert loss.item() == pytest.approx(0.5 * math.log(9 / 8) / 4, abs=1e-7)
    loss.backward()
    # d KL(p ‖ softmax(z)) / dz = q − p, divided by the global token count
    torch.testing.assert_close(draft.logits.grad, torch.tensor([1 / 3 - 1 / 2, 1 / 3 - 1 / 4, 1 / 3 - 1 / 4]) / 4)
    _, loss = step(one_response_position(), num_tokens=1, target=online_target, loss="tvd")
    assert loss.item() == pytest.approx(1 - (1 / 3 + 1 / 4 + 1 / 4), abs=1e-6)


# --------------------------------------------------------------------------- every family

SEQ = torch.tensor([[1, 5, 9, 3, 7, 7, 4, 12, 30, 2], [1, 8, 4, 6, 2, 9, 3, 0, 0, 0]])
MASK = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])
REDUCED = torch.arange(0, 128, 3)


def response_mask() -> torch.Tensor:
    loss_mask = torch.zeros(2, 10, dtype=torch.bool)
    loss_mask[0, 4:9], loss_mask[1, 2:6] = True, True
    return loss_mask


@torch.no_grad()
@pytest.mark.parametrize("reduced", [False, True], ids=["full", "reduced"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_layer_drafts_training_logits_are_its_decoding_logits(family, reduced):
    """ResponseLogits (what the loss scores) against the decoder's own forward of each row, position by position:
    Gemma 2's final soft-capping, Gemma's embedding scale and tied heads included; a reduced head leaves the target's
    embeddings and tie as they were."""
    target = tiny_family(family)
    embeddings = target.get_input_embeddings().weight.clone()
    draft = draft_from_target_layers(target, [0, 3]).eval()
    if reduced:
        reduce_vocabulary(draft, REDUCED, target.get_output_embeddings().weight.detach())
    assert torch.equal(target.get_input_embeddings().weight, embeddings)
    assert (target.get_output_embeddings().weight is target.get_input_embeddings().weight) == bool(
        target.config.tie_word_embeddings)
    assert draft.get_input_embeddings().weight.data_ptr() != target.get_input_embeddings().weight.data_ptr()
    loss_mask = response_mask()
    trained = ResponseLogits(draft)(SEQ, MASK, loss_mask)
    runner = ModelRunner(draft)
    decoded = [runner.forward(SEQ[b, : int(MASK[b].sum())], runner.new_cache(), 0, False) for b in range(2)]
    expected = torch.cat([decoded[b][loss_mask[b, : len(decoded[b])]] for b in range(2)])
    torch.testing.assert_close(trained, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head_logits(draft, draft.model(SEQ[:1]).last_hidden_state), draft(SEQ[:1]).logits,
                               atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("family", FAMILIES)
def test_a_feature_drafts_training_logits_are_its_decoding_logits(family):
    """FeatureStepLogits (training-time test, 2 steps) against `FeatureDraft.step` as decoding feeds it: the verified
    prefix's features, then its own output for the next token."""
    target = tiny_family(family)
    draft = feature_draft_from_target(target, REDUCED).eval()
    assert draft.feature_layers == (1, 2, 3) and draft.config.model_type == "llama"
    features = target_features(target(input_ids=SEQ[:1], output_hidden_states=True).hidden_states,
                               draft.feature_layers)
    loss_mask = torch.zeros(1, 10, dtype=torch.bool)
    loss_mask[0, 3:9] = True
    per_step = FeatureStepLogits(draft, steps=2)(features, SEQ[:1], MASK[:1], loss_mask)
    for i in (2, 5):  # index i predicts token i + 2 (step 0) and i + 3 (step 1), both response tokens
        cache = draft.new_cache()
        out = draft.step(draft.fuse(features[0, : i + 1]), SEQ[0, 1 : i + 2], cache, 0, torch.arange(1, i + 2))[-1:]
        second = draft.step(out, SEQ[0, i + 2][None], cache, i + 1, torch.tensor([i + 2]))
        for j, hidden in enumerate((out, second)):
            row = int(step_mask(loss_mask, j)[0, :i].sum())  # step j's rows are its masked indices, in order
            torch.testing.assert_close(per_step[j][row], draft.logits(hidden)[0], atol=1e-5, rtol=1e-5)


# The feature draft's loss step: step j of the training-time test at index i is scored against the teacher at
# position i + 1 + j (it predicts token i + 2 + j), on response tokens only, over the global token count.


class UniformSteps(torch.nn.Module):
    """A stand-in for `FeatureStepLogits`: equal logits over 3 draft columns at each step's masked indices."""

    def __init__(self, steps: int):
        super().__init__()
        self.logits, self.steps, self.seen = torch.nn.Parameter(torch.zeros(3)), steps, {}

    def forward(self, features, input_ids, attention_mask, loss_mask):
        self.seen = {"features": features, "loss_mask": loss_mask}
        return [self.logits.expand(int(step_mask(loss_mask, j).sum()), -1) for j in range(self.steps)]


def target_with_features():
    """hidden_states: entry i is 10·i everywhere, so the features of layers (0, 2) are [0, 20] at every position."""
    def model(input_ids, attention_mask, output_hidden_states):
        b, t = input_ids.shape
        return SimpleNamespace(hidden_states=tuple(torch.full((b, t, 1), 10.0 * i) for i in range(3)))
    return SimpleNamespace(model=model)


def batch_with_two_response_tokens() -> dict:
    """Prompt [1, 5], response [7, 8], one padding position. Cached top-1: at position 1 column 0 with p = 1/2, at
    position 2 column 1 with p = 1/4; the prompt and padding rows must never be read."""
    teacher = TopKTeacher(torch.tensor([[[0.0], [math.log(0.5)], [math.log(0.25)], [0.0], [0.0]]]),
                          torch.tensor([[[2], [0], [1], [2], [2]]]))
    return {"input_ids": torch.tensor([[1, 5, 7, 8, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 0]]),
            "loss_mask": torch.tensor([[False, True, True, False, False]]),
            "labels": torch.tensor([[-100, 0, 1, -100, -100]]), "teacher": teacher}


def test_each_step_is_scored_against_the_teacher_one_position_further():
    mask = torch.tensor([[False, True, True, False, False]])
    assert step_mask(mask, 0).tolist() == [[True, True, False, False]]  # indices 0, 1 predict tokens 2, 3
    assert step_mask(mask, 1).tolist() == [[True, False, False]]  # index 0 predicts token 3 in its second step
    teacher = batch_with_two_response_tokens()["teacher"]
    assert shifted(teacher, 1)[step_mask(mask, 1)].indices.tolist() == [[1]]  # the teacher at position 2


def test_feature_loss_step_is_the_mean_over_steps_of_the_bucketed_divergence_over_the_global_token_count():
    # q = 1/3 per column. Teacher at position 1: buckets (col 0, tail) p = (1/2, 1/2), q = (1/3, 2/3):
    # KL = 1/2 ln(3/2) + 1/2 ln(3/4). At position 2: (col 1, tail) p = (1/4, 3/4): KL = 1/4 ln(3/4) + 3/4 ln(9/8).
    kl_1 = 0.5 * math.log(1.5) + 0.5 * math.log(0.75)
    kl_2 = 0.25 * math.log(0.75) + 0.75 * math.log(9 / 8)
    model = UniformSteps(steps=2)
    loss = feature_loss_step(model, batch_with_two_response_tokens(), DistillConfig(), target=target_with_features(),
                             layers=(0, 2), num_tokens=4, token_ids=None, device="cpu")
    # step 0: indices 0 and 1 against positions 1 and 2; step 1: index 0 against position 2
    assert loss.item() == pytest.approx(((kl_1 + kl_2) / 4 + kl_2 / 4) / 2, abs=1e-6)
    assert model.seen["features"][0, :, :].tolist() == [[0.0, 20.0]] * 5


@torch.no_grad()
def test_step_logits_are_the_full_unrolls_at_the_scored_indices_in_step_mask_order():
    """FeatureStepLogits runs only each row's window; its logits are the full unroll's at step_mask's indices."""
    target = make_tiny_model(40, seed=3, layers=4)
    draft = FeatureDraft(target.config, target.get_input_embeddings()).eval()
    seq = torch.tensor([[1, 5, 9, 3, 7, 7, 4, 12, 6, 2], [1, 8, 4, 6, 2, 9, 3, 0, 0, 0]])
    attention_mask = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])
    loss_mask = torch.zeros(2, 10, dtype=torch.bool)
    loss_mask[0, 6:9], loss_mask[1, 2:6] = True, True  # responses: tokens 7..9 of row 0, 3..6 of row 1
    features = target_features(target(input_ids=seq, attention_mask=attention_mask,
                                      output_hidden_states=True).hidden_states, draft.feature_layers)
    per_step = FeatureStepLogits(draft, steps=3)(features, seq, attention_mask, loss_mask)
    full = draft.unroll(features, seq, attention_mask, steps=3)
    for j, (logits, hidden) in enumerate(zip(per_step, full, strict=True)):
        expected = draft.logits(hidden[:, : 10 - 1 - j][step_mask(loss_mask, j)])
        assert logits.shape[0] == int(step_mask(loss_mask, j).sum())
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_reach_weighting_scales_later_steps_by_the_earlier_steps_acceptance():
    """Uniform draft q = 1/3. Step 0 at index 0 is scored against position 1: listed column 0 with p = 1/2, so its
    acceptance is min(1/2, 1/3) = 1/3, and step 1 at index 0 counts 1/3 of its term; step 0's terms count whole."""
    kl_1 = 0.5 * math.log(1.5) + 0.5 * math.log(0.75)
    kl_2 = 0.25 * math.log(0.75) + 0.75 * math.log(9 / 8)
    loss = feature_loss_step(UniformSteps(steps=2), batch_with_two_response_tokens(),
                             DistillConfig(ttt_weighting="reach"), target=target_with_features(), layers=(0, 2),
                             num_tokens=4, token_ids=None, device="cpu")
    assert loss.item() == pytest.approx(((kl_1 + kl_2) / 4 + kl_2 / 3 / 4) / 2, abs=1e-6)


def test_acceptance_losses_train_a_feature_step():
    for loss_name in ("log_acceptance", "kl_tv"):
        model = UniformSteps(steps=2)
        loss = feature_loss_step(model, batch_with_two_response_tokens(), DistillConfig(loss=loss_name),
                                 target=target_with_features(), layers=(0, 2), num_tokens=4, token_ids=None,
                                 device="cpu")
        loss.backward()
        assert torch.isfinite(loss) and model.logits.grad.abs().sum() > 0


def test_kl_tv_with_reach_weights_by_hand_from_one_log_softmax_per_step(monkeypatch):
    """Uniform q = 1/3. Step 0 scores index 0 against position 1 (listed p = 1/2: α = 1/3) and index 1 against
    position 2 (p = 1/4: α = 1/4); step 1 scores index 0 against position 2 (α = 1/4), reached with chance 1/3.
    Each step's λ = 1 − its mean α; each term λ·KL + (1 − λ)·(1 − α). The student's log-softmax runs once a step."""
    kl_1 = 0.5 * math.log(1.5) + 0.5 * math.log(0.75)
    kl_2 = 0.25 * math.log(0.75) + 0.75 * math.log(9 / 8)
    lam_0, lam_1 = 1 - (1 / 3 + 1 / 4) / 2, 1 - 1 / 4
    step_0 = lam_0 * (kl_1 + kl_2) + (1 - lam_0) * ((1 - 1 / 3) + (1 - 1 / 4))
    step_1 = lam_1 * kl_2 + (1 - lam_1) * (1 - 1 / 4)
    calls, log_softmax = [], torch.nn.functional.log_softmax
    monkeypatch.setattr(torch.nn.functional, "log_softmax", lambda *a, **k: calls.append(1) or log_softmax(*a, **k))
    loss = feature_loss_step(UniformSteps(steps=2), batch_with_two_response_tokens(),
                             DistillConfig(loss="kl_tv", ttt_weighting="reach"), target=target_with_features(),
                             layers=(0, 2), num_tokens=4, token_ids=None, device="cpu")
    assert loss.item() == pytest.approx((step_0 / 4 + step_1 / 3 / 4) / 2, abs=1e-6)
    assert len(calls) == 2
