"""Faster fp32 linear layers on x86 CPUs: oneDNN's inner product instead of torch's default MKL sgemm.

Measured on this 2-core AMD EPYC (README "Running fast on a CPU"): MKL's sgemm runs 2-3x slower than oneDNN at
every batch size except one-row products through small weights, and the gap is widest where speculative decoding lives:
a 5-token verify through SmolLM2's 49k x 576 head takes 12.1 ms with MKL and 4.0 ms with oneDNN. `torch.nn.functional.linear`
is the reference; `tests/pipeline/test_kernels.py` holds the parity test.

Only inference takes the oneDNN path: with autograd recording (training), or off CPU, or in another dtype, the layer
is a plain `nn.Linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through oneDNN (fp32, CPU, no autograd)."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


class OneDNNLinear(torch.nn.Linear):
    """An `nn.Linear` that takes the oneDNN path when it can (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type == "cpu" and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return onednn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def cpu_linear_of(model: torch.nn.Module) -> str:
    """The kind `use_cpu_linear` gave `model` (a draft follows its target)."""
    return "onednn" if any(isinstance(m, OneDNNLinear) for m in model.modules()) else "torch"


def use_cpu_linear(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """Switch every `nn.Linear` of `model` to `kind` ("onednn" or "torch") in place; returns the model.

    "onednn" falls back to "torch" where this torch build has no oneDNN.
    """
    if kind not in ("onednn", "torch"):
        raise ValueError(f"cpu_linear must be 'onednn' or 'torch', got {kind!r}")
    cls = OneDNNLinear if kind == "onednn" and torch.backends.mkldnn.is_available() else torch.nn.Linear
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and type(module) in (torch.nn.Linear, OneDNNLinear):
            module.__class__ = cls
    return model
