"""Faster fp32 linear layers on x86 CPUs: oneDNN's inner product on weights packed once into its blocked layout,
where it beats torch's default MKL sgemm.

oneDNN given a plain [out, in] weight reorders it on every call with more than one row, so a few-row product (a
speculative verify) would cost several one-row ones; packed once, it costs little more than one. Which kernel is
faster depends on the CPU, the weight's shape and the number of rows (docs/results.md#the-cpu-runtime), hence
the `cpu_linear` setting: "onednn" or "torch" everywhere, or "auto" (the default): per weight shape and row count,
the kernel measured faster on this machine (`AutoLinear`). `auto`'s timings (`measure_linear`) are a choice of
`decode.runtime.machine_choice`, which caches them per machine and says when they are taken on too busy a machine to
keep. `torch.nn.functional.linear` is the reference; `tests/decode/runtime/test_kernels.py` holds the parity tests.

Only inference takes the oneDNN path: with autograd recording (training), or off CPU, or in another dtype, the layer
is a plain `nn.Linear`.

`ConcatLinear` runs several layers that read the same input (a decoder layer's q, k and v; its gate and up) as one
product over their weights stacked by rows, on the kernel the layers themselves run; each layer's own forward is its
reference.
"""
from __future__ import annotations

import bisect
import itertools
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from decode.runtime.machine_choice import cache_file, interleaved_minimums, machine_key, measured

PACK_ROWS_HINT = 8  # oneDNN picks the packed layout for this many rows; other hints measured no faster
# layer -> (weak reference to the weight it was packed from, that weight's version, packed weight). Kept outside the
# module: an opaque oneDNN tensor cannot be deep-copied or pickled, and a copied layer must pack its own weight.
_packed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
KINDS = ("auto", "onednn", "torch")
# Weights cycled through while timing a small one, so that each call reads its weight from memory as decoding does
# (a step reads every layer's weight once) rather than from a cache it would never sit in: copies enough to exceed
# this many bytes, at most MAX_COPIES.
STREAM_BYTES = 64 << 20
MAX_COPIES = 64
# The row counts `auto` measures: 1 (decoding), the widths of speculative verifies (γ + 1 for small γ) and a generation
# batch. A product of n rows runs the kernel picked at the largest of these that is <= n (`AutoLinear`).
ROWS = (1, 2, 4, 6, 8, 64)
# `auto`'s timings in `decode.runtime.machine_choice`, and what they depend on besides the machine
CHOICE, SCOPE = "cpu_linear", {"rows": ROWS}
Shape = tuple[int, int]  # a linear layer's weight: (out_features, in_features)

# the dtypes `OneDNNLinear` packs: fp32, and bf16 (a bf16 product on a plain weight is reordered on every call too;
# packed once, the bf16 generation copy's products run faster, with identical results)
PACKED_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class Timing:
    """Milliseconds of one product of `rows` rows with each kernel (the fastest of the timed calls)."""

    rows: int
    torch_ms: float
    onednn_ms: float

    @property
    def pick(self) -> str:
        """The faster kernel ("torch" on a tie: it needs no packed copy of the weight)."""
        return "onednn" if self.onednn_ms < self.torch_ms else "torch"


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] fp32 or bf16 weight -> oneDNN's blocked layout (an opaque tensor only `onednn_linear` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  packed: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` through oneDNN (fp32 or bf16, CPU, no autograd), on `packed` =
    `pack_weight(weight)` if given."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, weight if packed is None else packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _version(tensor: torch.Tensor) -> int:
    """In-place changes to `tensor`, for weights derived from it (inference tensors keep no counter; they can only
    change inside inference mode, which nothing does)."""
    return -1 if tensor.is_inference() else tensor._version


