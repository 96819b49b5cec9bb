"""The oneDNN linear path against its reference, F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decode.kernels import OneDNNLinear, cpu_linear_of, onednn_linear, use_cpu_linear
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_reference(rows, bias):
    torch.manual_seed(rows)
    x, weight = torch.randn(3, rows, 96), torch.randn(200, 96)
    b = torch.randn(200) if bias else None
    torch.testing.assert_close(onednn_linear(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


def test_model_outputs_unchanged_and_training_takes_the_reference_path():
    model = make_tiny_model(64).eval()
    ids = torch.randint(0, 64, (2, 9))
    with torch.inference_mode():
        reference = model(ids).logits
    use_cpu_linear(model, "onednn")
    assert cpu_linear_of(model) == "onednn"
    assert sum(isinstance(m, OneDNNLinear) for m in model.modules()) == 2 * 7 + 1  # q k v o gate up down, head
    with torch.inference_mode():
        fast = model(ids).logits
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(fast.argmax(-1), reference.argmax(-1))

    model.train()
    loss = model(ids, labels=ids).loss
    loss.backward()  # the oneDNN op has no backward: recording autograd must fall back to F.linear
    assert model.lm_head.weight.grad is not None
    assert set(model.state_dict()) == set(make_tiny_model(64).state_dict())

    use_cpu_linear(model, "torch")
    assert cpu_linear_of(model) == "torch" and type(model.lm_head) is torch.nn.Linear


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="cpu_linear must be"):
        use_cpu_linear(make_tiny_model(64), "mkl")


@pytest.mark.parametrize("rows", [1, 2, 6, 300])
def test_packed_weight_matches_reference(rows):
    from decode.kernels import pack_weight

    torch.manual_seed(rows)
    x, weight, bias = torch.randn(rows, 96), torch.randn(200, 96), torch.randn(200)
    torch.testing.assert_close(onednn_linear(x, weight, bias, pack_weight(weight)), F.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-4)


def test_layer_repacks_when_its_weight_changes_and_copies_pack_their_own():
    import copy

    layer = use_cpu_linear(torch.nn.Sequential(torch.nn.Linear(16, 8)), "onednn")[0]
    x = torch.randn(3, 16)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2)  # in place, as an optimizer step does
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.weight = torch.nn.Parameter(torch.randn(8, 16))  # replaced, as load_state_dict(assign=True) does
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        twin = copy.deepcopy(layer)  # the packed copy lives outside the module: deepcopy works
        twin.weight.zero_()
        assert torch.equal(twin(x), twin.bias.expand(3, 8))
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert not torch.equal(before, layer(x))
