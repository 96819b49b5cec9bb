"""The draft's optimizers and their learning-rate schedule: AdamW over every trained parameter, or Muon over the
draft layers' weight matrices with AdamW over the rest (speculators' and Keller Jordan's split: embeddings and the
head stay with AdamW), each stepped by the same warmup-then-decay factor."""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.optim._muon as torch_muon

from pipeline.config import DistillConfig

# 2-D parameters that AdamW keeps under `optimizer: muon`: a vocabulary's rows are not one linear map to orthogonalize
ADAMW_ONLY = ("embed_tokens", "lm_head")


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float, schedule: str = "cosine") -> float:
    """Learning-rate factor of step `step`: linear warmup, then a cosine or linear decay to `min_ratio`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    decay = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1.0 - progress
    return min_ratio + (1 - min_ratio) * decay


def muon_split(model: torch.nn.Module) -> tuple[list, list]:
    """(Muon's parameters, AdamW's): Muon takes the trained 2-D matrices with both sides > 1, not a vocabulary's."""
    muon, adamw = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        matrix = param.ndim == 2 and min(param.shape) > 1 and not any(hint in name for hint in ADAMW_ONLY)
        (muon if matrix else adamw).append(param)
    return muon, adamw


def build_optimizers(d: DistillConfig, draft: torch.nn.Module, *, fused: bool) -> list[torch.optim.Optimizer]:
    """`d.optimizer` over the draft's trained parameters at `d.learning_rate`. fused: AdamW's one-kernel step (where
    accelerate neither shards nor moves the parameters)."""
    def adamw(params):
        return torch.optim.AdamW(params, lr=d.learning_rate, weight_decay=d.weight_decay, fused=fused or None)

    if d.optimizer == "adamw":
        return [adamw([p for p in draft.parameters() if p.requires_grad])]
    muon, rest = muon_split(draft)
    # match_rms_adamw: Muon's update scaled to AdamW's RMS, so one learning rate serves both
    optimizers = [FloatMuon(muon, lr=d.learning_rate, weight_decay=d.weight_decay,
                                   adjust_lr_fn="match_rms_adamw")] if muon else []
    return optimizers + ([adamw(rest)] if rest else [])


def bf16_products_are_emulated(device: torch.device) -> bool:
    """A CPU without bf16 units (no AVX512_BF16 or AMX): torch's bf16 products there are emulated, an order of
    magnitude slower than fp32 ones."""
    return device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _newton_schulz_fp32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                        eps: float) -> torch.Tensor:
    """torch's `_zeropower_via_newtonschulz` (the quintic iteration, same coefficients and steps) in float32."""
    a, b, c = ns_coefficients
    ortho = grad.float()
    if grad.size(0) > grad.size(1):
        ortho = ortho.T
    ortho = ortho / ortho.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = ortho @ ortho.T
        ortho = torch.addmm(ortho, torch.addmm(gram, gram, gram, beta=b, alpha=c), ortho, beta=a)
    return ortho.T if grad.size(0) > grad.size(1) else ortho


@contextmanager
def newton_schulz_in_fp32(device: torch.device):
    """Within it, torch's Muon orthogonalizes in float32 where bf16 products are emulated (elsewhere: unchanged)."""
    if not bf16_products_are_emulated(device):
        yield
        return
    original = torch_muon._zeropower_via_newtonschulz
    torch_muon._zeropower_via_newtonschulz = _newton_schulz_fp32
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = original


class FloatMuon(torch.optim.Muon):
    """torch's Muon, its Newton–Schulz iterations in float32 on a CPU without bf16 units, where its bf16 ones make
    each optimizer step many times a draft's forward and backward."""

    @torch.no_grad()
    def step(self, closure=None):
        device = next(p.device for group in self.param_groups for p in group["params"])
        with newton_schulz_in_fp32(device):
            return super().step(closure)


def build_schedules(d: DistillConfig, optimizers: list, total_steps: int) -> list:
    """One warmup-then-decay schedule per optimizer over the epochs' `total_steps` (`lr_factor`); the on-policy
    stage after them at its own constant share, `onpolicy_lr_ratio`."""
    def factor(step: int) -> float:
        if step >= total_steps:  # a schedule that ends at 0 (the feature default) would leave the stage untrained
            return d.onpolicy_lr_ratio
        return lr_factor(step, warmup=d.warmup_steps, total=total_steps, min_ratio=d.min_lr_ratio,
                         schedule=d.lr_schedule)
    return [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in optimizers]