class OneDNNLinear(torch.nn.Linear):
    """An `nn.Linear` that takes the oneDNN path when it can (same parameters, same state dict), on its weight packed
    at first use and packed again whenever the weight is replaced or changed in place (training, `load_state_dict`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.device.type == "cpu" and x.dtype in PACKED_DTYPES and self.weight.dtype == x.dtype
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return onednn_linear(x, self.weight, self.bias, self._packed_weight())
        return F.linear(x, self.weight, self.bias)

    def _packed_weight(self) -> torch.Tensor:
        weight = self.weight
        # The weight itself is the identity (not its address: a replacement may reuse a freed weight's memory).
        version = _version(weight)
        cached = _packed.get(self)
        if cached is None or cached[0]() is not weight or cached[1] != version:
            cached = _packed[self] = (weakref.ref(weight), version, pack_weight(weight))
        return cached[2]


class AutoLinear(OneDNNLinear):
    """An `OneDNNLinear` that takes the oneDNN path only for the row counts where it measured faster on this machine
    for this weight's shape, and `F.linear` elsewhere.

    The rule: a product of n rows (all leading dimensions together) runs the kernel that was faster at the largest
    measured row count <= n (`plan_rows`, ascending from 1; `plan_onednn` says which). So decoding (1 row), each
    verify width and a batch each get the kernel that is faster for them, with no weighting between them.
    """

    plan_rows: tuple[int, ...] = (1,)
    plan_onednn: tuple[bool, ...] = (False,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.plan_onednn[max(0, bisect.bisect_right(self.plan_rows, rows) - 1)]:
            return super().forward(x)
        return F.linear(x, self.weight, self.bias)


def streamed_weights(shape: Shape) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(weights, their packed copies): random fp32 weights of `shape`, enough of them to exceed STREAM_BYTES, for a
    timing that cycles through them so that each call reads its weight from memory as decoding does."""
    out_features, in_features = shape
    copies = max(1, min(MAX_COPIES, -(-STREAM_BYTES // (4 * out_features * in_features))))
    weights = [torch.randn(shape) for _ in range(copies)]
    return weights, [pack_weight(w) for w in weights]


def measure_linear(shape: Shape) -> list[Timing]:
    """`F.linear` against `onednn_linear` on packed weights, for a random fp32 weight of `shape` at each of ROWS rows:
    the fastest of interleaved calls (`decode.runtime.machine_choice.interleaved_minimums`), each call on the next
    of the `streamed_weights`."""
    weights, packed = streamed_weights(shape)
    with torch.inference_mode():
        return [_time_kernels(torch.randn(rows, shape[1]), weights, packed) for rows in ROWS]


def _time_kernels(x: torch.Tensor, weights: list[torch.Tensor], packed: list[torch.Tensor]) -> Timing:
    plain, blocked = itertools.cycle(weights), itertools.cycle(zip(weights, packed))

    def onednn_call() -> torch.Tensor:
        weight, packed_weight = next(blocked)
        return onednn_linear(x, weight, None, packed_weight)

    torch_s, onednn_s = interleaved_minimums([lambda: F.linear(x, next(plain)), onednn_call])
    return Timing(x.shape[0], round(torch_s * 1e3, 4), round(onednn_s * 1e3, 4))


def _parse_timings(items: list) -> list[Timing]:
    return [Timing(int(t["rows"]), float(t["torch_ms"]), float(t["onednn_ms"])) for t in items]


def shape_timings(shapes: Iterable[Shape], measure: Callable[[Shape], list[Timing]]) -> dict[Shape, list[Timing]]:
    """Timings at ROWS for each shape, measured by `measure` once per machine (`decode.runtime.machine_choice`: the
    shapes its cache lacks are measured and added, unless the machine is busy)."""
    names = {shape: f"{shape[0]}x{shape[1]}" for shape in shapes}

    def measure_named(name: str) -> list[dict]:
        out_features, in_features = (int(n) for n in name.split("x"))
        return [asdict(t) for t in measure((out_features, in_features))]

    timings = measured(CHOICE, SCOPE, list(names.values()), measure_named, parse=_parse_timings)
    return {shape: timings[name] for shape, name in names.items()}


def _auto_eligible(module: torch.nn.Module) -> bool:
    return module.weight.device.type == "cpu" and module.weight.dtype == torch.float32


SWITCHABLE = (torch.nn.Linear, OneDNNLinear, AutoLinear)  # the layer classes `use_cpu_linear` switches between


def _switchable_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) in SWITCHABLE]


def linear_shapes(model: torch.nn.Module) -> dict[Shape, int]:
    """Each distinct weight shape of the fp32 CPU linear layers `auto` decides for -> how many layers have it."""
    shapes: dict[Shape, int] = {}
    for module in _switchable_linears(model):
        if _auto_eligible(module):
            shape = (module.out_features, module.in_features)
            shapes[shape] = shapes.get(shape, 0) + 1
    return shapes


def cpu_linear_report(model: torch.nn.Module) -> dict:
    """What "auto" picks for `model` on this machine and why: the machine key, its cache file, and per weight shape
    (largest first) how many layers have it and, per measured row count, both kernels' ms and the pick."""
    shapes = linear_shapes(model)
    timings = shape_timings(shapes, measure_linear)
    return {"key": machine_key(), "cache_file": str(cache_file(CHOICE, SCOPE)), "shapes": [
        {"weight": list(shape), "layers": layers, "timings": [{**asdict(t), "pick": t.pick} for t in timings[shape]]}
        for shape, layers in sorted(shapes.items(), key=lambda item: (-item[0][0] * item[0][1], item[0]))]}


def cpu_linear_of(model: torch.nn.Module) -> str:
    """The kind `use_cpu_linear` gave `model` (a draft follows its target; "auto" off CPU gave "torch")."""
    kinds = {type(m) for m in model.modules()}
    return "auto" if AutoLinear in kinds else "onednn" if OneDNNLinear in kinds else "torch"


def use_cpu_linear(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """Switch every `nn.Linear` of `model` to `kind` in place; returns the model.

    "onednn": `OneDNNLinear`; "torch": `nn.Linear`; "auto": `AutoLinear` on each fp32 CPU layer, planned from this
    machine's cached timings of its weight shape (`shape_timings`: measured here on first use), and `nn.Linear` on
    any other device or dtype. A draft loaded with "auto" shares the target's plans for the shapes they have in common
    (same cache) and has its own shapes measured. "onednn" and "auto" fall back to "torch"
    where this torch build has no oneDNN.
    """
    if kind not in KINDS:
        raise ValueError(f"cpu_linear must be one of {', '.join(KINDS)}; got {kind!r}")
    linears = _switchable_linears(model)
    if kind == "torch" or not torch.backends.mkldnn.is_available():
        for module in linears:
            module.__class__ = torch.nn.Linear
    elif kind == "onednn":
        for module in linears:
            module.__class__ = OneDNNLinear
    else:
        shapes = linear_shapes(model)
        plans = shape_timings(shapes, measure_linear) if shapes else {}
        for module in linears:
            timings = plans.get((module.out_features, module.in_features)) if _auto_eligible(module) else None
            if timings is None:
                module.__class__ = torch.nn.Linear
                continue
            module.__class__ = AutoLinear
            module.plan_rows = tuple(t.rows for t in timings)
            module.plan_onednn = tuple(t.pick == "onednn" for t in timings)
    return model


class ConcatLinear:
    """Linear layers that read the same input, run as one product over their weights stacked by rows -> the tuple of
    their outputs. A decoder step on a CPU reads every weight once for one or a few rows, so each product costs its
    weight's read plus a per-call cost that small weights do not amortize: one call per decoder layer for q, k and v
    and one for gate and up instead of five.

    The stacked weight is derived from the layers' own, like a packed one (`OneDNNLinear`): built at first use and
    again whenever a layer's weight or bias is replaced or changed in place (training). The product runs the kernel
    the first layer runs at that moment ("auto" with its own plan for the stacked shape, "onednn" or "torch"), so
    `use_cpu_linear` and `torch_kernels` on the model switch it too.
    """

    def __init__(self, layers: Sequence[torch.nn.Linear]):
        if len({layer.in_features for layer in layers}) != 1 or len({layer.bias is None for layer in layers}) != 1:
            raise ValueError("stacked layers need one input size, and a bias on all of them or none")
        self.layers = list(layers)
        self.sizes = [layer.out_features for layer in layers]
        self.stacked: torch.nn.Linear | None = None
        self.kind: type | None = None  # the first layer's class when `stacked` was switched to its kernel
        self.source: list[tuple[torch.Tensor, int]] = []  # (tensor, version) it was stacked from

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each layer's output; each layer's own forward where a layer is not one `use_cpu_linear` switches (an int8
        dynamic one, say) or where autograd would need their own weights."""
        if (any(type(layer) not in SWITCHABLE for layer in self.layers)
                or torch.is_grad_enabled() and any(layer.weight.requires_grad for layer in self.layers)):
            return tuple(layer(x) for layer in self.layers)
        return self.current()(x).split(self.sizes, -1)

    def current(self) -> torch.nn.Linear:
        """The stacked layer, rebuilt if a source tensor changed, on the kernel the first layer runs."""
        tensors = [t for layer in self.layers for t in (layer.weight, layer.bias) if t is not None]
        if self.stacked is None or any(t is not s or _version(t) != v for t, (s, v) in zip(tensors, self.source)):
            first = self.layers[0]
            # skip_init: no random initialization of weights that are overwritten at once (~10 ms a layer)
            stacked = torch.nn.utils.skip_init(torch.nn.Linear, first.in_features, sum(self.sizes),
                                               bias=first.bias is not None, device=first.weight.device,
                                               dtype=first.weight.dtype)
            with torch.no_grad():
                stacked.weight.copy_(torch.cat([layer.weight for layer in self.layers]))
                if first.bias is not None:
                    stacked.bias.copy_(torch.cat([layer.bias for layer in self.layers]))
            self.stacked, self.kind = stacked.requires_grad_(False), None
            self.source = [(t, _version(t)) for t in tensors]
        kind = type(self.layers[0])
        if kind is not self.kind:
            use_cpu_linear(self.stacked, cpu_linear_of(self.layers[0]))
            self.kind = kind
        return self.stacked


@contextmanager
def torch_kernels(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """For the duration, every linear layer of `model` runs torch's own kernel, as it does without draftops; then each
    is back as it was (plans and packed weights kept)."""
    kinds = {module: type(module) for module in _switchable_linears(model)}
    for module in kinds:
        module.__class__ = torch.nn.Linear
    try:
        yield model
    finally:
        for module, cls in kinds.items():
            module.__class__ = cls
