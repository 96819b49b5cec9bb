import math

import pytest
import torch

from decode.sampling import to_student_columns
from distill.losses import (
    TopKTeacher,
    distillation_loss,
    forward_kl,
    generalized_jsd,
    reverse_kl,
    total_variation,
)

LN2 = math.log(2.0)
P = torch.tensor([0.8, 0.1, 0.1])
Q = torch.tensor([0.4, 0.4, 0.2])


def logits(probs: torch.Tensor) -> torch.Tensor:
    return probs.log()


def one_position(student: torch.Tensor, teacher: torch.Tensor, **kw) -> float:
    """The loss for a single [1, 1, V] position."""
    return distillation_loss(
        student.view(1, 1, -1), teacher.view(1, 1, -1), torch.ones(1, 1, dtype=torch.bool), **kw).item()


def test_hand_computed_divergences():
    log_p, log_q = P.log(), Q.log()
    # 0.8 ln 2 + 0.1 ln 1/4 + 0.1 ln 1/2 = 0.5 ln 2
    assert forward_kl(log_p, log_q).item() == pytest.approx(0.5 * LN2, abs=1e-6)
    # 0.4 ln 1/2 + 0.4 ln 4 + 0.2 ln 2 = 0.6 ln 2
    assert reverse_kl(log_p, log_q).item() == pytest.approx(0.6 * LN2, abs=1e-6)
    # 1 − (min(.8,.4) + min(.1,.4) + min(.1,.2))
    assert total_variation(log_p, log_q).item() == pytest.approx(0.4, abs=1e-6)
    m = [0.6, 0.25, 0.15]
    jsd = 0.5 * sum(p * math.log(p / mi) for p, mi in zip([0.8, 0.1, 0.1], m)) + 0.5 * sum(
        q * math.log(q / mi) for q, mi in zip([0.4, 0.4, 0.2], m))
    assert generalized_jsd(log_p, log_q, 0.5).item() == pytest.approx(jsd, abs=1e-6)


def test_jsd_endpoints_are_exactly_the_two_kls():
    torch.manual_seed(0)
    log_p = torch.log_softmax(torch.randn(7, 11), -1)
    log_q = torch.log_softmax(torch.randn(7, 11), -1)
    assert torch.equal(generalized_jsd(log_p, log_q, 0.0), forward_kl(log_p, log_q))
    assert torch.equal(generalized_jsd(log_p, log_q, 1.0), reverse_kl(log_p, log_q))
    inner = generalized_jsd(log_p, log_q, 0.3)
    assert (inner > 0).all() and (inner < forward_kl(log_p, log_q)).all()


def test_tvd_is_one_minus_sum_min_and_half_l1():
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(5, 9), -1)
    q = torch.softmax(torch.randn(5, 9), -1)
    tvd = total_variation(p.log(), q.log())
    torch.testing.assert_close(tvd, 1 - torch.minimum(p, q).sum(-1))
    torch.testing.assert_close(tvd, 0.5 * (p - q).abs().sum(-1))


def test_loss_names_and_temperature():
    assert one_position(logits(Q), logits(P), loss="forward_kl") == pytest.approx(0.5 * LN2, abs=1e-6)
    assert one_position(logits(Q), logits(P), loss="reverse_kl") == pytest.approx(0.6 * LN2, abs=1e-6)
    assert one_position(logits(Q), logits(P), loss="tvd") == pytest.approx(0.4, abs=1e-6)
    assert one_position(logits(Q), logits(P), loss="jsd", beta=0.0) == one_position(logits(Q), logits(P))
    # temperature 2 on log-prob logits = sqrt of the probabilities, renormalized
    p2, q2 = P.sqrt() / P.sqrt().sum(), Q.sqrt() / Q.sqrt().sum()
    expected = (p2 * (p2 / q2).log()).sum().item()
    assert one_position(logits(Q), logits(P), temperature=2.0) == pytest.approx(expected, abs=1e-6)


