"""Faster fp32 linear layers on x86 CPUs: oneDNN's inner product on weights packed once into its blocked layout,
instead of torch's default MKL sgemm.

oneDNN given a plain [out, in] weight reorders it on every call with more than one row, so a few-row product (a
speculative verify) would cost several one-row ones; packed once, it costs little more than one. Which kernel is
faster depends on the CPU (docs/cpu-runtime.md has the measurements), hence the `cpu_linear` setting.
`torch.nn.functional.linear` is the reference; `tests/decode/test_kernels.py` holds the parity test.

Only inference takes the oneDNN path: with autograd recording (training), or off CPU, or in another dtype, the layer
is a plain `nn.Linear`.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

PACK_ROWS_HINT = 8  # oneDNN picks the packed layout for this many rows; measured the same for hints 4-64
# layer -> (weak reference to the weight it was packed from, that weight's version, packed weight). Kept outside the
# module: an opaque oneDNN tensor cannot be deep-copied or pickled, and a copied layer must pack its own weight.
_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] fp32 weight -> oneDNN's blocked layout (an opaque tensor only `onednn_linear` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  packed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through oneDNN (fp32, CPU, no autograd), on `packed` = `pack_weight(weight)` if
    given."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, weight if packed is None else packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


class OneDNNLinear(torch.nn.Linear):
    """An `nn.Linear` that takes the oneDNN path when it can (same parameters, same state dict), on its weight packed
    at first use and packed again whenever the weight is replaced or changed in place (training, `load_state_dict`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type == "cpu" and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return onednn_linear(x, self.weight, self.bias, self._packed_weight())
        return F.linear(x, self.weight, self.bias)

    def _packed_weight(self) -> torch.Tensor:
        weight = self.weight
        # inference tensors keep no version counter; they can only change inside inference mode, which nothing does.
        # The weight itself is the identity (not its address: a replacement may reuse a freed weight's memory).
        version = -1 if weight.is_inference() else weight._version
        cached = _packed.get(self)
        if cached is None or cached[0]() is not weight or cached[1] != version:
            cached = _packed[self] = (weakref.ref(weight), version, pack_weight(weight))
        return cached[2]


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
