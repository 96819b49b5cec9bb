"""decode.measure.quantized: the int8 copy of a target and its distance from the fp32 one."""
from __future__ import annotations

import pytest
import torch

from decode.measure.quantized import int8_dynamic, quantization_quality
from decode.runtime.forward import ModelRunner, greedy_decode
from decode.runtime.kernels import use_cpu_linear
from tests.decode.tiny import tiny_llama


def fp32_llama(seed: int) -> torch.nn.Module:
    return tiny_llama(seed, init_range=0.05).float()


def test_int8_copy_quantizes_the_linear_layers_but_down_proj_and_leaves_the_model_as_it_was():
    model = use_cpu_linear(fp32_llama(0), "onednn")
    kinds = [type(m) for m in model.modules()]
    quantized = int8_dynamic(model)
    assert [type(m) for m in model.modules()] == kinds  # the original keeps its kernels
    int8 = {name for name, m in quantized.named_modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)}
    assert len(int8) == 2 * 6 + 1  # q, k, v, o, gate, up per layer, and the head
    fp32 = {name for name, m in quantized.named_modules() if type(m) is torch.nn.Linear}
    assert fp32 == {"model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"}  # FP32_LAYERS
    assert len([m for m in int8_dynamic(model, fp32_layers=()).modules()
                if isinstance(m, torch.ao.nn.quantized.dynamic.Linear)]) == 2 * 7 + 1
    assert quantized.model.embed_tokens.weight.dtype == torch.float32
    prompt = [5, 9, 2, 77, 3, 5, 9]
    # it runs through the decoder's own forward, near the fp32 model (8-bit activations of a 64-wide model: ~5%)
    with torch.inference_mode():
        reference = ModelRunner(model).forward(torch.tensor(prompt), ModelRunner(model).new_cache(), 0, False)
        runner = ModelRunner(quantized)
        got = runner.forward(torch.tensor(prompt), runner.new_cache(), 0, False)
    assert runner.lean is not None and (got - reference).abs().max() < 0.1 * reference.abs().max()
    with pytest.raises(ValueError, match="takes an fp32 CPU model, not torch.float64 on cpu"):
        int8_dynamic(tiny_llama(0))


def test_quality_is_kl_and_greedy_agreement_on_the_references_responses():
    model = fp32_llama(1)
    prompts = [[5, 9, 2, 77], [3, 3, 8]]
    runner = ModelRunner(model)
    responses = [greedy_decode(runner, p, 6) for p in prompts]
    same = quantization_quality(model, model, prompts, responses)
    assert same["kl"]["value"] == pytest.approx(0.0, abs=1e-6) and same["agreement"]["value"] == 1.0
    assert same["positions"] == 12
    # another model: KL and agreement by hand over the 12 positions
    other = fp32_llama(2)
    kl, agreed = 0.0, 0
    for prompt, response in zip(prompts, responses):
        tokens = torch.tensor([prompt + response])
        with torch.no_grad():
            p = model(tokens).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
            q = other(tokens).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        kl += float((p.exp() * (p - q)).sum())
        agreed += int((q.argmax(-1) == torch.tensor(response)).sum())
    quality = quantization_quality(model, other, prompts, responses)
    assert quality["kl"]["value"] == pytest.approx(kl / 12, rel=1e-4)
    assert quality["agreement"]["value"] == pytest.approx(agreed / 12)
