"""distill.optimizers: the lr factor of both schedules, and Muon's share of the draft's parameters."""
import pytest
import torch
import torch.optim._muon as torch_muon

from distill.optimizers import (
    FloatMuon,
    _newton_schulz_fp32,
    build_optimizers,
    build_schedules,
    lr_factor,
    muon_split,
    newton_schulz_in_fp32,
)
from pipeline.config import DistillConfig
from tests.conftest import make_tiny_model


def test_lr_factor_warms_up_then_decays_to_the_floor():
    kw = dict(warmup=10, total=110, min_ratio=0.1)
    assert lr_factor(0, **kw) == pytest.approx(0.1) and lr_factor(9, **kw) == pytest.approx(1.0)
    assert lr_factor(10, **kw) == pytest.approx(1.0)
    assert lr_factor(60, **kw) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: cosine and linear agree
    assert lr_factor(35, **kw, schedule="linear") == pytest.approx(0.1 + 0.9 * 0.75)
    assert lr_factor(35, **kw) > lr_factor(35, **kw, schedule="linear")  # cosine stays higher early
    for schedule in ("cosine", "linear"):
        assert lr_factor(110, **kw, schedule=schedule) == pytest.approx(0.1)
        assert lr_factor(500, **kw, schedule=schedule) == pytest.approx(0.1)


def test_the_on_policy_stage_trains_at_its_own_share_where_the_epochs_decay_to_zero():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2e-3)
    d = DistillConfig(family="features", onpolicy_steps=3, onpolicy_lr_ratio=0.25)  # linear to 0 over the epochs
    schedule = build_schedules(d, [opt], total_steps=20)[0]
    lrs = []
    for _ in range(23):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        schedule.step()
    assert lrs[19] == pytest.approx(2e-3 * (1 - 14 / 15))  # the epochs' last step, on the way to 0
    assert lrs[20:] == pytest.approx([2e-3 * 0.25] * 3)


def test_muon_takes_the_layers_matrices_and_adamw_the_vocabulary_and_norms():
    draft = make_tiny_model(40, seed=0, layers=2)
    draft.get_input_embeddings().weight.requires_grad_(False)
    muon, adamw = muon_split(draft)
    names = {id(p): n for n, p in draft.named_parameters()}
    assert muon and all(p.ndim == 2 and "layers." in names[id(p)] for p in muon)
    assert any("lm_head" in names[id(p)] or "embed" in names[id(p)] for p in adamw) or draft.config.tie_word_embeddings
    assert all("norm" not in names[id(p)] for p in muon)
    assert all(p.requires_grad for p in muon + adamw)
    optimizers = build_optimizers(DistillConfig(optimizer="muon"), draft, fused=False)
    assert [type(o).__name__ for o in optimizers] == ["FloatMuon", "AdamW"]
    schedules = build_schedules(DistillConfig(optimizer="muon", lr_schedule="linear"), optimizers, 100)
    x = torch.randint(0, 40, (2, 6))
    draft(input_ids=x, labels=x).loss.backward()
    for optimizer, schedule in zip(optimizers, schedules):
        optimizer.step()
        schedule.step()
    assert len(build_optimizers(DistillConfig(), draft, fused=False)) == 1


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_the_float32_newton_schulz_is_torchs_iteration(shape):
    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    args = ((3.4445, -4.775, 2.0315), 5, 1e-7)
    ours, torchs = _newton_schulz_fp32(grad, *args), torch_muon._zeropower_via_newtonschulz(grad, *args).float()
    assert ours.dtype == torch.float32 and ours.shape == grad.shape
    assert torch.allclose(ours, torchs, atol=0.05)  # torch's runs in bf16: its error, not ours


def test_float_muon_steps_as_torchs_muon_and_restores_torch():
    original = torch_muon._zeropower_via_newtonschulz
    weights = [torch.nn.Parameter(torch.randn(16, 24, generator=torch.Generator().manual_seed(1))) for _ in range(2)]
    ours, torchs = FloatMuon([weights[0]], lr=0.02), torch.optim.Muon([weights[1]], lr=0.02)
    grad = torch.randn(16, 24, generator=torch.Generator().manual_seed(2))
    for weight, optimizer in zip(weights, (ours, torchs)):
        weight.grad = grad.clone()
        optimizer.step()
    assert torch.allclose(weights[0], weights[1], atol=2e-3)
    assert torch_muon._zeropower_via_newtonschulz is original
    with newton_schulz_in_fp32(torch.device("meta")):  # not a CPU: torch's own iteration
        assert torch_muon._zeropower_via_newtonschulz is original