def test_mask_and_global_token_count():
    torch.manual_seed(2)
    student = torch.randn(2, 3, 6, requires_grad=True)
    teacher = torch.randn(2, 3, 6)
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]], dtype=torch.bool)
    per_token = forward_kl(torch.log_softmax(teacher[mask], -1), torch.log_softmax(student[mask], -1))
    assert distillation_loss(student, teacher, mask).item() == pytest.approx(per_token.mean().item(), abs=1e-6)
    assert distillation_loss(student, teacher, mask, num_tokens=10).item() == pytest.approx(
        per_token.sum().item() / 10, abs=1e-6)
    # masked-out positions may hold anything, even nan, without leaking into the loss or its gradient
    poisoned = student.detach().clone()
    poisoned[0, 2] = float("nan")
    poisoned.requires_grad_(True)
    value = distillation_loss(poisoned, teacher, mask)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(poisoned.grad).all()


def test_micro_batches_with_global_count_sum_to_the_full_batch_gradient():
    torch.manual_seed(3)
    student = torch.randn(4, 5, 8, requires_grad=True)
    teacher = torch.randn(4, 5, 8)
    mask = torch.rand(4, 5) > 0.4
    distillation_loss(student, teacher, mask, loss="tvd").backward()
    full_grad = student.grad.clone()
    student.grad = None
    for rows in (slice(0, 1), slice(1, 4)):
        distillation_loss(student[rows], teacher[rows], mask[rows], loss="tvd", num_tokens=mask.sum()).backward()
    torch.testing.assert_close(student.grad, full_grad)


def test_empty_mask_is_zero_with_grad():
    student = torch.randn(2, 3, 5, requires_grad=True)
    for loss in ("forward_kl", "reverse_kl", "jsd", "tvd"):
        value = distillation_loss(student, torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.bool), loss=loss,
                                  num_tokens=0)
        assert value.item() == 0.0 and value.requires_grad
        value.backward()
        assert torch.equal(student.grad, torch.zeros_like(student))


def test_top_k_teacher_buckets_the_tail():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.25, 0.25, 0.2, 0.2, 0.1])
    teacher = TopKTeacher(p[:2].log().view(1, 1, 2), torch.tensor([[[0, 1]]]))
    mask = torch.ones(1, 1, dtype=torch.bool)
    # buckets: p = (.5, .2, tail .3), q = (.25, .25, tail .5)
    fkl = distillation_loss(q.log().view(1, 1, 5), teacher, mask).item()
    assert fkl == pytest.approx(0.5 * LN2 + 0.2 * math.log(0.8) + 0.3 * math.log(0.6), abs=1e-6)
    tvd = distillation_loss(q.log().view(1, 1, 5), teacher, mask, loss="tvd").item()
    assert tvd == pytest.approx(1 - (0.25 + 0.2 + 0.3), abs=1e-6)
    # the teacher's most likely bucket is id 0: −ln q(0)
    greedy = distillation_loss(q.log().view(1, 1, 5), teacher, mask, loss="argmax_ce").item()
    assert greedy == pytest.approx(-math.log(0.25), abs=1e-6)


def test_argmax_cross_entropy_reads_only_the_teachers_first_choice():
    # P's argmax is column 0, Q gives it 0.4; a teacher with the same argmax but other mass elsewhere scores the same
    assert one_position(logits(Q), logits(P), loss="argmax_ce") == pytest.approx(-math.log(0.4), abs=1e-6)
    flatter = torch.tensor([0.4, 0.35, 0.25])
    assert one_position(logits(Q), logits(flatter), loss="argmax_ce") == pytest.approx(-math.log(0.4), abs=1e-6)
    # a reduced-vocabulary student: the argmax over the columns it has (target id 2 -> column 1, q 0.6)
    student = torch.tensor([0.4, 0.6]).log()
    value = one_position(student, logits(torch.tensor([0.1, 0.5, 0.4])), loss="argmax_ce",
                         token_ids=torch.tensor([0, 2]))
    assert value == pytest.approx(-math.log(0.6), abs=1e-6)


