"""The target quantized instead of drafted for: torch's dynamic int8 linear layers, and what they cost in quality.

Speculative decoding gives the target's own output; a quantized target gives another model's, faster. Which buys more
on a machine is what `draftops sweep` puts side by side (`decode.measure.sweep.measure_quantization`): tokens/s of the
fp32 target alone, the int8 target alone and the speculative decoder, and the int8 target's distance from the fp32 one
on held-out traffic (`quantization_quality`).

torch's dynamic quantization (`torch.ao.quantization.quantize_dynamic`: int8 weights per output channel, activations
quantized per call with one scale per tensor) is what runs on a stock CPU torch build; torch marks its quantized
tensors deprecated in favour of torchao, which this project does not install.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence

import torch
from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

from decode.runtime.forward import ModelRunner
from decode.runtime.kernels import use_cpu_linear
from pipeline.intervals import ratio_ci

FP32_LAYERS = ("down_proj",)  # linear layers int8_dynamic leaves in fp32, by name


def int8_dynamic(model: torch.nn.Module, fp32_layers: Sequence[str] = FP32_LAYERS) -> torch.nn.Module:
    """A copy of `model` (fp32, CPU) whose linear layers, the head included, are torch's dynamic int8 ones, except
    those whose name contains one of `fp32_layers`; the embeddings and norms stay fp32. `model` is left as it is.

    The MLP's down projection stays fp32 by default: its input carries the few very large activations of a Llama
    MLP, which one int8 scale per tensor cannot hold beside the small ones; quantized, it accounts for most of the
    int8 copy's distance from the fp32 model (docs/results.md has the measurement by layer)."""
    parameter = next(model.parameters())
    if parameter.device.type != "cpu" or parameter.dtype != torch.float32:
        raise ValueError(f"int8 dynamic quantization takes an fp32 CPU model, not {parameter.dtype} on "
                         f"{parameter.device.type}")
    quantized = use_cpu_linear(copy.deepcopy(model), "torch")  # plain nn.Linear: what quantize_dynamic replaces
    spec = {name: per_channel_dynamic_qconfig for name, module in quantized.named_modules()
            if type(module) is torch.nn.Linear and not any(layer in name for layer in fp32_layers)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        return quantize_dynamic(quantized, spec, inplace=True).eval()


@torch.inference_mode()
def quantization_quality(reference: torch.nn.Module, quantized: torch.nn.Module, prompts: Sequence[list[int]],
                         responses: Sequence[list[int]], seed: int = 0) -> dict:
    """How far `quantized` is from `reference` on the reference's own greedy `responses` to `prompts`, teacher-forced:
    the mean next-token KL(reference ‖ quantized) in nats and the share of positions where the quantized model's
    argmax is the reference's token (its greedy agreement), each with a 95% bootstrap interval over prompts."""
    kl_sums, agreed, positions = [], [], []
    for prompt, response in zip(prompts, responses):
        device = next(reference.parameters()).device
        tokens = torch.tensor(prompt + response, device=device)
        span = slice(len(prompt) - 1, len(prompt) + len(response) - 1)  # the positions predicting the response

        def logits_of(model):
            runner = ModelRunner(model)
            return runner.forward(tokens, runner.new_cache(), 0, False)[span].float()

        want, got = logits_of(reference).log_softmax(-1), logits_of(quantized).log_softmax(-1)
        kl_sums.append(float((want.exp() * (want - got)).sum()))
        agreed.append(int((got.argmax(-1) == tokens[span.start + 1 : span.stop + 1]).sum()))
        positions.append(len(response))
    return {"kl": ratio_ci(kl_sums, positions, seed=seed).to_dict(),
            "agreement": ratio_ci(agreed, positions, seed=seed).to_dict(), "positions": sum(positions)}
