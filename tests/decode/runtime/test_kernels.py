"""The oneDNN linear path and `cpu_linear: auto` against their reference, F.linear."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from decode.runtime import kernels, machine_choice
from decode.runtime.forward import ModelRunner, greedy_decode
from decode.runtime.kernels import (
    CHOICE,
    ROWS,
    SCOPE,
    AutoLinear,
    ConcatLinear,
    OneDNNLinear,
    Timing,
    cpu_linear_of,
    linear_shapes,
    onednn_linear,
    pack_weight,
    shape_timings,
    torch_kernels,
    use_cpu_linear,
)
from decode.runtime.machine_choice import cache_file, machine_key
from pipeline.cli import main
from tests.conftest import make_tiny_model
from tests.decode.tiny import tiny_llama

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_reference(rows, bias):
    torch.manual_seed(rows)
    x, weight = torch.randn(3, rows, 96), torch.randn(200, 96)
    b = torch.randn(200) if bias else None
    torch.testing.assert_close(onednn_linear(x, weight, b), F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="oneDNN packs bf16 weights only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; draftops "
                    "generates in bf16 only on CPUs with bf16 units")
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_a_packed_bfloat16_weight_gives_the_plain_bfloat16_product(rows):
    torch.manual_seed(rows)
    x, weight, bias = torch.randn(rows, 96).bfloat16(), torch.randn(200, 96).bfloat16(), torch.randn(200).bfloat16()
    out = onednn_linear(x, weight, bias, pack_weight(weight))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x, weight, bias).float(), rtol=1e-2, atol=1e-2)


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


# --------------------------------------------------------------------------- stacked products


def three_layers(bias: bool) -> list[torch.nn.Linear]:
    torch.manual_seed(3)
    return [torch.nn.Linear(16, out, bias=bias) for out in (12, 4, 4)]  # q, k, v of a 3-head, 1-kv-head layer


@pytest.mark.parametrize("kind", ["torch", "onednn", "auto"])
@pytest.mark.parametrize("bias", [False, True])
def test_stacked_product_gives_each_layers_own_output(kind, bias, monkeypatch):
    monkeypatch.setattr(kernels, "measure_linear", timings_of("ototot"))
    layers = three_layers(bias)
    for layer in layers:
        use_cpu_linear(layer, kind)
    stacked = ConcatLinear(layers)
    with torch.inference_mode():
        for rows in (1, 2, 6, 64):
            x = torch.randn(1, rows, 16)
            outputs = stacked(x)
            assert [o.shape for o in outputs] == [(1, rows, 12), (1, rows, 4), (1, rows, 4)]
            for out, layer in zip(outputs, layers):
                torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert type(stacked.current()) is type(layers[0])
    if kind == "auto":  # its own plan, for its own (stacked) shape
        assert stacked.current().plan_onednn == (True, False, True, False, True, False)


def test_stacked_product_follows_its_layers_weights_and_kernel():
    layers = three_layers(bias=True)
    for layer in layers:
        use_cpu_linear(layer, "onednn")
    stacked = ConcatLinear(layers)
    x = torch.randn(3, 16)

    def assert_matches():
        for out, layer in zip(stacked(x), layers):
            torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)

    with torch.no_grad():
        assert_matches()
        layers[1].weight.mul_(2)  # in place, as an optimizer step does
        assert_matches()
        layers[2].bias = torch.nn.Parameter(torch.randn(4))  # replaced, as load_state_dict(assign=True) does
        assert_matches()
        assert type(stacked.current()) is OneDNNLinear
        with torch_kernels(torch.nn.ModuleList(layers)):
            assert_matches()
            assert type(stacked.current()) is torch.nn.Linear
        assert type(stacked.current()) is OneDNNLinear


def test_stacked_product_leaves_gradients_to_the_layers_own_weights():
    layers = three_layers(bias=False)
    x = torch.randn(2, 16)
    sum(out.square().sum() for out in ConcatLinear(layers)(x)).backward()
    for layer in layers:
        expected = 2 * F.linear(x, layer.weight).T @ x
        torch.testing.assert_close(layer.weight.grad, expected)


def test_layers_of_other_kinds_run_their_own_forward():
    layers = three_layers(bias=True)
    layers[1] = torch.ao.nn.quantized.dynamic.Linear(16, 4)  # int8 weights: nothing to stack
    stacked = ConcatLinear(layers)
    x = torch.randn(2, 16)
    with torch.inference_mode():
        for out, layer in zip(stacked(x), layers):
            assert torch.equal(out, layer(x))
    assert stacked.stacked is None


def test_stacked_layers_must_share_their_input_and_bias_kind():
    with pytest.raises(ValueError, match="one input size"):
        ConcatLinear([torch.nn.Linear(16, 4), torch.nn.Linear(8, 4)])
    with pytest.raises(ValueError, match="a bias on all"):
        ConcatLinear([torch.nn.Linear(16, 4), torch.nn.Linear(16, 4, bias=False)])


# --------------------------------------------------------------------------- cpu_linear: auto


def timings_of(picks: str):
    """Hand-made timings at ROWS: "t" where torch is faster, "o" where oneDNN is."""
    def measure(shape):
        return [Timing(rows, torch_ms=1.0, onednn_ms=0.5 if pick == "o" else 2.0) for rows, pick in zip(ROWS, picks)]
    return measure


def test_the_faster_kernel_is_picked_and_a_tie_keeps_torch():
    assert Timing(1, torch_ms=0.2, onednn_ms=0.3).pick == "torch"
    assert Timing(2, torch_ms=0.5, onednn_ms=0.3).pick == "onednn"
    assert Timing(6, torch_ms=0.3, onednn_ms=0.3).pick == "torch"


def test_auto_runs_the_kernel_picked_at_the_largest_measured_row_count_at_or_below(monkeypatch):
    monkeypatch.setattr(kernels, "measure_linear", timings_of("tototo"))  # at 1 2 4 6 8 64 rows
    layer = use_cpu_linear(torch.nn.Sequential(torch.nn.Linear(16, 8)), "auto")[0]
    assert type(layer) is AutoLinear and cpu_linear_of(torch.nn.Sequential(layer)) == "auto"
    assert layer.plan_rows == (1, 2, 4, 6, 8, 64)
    assert layer.plan_onednn == (False, True, False, True, False, True)
    onednn_rows = []

    def spy(x, weight, bias, packed=None):
        onednn_rows.append(x.numel() // x.shape[-1])
        return onednn_linear(x, weight, bias, packed)

    monkeypatch.setattr(kernels, "onednn_linear", spy)
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 6, 7, 8, 63, 64, 300):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
        layer(torch.randn(2, 3, 16))  # leading dimensions together: 6 rows
    assert onednn_rows == [2, 3, 6, 7, 64, 300, 6]


def test_auto_matches_torch_kernels_logits_and_greedy_outputs(monkeypatch):
    monkeypatch.setattr(kernels, "measure_linear", timings_of("ttoooo"))  # decoding on torch, verifies on oneDNN
    reference = tiny_llama(0).float()  # peaked next-token distributions: no near ties for greedy to flip on
    model = use_cpu_linear(copy.deepcopy(reference), "auto")
    assert sum(isinstance(m, AutoLinear) for m in model.modules()) == 2 * 7 + 1
    ids = torch.randint(0, 128, (1, 9))
    with torch.inference_mode():
        for rows in (1, 2, 5, 9):  # a step, verifies, a prefill
            torch.testing.assert_close(model(ids[:, :rows]).logits, reference(ids[:, :rows]).logits,
                                       rtol=1e-5, atol=1e-5)
        greedy = dict(do_sample=False, max_new_tokens=24, attention_mask=torch.ones_like(ids), pad_token_id=0)
        assert torch.equal(model.generate(ids, **greedy), reference.generate(ids, **greedy))
    runner, plain = ModelRunner(model), ModelRunner(reference)  # the decoder's lean forward, 6-row verifies
    assert greedy_decode(runner, ids[0].tolist(), 24) == greedy_decode(plain, ids[0].tolist(), 24)


def test_auto_measures_each_shape_once_per_machine_and_a_draft_only_its_own(monkeypatch, isolated_home):
    monkeypatch.setattr(machine_choice, "machine_busy", lambda: None)  # a busy machine caches nothing (tested apart)
    measured = []

    def measure(shape):
        measured.append(shape)
        return timings_of("oooooo")(shape)

    monkeypatch.setattr(kernels, "measure_linear", measure)
    target = use_cpu_linear(make_tiny_model(64), "auto")  # q o (and the 64-row head): 64x64, k v 32x64, MLP
    assert sorted(measured) == [(32, 64), (64, 64), (64, 128), (128, 64)]
    assert linear_shapes(target) == {(64, 64): 2 * 2 + 1, (32, 64): 2 * 2, (128, 64): 2 * 2, (64, 128): 2}
    draft = make_tiny_model(64, layers=1)
    draft.lm_head = torch.nn.Linear(64, 40, bias=False)  # a reduced-vocabulary head: a shape the target lacks
    use_cpu_linear(draft, cpu_linear_of(target))
    assert sorted(measured) == [(32, 64), (40, 64), (64, 64), (64, 128), (128, 64)]
    assert all(m.plan_onednn == (True,) * 6 for m in draft.modules() if isinstance(m, AutoLinear))
    use_cpu_linear(make_tiny_model(64), "auto")  # the cache holds every shape now
    assert len(measured) == 5


def test_auto_off_cpu_or_off_float32_leaves_torch_kernels_unmeasured(monkeypatch):
    monkeypatch.setattr(kernels, "measure_linear", lambda shape: pytest.fail(f"measured {shape}"))
    for model in (make_tiny_model(64).to(torch.bfloat16), make_tiny_model(64).to("meta")):
        use_cpu_linear(model, "auto")
        assert cpu_linear_of(model) == "torch" and type(model.lm_head) is torch.nn.Linear


def test_auto_measures_for_real_on_this_machine(monkeypatch, isolated_home):
    monkeypatch.setattr(machine_choice, "machine_busy", lambda: None)  # cached even while other tests load the CPU
    model = use_cpu_linear(make_tiny_model(64), "auto")
    cached = shape_timings(linear_shapes(model), lambda shape: pytest.fail(f"measured {shape} again"))
    assert set(cached) == set(linear_shapes(model)) == {(64, 64), (32, 64), (128, 64), (64, 128)}
    for timings in cached.values():
        assert [t.rows for t in timings] == list(ROWS) and all(t.torch_ms > 0 and t.onednn_ms > 0 for t in timings)
    assert model.lm_head.plan_onednn == tuple(t.pick == "onednn" for t in cached[(64, 64)])


def test_torch_kernels_for_a_while_then_back_as_they_were(monkeypatch):
    monkeypatch.setattr(kernels, "measure_linear", timings_of("ttoooo"))
    model = use_cpu_linear(make_tiny_model(64), "auto")
    use_cpu_linear(model.lm_head, "onednn")
    with torch_kernels(model):
        assert cpu_linear_of(model) == "torch"
    assert type(model.lm_head) is OneDNNLinear and type(model.model.layers[0].mlp.up_proj) is AutoLinear
    assert model.model.layers[0].mlp.up_proj.plan_onednn == (False, False, True, True, True, True)


def test_models_info_kernels_shows_each_shapes_timings_picks_and_the_cache(monkeypatch, tiny_checkpoint, capsys,
                                                                          isolated_home):
    monkeypatch.setattr(kernels, "measure_linear", timings_of("ttoooo"))
    assert main(["models", "info", str(tiny_checkpoint), "--kernels", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layers"] == 2  # the checkpoint's facts first
    report = out["cpu_linear"]
    assert report["key"] == machine_key() and report["cache_file"] == str(cache_file(CHOICE, SCOPE))
    assert report["cache_file"].startswith(str(isolated_home / "draftops_home" / "machine_choice" / "cpu_linear"))
    # largest weight first (make_tiny_model: hidden 64, MLP 128, 2 kv heads; the tokenizer's 50 words)
    assert [(s["weight"], s["layers"]) for s in report["shapes"]] == [
        ([64, 128], 2), ([128, 64], 4), ([64, 64], 4), ([50, 64], 1), ([32, 64], 4)]
    assert report["shapes"][0]["timings"][:3] == [{"rows": 1, "torch_ms": 1.0, "onednn_ms": 2.0, "pick": "torch"},
                                                  {"rows": 2, "torch_ms": 1.0, "onednn_ms": 2.0, "pick": "torch"},
                                                  {"rows": 4, "torch_ms": 1.0, "onednn_ms": 0.5, "pick": "onednn"}]

    assert main(["models", "info", str(tiny_checkpoint), "--kernels"]) == 0
    text = capsys.readouterr().out
    assert f"cache: {cache_file(CHOICE, SCOPE)}" in text
    assert "   64 x 128      2     1      1.000      2.000  torch" in text
    assert "                         4      1.000      0.500  onednn" in text