def test_top_k_over_the_whole_vocabulary_equals_full_logits():
    torch.manual_seed(4)
    student, teacher = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    mask = torch.ones(2, 3, dtype=torch.bool)
    values, indices = torch.log_softmax(teacher, -1).topk(7, dim=-1)
    for loss in ("forward_kl", "reverse_kl", "jsd", "tvd"):
        full = distillation_loss(student, teacher, mask, loss=loss)
        top = distillation_loss(student, TopKTeacher(values.half(), indices.int()), mask, loss=loss)
        assert top.item() == pytest.approx(full.item(), abs=2e-3)  # fp16 cached values


def test_reduced_vocab_student_sees_the_teacher_conditioned_on_its_vocab():
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    token_ids = torch.tensor([0, 2, 3])
    q = torch.tensor([0.5, 0.25, 0.25])
    p_s = torch.tensor([0.5, 0.15, 0.1]) / 0.75
    mask = torch.ones(1, 1, dtype=torch.bool)
    value = distillation_loss(q.log().view(1, 1, 3), p.log().view(1, 1, 5), mask, token_ids=token_ids).item()
    assert value == pytest.approx((p_s * (p_s / q).log()).sum().item(), abs=1e-6)
    with pytest.raises(ValueError, match="token_ids"):
        distillation_loss(q.log().view(1, 1, 3), p.log().view(1, 1, 5), mask)


def test_cross_entropy_mix_and_label_mapping():
    token_ids = torch.tensor([0, 2, 3])
    labels = to_student_columns(torch.tensor([[3, 1]]), token_ids)
    assert labels.tolist() == [[2, -100]]
    q = torch.tensor([0.5, 0.25, 0.25])
    teacher = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]).log()
    mask = torch.ones(1, 2, dtype=torch.bool)
    student = q.log().expand(1, 2, 3)
    base = distillation_loss(student, teacher.expand(1, 2, 5), mask, token_ids=token_ids)
    mixed = distillation_loss(student, teacher.expand(1, 2, 5), mask, token_ids=token_ids, labels=labels, ce_weight=0.5)
    # one labelled token (id 3 -> column 2, q = .25), the other is outside the draft vocab; sum / 2 tokens
    assert (mixed - base).item() == pytest.approx(0.5 * math.log(4.0) / 2, abs=1e-6)
    # the plain-CE baseline ignores the teacher's distribution entirely
    ce_only = distillation_loss(student, teacher.expand(1, 2, 5), mask, loss="ce", token_ids=token_ids, labels=labels)
    assert ce_only.item() == pytest.approx(math.log(4.0) / 2, abs=1e-6)
    with pytest.raises(ValueError, match="needs labels"):
        distillation_loss(student, teacher.expand(1, 2, 5), mask, loss="ce", token_ids=token_ids)


def test_top_k_ids_outside_a_reduced_vocab_join_the_teacher_tail():
    # target p over 5 ids, student vocab {0, 2, 3}; cached top-2 target ids (0, 1): id 1 is not in the draft vocab
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.5, 0.25, 0.25])  # over target ids 0, 2, 3
    columns = to_student_columns(torch.tensor([[[0, 1]]]), torch.tensor([0, 2, 3]), ignore_index=-1)
    assert columns.tolist() == [[[0, -1]]]
    teacher = TopKTeacher(p[:2].log().view(1, 1, 2), columns)
    mask = torch.ones(1, 1, dtype=torch.bool)
    # buckets: p = (.5, tail .5), q = (.5, tail .5)
    assert distillation_loss(q.log().view(1, 1, 3), teacher, mask).item() == pytest.approx(0.0, abs=1e-6)
    assert distillation_loss(q.log().view(1, 1, 3), teacher, mask, loss="tvd").item() == pytest.approx(0.0, abs=1e-6)
    q2 = torch.tensor([0.25, 0.5, 0.25])  # buckets (.25, .75)
    value = distillation_loss(q2.log().view(1, 1, 3), teacher, mask, loss="reverse_kl").item()
    assert value == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5), abs=1e-6)


# --------------------------------------------------------------------------- acceptance objectives


def test_acceptance_rate_by_hand_full_reduced_and_topk():
    from distill.losses import acceptance_rate
    # full vocabulary: min(.8,.4) + min(.1,.4) + min(.1,.2) = 0.6
    assert acceptance_rate(Q.log().view(1, 3), P.log().view(1, 3)).item() == pytest.approx(0.6, abs=1e-6)
    # reduced vocabulary {0, 2}: p is the target's own, not renormalized: min(.8, .5) + min(.1, .5) = 0.6,
    # where renormalizing p to {0, 2} (0.889, 0.111) would count 0.5 + 0.111 = 0.611
    q_reduced = torch.tensor([[0.5, 0.5]]).log()
    alpha = acceptance_rate(q_reduced, P.log().view(1, 3), token_ids=torch.tensor([0, 2]))
    assert alpha.item() == pytest.approx(0.6, abs=1e-6)
    # a target whose mass lies mostly outside the draft vocabulary: at most p({0, 2}) = 0.2 is ever acceptable
    p_out = torch.tensor([[0.1, 0.8, 0.1]])
    best = acceptance_rate(torch.tensor([[0.5, 0.5]]).log(), p_out.log(), token_ids=torch.tensor([0, 2]))
    assert best.item() == pytest.approx(0.2, abs=1e-6)
    # top-k teacher in student columns, -1 outside the draft vocabulary: the unlisted tail and the outside id never
    # count. Target (full): ids a=0.5 (column 0), b=0.3 (outside), c=0.1 (column 1), tail 0.1
    teacher = TopKTeacher(torch.tensor([[0.5, 0.3, 0.1]]).log(), torch.tensor([[0, -1, 1]]))
    q = torch.tensor([[0.2, 0.3, 0.5]])  # student columns 0, 1, 2; column 2 unlisted
    assert acceptance_rate(q.log(), teacher).item() == pytest.approx(0.2 + 0.1, abs=1e-6)


def test_log_acceptance_and_kl_tv_by_hand():
    from distill.losses import LOG_ACCEPTANCE_EPS, kl_weight
    loss = one_position(Q.log(), P.log(), loss="log_acceptance")
    assert loss == pytest.approx(-math.log(0.6 + LOG_ACCEPTANCE_EPS), abs=1e-6)
    # one position: λ = 1 − α = 0.4; 0.4 · KL (0.5 ln 2) + 0.6 · (1 − 0.6)
    assert one_position(Q.log(), P.log(), loss="kl_tv") == pytest.approx(0.4 * 0.5 * LN2 + 0.6 * 0.4, abs=1e-6)
    # the adaptive weight: 1 − the batch's mean acceptance, clamped, detached
    alpha = torch.tensor([0.2, 0.6, 1.0], requires_grad=True)
    lam = kl_weight(alpha)
    assert lam.item() == pytest.approx(0.4) and not lam.requires_grad
    assert kl_weight(torch.tensor([1.0, 1.0])).item() == 0.0
    assert kl_weight(torch.tensor([0.0])).item() == 1.0


def test_log_acceptance_gradient_is_tv_gradient_over_alpha():
    """−log α's gradient is 1 − α's scaled by 1 / (α + ε): larger where the draft accepts little."""
    from distill.losses import LOG_ACCEPTANCE_EPS
    torch.manual_seed(3)
    teacher = torch.randn(1, 1, 7)
    grads = {}
    for loss in ("tvd", "log_acceptance"):
        student = torch.randn(1, 1, 7, generator=torch.Generator().manual_seed(4)).requires_grad_()
        distillation_loss(student, teacher, torch.ones(1, 1, dtype=torch.bool), loss=loss).backward()
        grads[loss] = student.grad
    with torch.no_grad():
        student = torch.randn(1, 1, 7, generator=torch.Generator().manual_seed(4))
        alpha = torch.minimum(teacher.softmax(-1), student.softmax(-1)).sum()
    torch.testing.assert_close(grads["log_acceptance"], grads["tvd"] / (alpha + LOG_ACCEPTANCE_EPS))


def test_acceptance_losses_never_count_mass_outside_the_draft_vocabulary():
    """A reduced-vocabulary draft that matches the target's conditional distribution exactly still has loss: the
    target's mass outside the vocabulary is unacceptable (KL on buckets would call it a perfect match)."""
    p = torch.tensor([0.3, 0.3, 0.4])
    token_ids = torch.tensor([0, 1])
    q = torch.tensor([0.5, 0.5])  # p conditioned on {0, 1}
    mask = torch.ones(1, 1, dtype=torch.bool)
    kl = distillation_loss(q.log().view(1, 1, 2), p.log().view(1, 1, 3), mask, token_ids=token_ids).item()
    assert kl == pytest.approx(0.0, abs=1e-6)
    tv_part = distillation_loss(q.log().view(1, 1, 2), p.log().view(1, 1, 3), mask, token_ids=token_ids,
                                loss="log_acceptance").item()
    assert tv_part == pytest.approx(-math.log(0.6 + 1e-3), abs=1e-6)


def test_reach_weights_are_products_of_earlier_acceptance():
    from distill.losses import reach_weights
    # one row, T = 5: loss_mask over positions [F, T, T, T, F]; step j scores loss_mask[:, 1 + j:]
    loss_mask = torch.tensor([[False, True, True, True, False]])
    masks = [loss_mask[:, 1 + j:] for j in range(3)]
    # step 0 scores indices 0, 1, 2; step 1 indices 0, 1; step 2 indices 0
    alphas = [torch.tensor([0.5, 0.4, 0.3]), torch.tensor([0.2, 0.9]), torch.tensor([0.7])]
    weights = reach_weights(alphas, masks)
    torch.testing.assert_close(weights[0], torch.ones(3))
    torch.testing.assert_close(weights[1], torch.tensor([0.5, 0.4]))
    torch.testing.assert_close(weights[2], torch.tensor([0.5 * 0.2]))
    # an earlier step that scored nothing at an index (its token in the prompt) counts 1
    loss_mask = torch.tensor([[False, False, True, True, True]])
    masks = [loss_mask[:, 1 + j:] for j in range(2)]  # step 0: indices 1, 2, 3; step 1: indices 0, 1, 2
    weights = reach_weights([torch.tensor([0.5, 0.4, 0.3]), torch.tensor([0.1, 0.2, 0.3])], masks)
    torch.testing.assert_close(weights[1], torch.tensor([1.0, 0.5, 0.4]))


def test_weights_scale_each_position():
    torch.manual_seed(5)
    student, teacher = torch.randn(3, 6), torch.randn(3, 6)
    w = torch.tensor([1.0, 0.5, 0.0])
    weighted = distillation_loss(student, teacher, weights=w, num_tokens=3, loss="kl_tv")
    alpha = torch.minimum(student.softmax(-1), teacher.softmax(-1)).sum(-1)
    lam = 1 - alpha.mean()
    per = lam * forward_kl(teacher.log_softmax(-1), student.log_softmax(-1)) + (1 - lam) * (1 - alpha)
    assert weighted.item() == pytest.approx(((per * w).sum() / 3).item(), abs=1e-6)


def test_token_losses_acceptance_is_acceptance_rates_for_a_top_k_teacher_with_its_gradient():
    """α from the loss's own buckets: the listed ids inside the draft vocabulary, never the tail or an id the draft
    cannot emit (-1), equal to `acceptance_rate` in value and gradient."""
    from distill.losses import acceptance_rate, token_losses

    torch.manual_seed(0)
    logits = torch.randn(4, 6, requires_grad=True)
    teacher = TopKTeacher(torch.log_softmax(torch.randn(4, 3), -1).half() - 0.5,
                          torch.tensor([[0, 5, -1], [2, -1, -1], [1, 3, 4], [-1, -1, -1]]).int())
    per_token, alpha = token_losses(logits, teacher, loss="kl_tv")
    expected = acceptance_rate(logits, teacher)
    torch.testing.assert_close(alpha, expected, rtol=0, atol=1e-7)
    assert alpha[3].item() == 0.0  # nothing listed the draft can emit: nothing acceptable
    grad, = torch.autograd.grad(alpha.sum(), logits, retain_graph=True)
    expected_grad, = torch.autograd.grad(expected.sum(), logits)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-7)
    assert torch.isfinite(per_token).all()
