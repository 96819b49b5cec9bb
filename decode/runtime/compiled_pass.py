"""The lean forward's passes through `torch.compile` (`decode.compiled`): `CompiledPass` and inductor's options.

A step of a small model on a CPU is mostly per-call cost and weight reads: on a CPU the graph is compiled with the
weights frozen into it, inductor's C++ GEMM templates on weights it packs once, on register blocks of at most
`GEMM_BLOCK_ROWS` rows (`narrow_gemm_blocks`), and a C++ wrapper, so that one call runs the whole pass. Passes of more
than `SHORT_PASS_TOKENS` tokens have a graph of their own. Compiling takes minutes on a small CPU and is redone by
every process (inductor's graph cache cannot store the packed weights), so it is opt-in (measured:
docs/results.md#the-cpu-runtime). The function compiled is `decode.runtime.lean.LeanDecoder`'s, on the layers
`decode.runtime.lean_layers` reads off each family.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from decode.runtime.lean_layers import rotations, soft_capped, window_masks

if TYPE_CHECKING:
    from decode.runtime.lean import LeanDecoder

# what a graph that cannot be built raises (inductor wraps its own errors in the second)
COMPILE_ERRORS = (torch._dynamo.exc.BackendCompilerFailed, torch._inductor.exc.InductorError)
COMPILED_MAX_TOKENS = 16  # the widest pass run compiled
SHORT_PASS_TOKENS = 4  # passes of 2-4 tokens share a graph, wider ones have their own
GEMM_BLOCK_ROWS = 4  # the graphs' GEMM micro-kernels take this many rows at a time (`narrow_gemm_blocks`)


def compile_options(device: torch.device) -> dict:
    """inductor's options for a compiled pass on `device`. On a CPU: weights frozen into the graph as constants, GEMMs
    from inductor's C++ templates on weights packed once (autotuned against ATen), and the wrapper in C++."""
    if device.type != "cpu":
        return {}
    return {"freezing": True, "cpp_wrapper": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
            "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}  # no tables on stderr


def template_options(options: dict) -> dict:
    """`compile_options` with inductor's C++ GEMM templates only (`narrow_gemm_blocks` makes them fit 1-16 rows):
    autotuning against ATen's packed products picked kernels slower in the whole pass than in isolation, and a step
    on templates alone was faster. Where no template fits a product, inductor runs ATen's."""
    return {**options, "max_autotune_gemm_backends": "CPP"} if options else options


@contextlib.contextmanager
def narrow_gemm_blocks(rows: int) -> Iterator[None]:
    """For the duration, inductor's fp32 AVX-512 GEMM micro-kernels take at most `rows` rows at a time (a wider
    product loops over them). Its default register block of 8 rows by 48 columns needs 24 accumulators, which g++
    spills to the stack after every FMA; blocks of up to 4 rows stay in registers. Leaves inductor as it is where its
    internals differ from torch 2.13's."""
    narrowed = _narrowed_micro_gemms(rows)
    if narrowed is None:
        yield
        return
    tables = narrowed[0]
    saved = {kind: list(configs) for kind, configs in tables.items()}
    for kind, configs in narrowed[1].items():
        tables[kind][:] = configs
    try:
        yield
    finally:
        for kind, configs in saved.items():
            tables[kind][:] = configs


@functools.cache
def _narrowed_micro_gemms(rows: int) -> tuple[dict, dict] | None:
    """(inductor's micro-GEMM table, the same with fp32 AVX-512 register blocks of at most `rows` rows), or None."""
    try:
        import torch._inductor.compile_fx  # noqa: F401  (inductor first: its codegen modules import each other)
        from torch._inductor.codegen import cpp_micro_gemm
        from torch._inductor.codegen.cpp_utils import GemmBlocking

        tables = cpp_micro_gemm.micro_gemm_configs
        return tables, {kind: [dataclasses.replace(c, register_blocking=GemmBlocking(
            min(rows, c.register_blocking.block_m), *c.register_blocking[1:]))
            if c.vec_isa_cls is cpp_micro_gemm.VecAVX512 and c.input_dtype == c.input2_dtype == torch.float32
            else c for c in configs] for kind, configs in tables.items()}
    except (ImportError, AttributeError, TypeError):
        return None


def own_method(function, instance, **defaults):
    """`function` bound to `instance` through a copy of its code object: dynamo keeps graphs, and their guards, per
    code object. `defaults`: keyword-only defaults of the copy, constants of its graphs."""
    code = function.__code__.replace()
    copy = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__ = {**(function.__kwdefaults__ or {}), **defaults} or None
    return types.MethodType(copy, instance)


class CompileUnavailable(RuntimeError):
    """`CompiledPass` could not build its graph on this machine."""


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)



class CompiledPass(torch.nn.Module):
    """`LeanDecoder._layers` of one sequence, every logit, as a module for `torch.compile`: the products are plain
    `F.linear` on the weights (q, k, v and gate, up on the eager forward's stacked weights), which inductor compiles
    itself, where the eager forward calls draftops' packed kernels that it cannot trace. Freezing makes the weights
    constants of the graph, so a model whose weights change afterwards needs a new `LeanDecoder`.

    One module per model: graphs are built on first use, one for steps (one token), one for passes of 2 to
    `SHORT_PASS_TOKENS` tokens and one for wider passes up to `COMPILED_MAX_TOKENS` (the number of tokens and the
    context length are dynamic). Every pass runs under a mask, a step's all true, so that a one-token level of a
    draft's tree (under a tree mask) is the step graph, not a graph built in the middle of decoding. Their GEMMs are
    C++ templates on register blocks of at most `GEMM_BLOCK_ROWS` rows (`template_options`, `narrow_gemm_blocks`),
    except where an attention's products fit no template (Gemma 2's soft cap: ATen's too). A pass that also returns
    the hidden states entering some layers (what a feature draft reads) has graphs of its own per set of layers."""

    WIDTHS = {"step": "one-token steps", "short": f"passes of 2-{SHORT_PASS_TOKENS} tokens",
              "wide": f"passes of {SHORT_PASS_TOKENS + 1}-{COMPILED_MAX_TOKENS} tokens"}

    def __init__(self, lean: LeanDecoder):
        super().__init__()
        self.lean = [lean]  # in a list: not a submodule (its model's modules are registered below)
        self.model = lean.model
        self.layers = torch.nn.ModuleList(lean.layers)  # the model's own modules, as the family's layers hold them
        # the eager forward's stacked (or the model's fused) weights: every layer's q|k|v, then every layer's gate|up
        stacked = [layer.qkv.current() for layer in lean.layers] + [layer.gate_up.current() for layer in lean.layers]
        self.stacked = torch.nn.ParameterList([torch.nn.Parameter(layer.weight, requires_grad=False)
                                               for layer in stacked])
        self.stacked_bias = [layer.bias for layer in stacked]
        # applied around each call, not passed to torch.compile: dynamo reads `freezing` itself, outside the options
        # torch.compile hands inductor, and without it the weights are graph inputs that no GEMM template packs
        self.options = compile_options(next(lean.model.parameters()).device)
        # a soft-capped attention (Gemma 2) is batched products of its own, which no C++ template takes: ATen's
        if not any(layer.softcap is not None for layer in lean.layers):
            self.options = template_options(self.options)
        # graphs of code objects of this module's own, so that no guard on its modules is needed to tell its graphs
        # from another model's: those guards (every weight, norm and layer attribute) would be checked on every call,
        # and the weights are frozen into the graphs anyway
        self.graphs, self.wide_graphs = self._compiled(())
        # per tuple of layers whose entering hidden states a pass returns too (a feature draft's), its two functions
        self.feature_graphs: dict[tuple[int, ...], tuple] = {}
        self.built: set[str] = set()  # the `WIDTHS` whose graph was built, "+features" where it captures
        self.rebuilt = 0  # graphs built again for a width already built (a shape or input not seen before)

    def _compiled(self, capture: tuple[int, ...]) -> tuple:
        """torch.compile'd `_pass` and `_wide_pass`, each of a code object of its own, capturing `capture`. Their own
        code objects, so that no guard on this module's modules is needed to tell their graphs from another model's:
        those guards (every weight, norm and layer attribute) would be checked on every call, and the weights are
        frozen into the graphs anyway."""
        unguarded = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        # a flag per layer, not layer numbers: dynamo traces the ints of a dynamic graph's arguments as symbols
        flags = tuple(i in capture for i in range(len(self.layers)))
        return tuple(torch.compile(own_method(function, self, capture=flags), dynamic=True, options=unguarded)
                     for function in (CompiledPass._pass, CompiledPass._wide_pass))

    def forward(self, tokens: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], start: int,
                end: int, positions: torch.Tensor, mask: torch.Tensor | None,
                capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [1, T] at `positions` [T] into slots start..end-1 (the buffers hold more than `end`) -> (logits
        [1, T, V], the hidden states entering the layers of `capture` at every token [1, T, len(capture) * H], or
        None without `capture`)."""
        for buffer in (*keys, *values):  # only the capacity varies: sizes that equal the number of tokens fed (the
            if not hasattr(buffer, "_dynamo_static_indices"):  # kv heads, say) would otherwise be tied to it
                for dim in (0, 1, 3):
                    torch._dynamo.mark_static(buffer, dim)
        n = tokens.shape[1]
        if mask is None:  # a step: one graph for steps with and without a tree mask
            mask = torch.ones(n, end, dtype=torch.bool, device=tokens.device)
        width = "step" if n == 1 else "short" if n <= SHORT_PASS_TOKENS else "wide"
        if capture and capture not in self.feature_graphs:
            self.feature_graphs[capture] = self._compiled(capture)
        graphs = (self.feature_graphs[capture] if capture else (self.graphs, self.wide_graphs))[width == "wide"]
        kind = width + ("+features" if capture else "")
        if kind not in self.built:
            log(f"draftops: compiling {self._graph_name(width, capture)} "
                "(decode.compiled: minutes on a small CPU, once per process)")
        graphs_before = counters["stats"]["unique_graphs"]
        try:  # the options on every call: a graph dynamo rebuilds is built as the first was. Floats (norm epsilons,
            # the attention scale) are constants of the graph: traced as symbols, dynamo would restart its analysis
            with (torch._inductor.config.patch(self.options), torch._dynamo.config.patch(specialize_float=True),
                  narrow_gemm_blocks(GEMM_BLOCK_ROWS)):
                logits, by_layer = graphs(tokens, keys, values, start, end, positions, mask)
        except COMPILE_ERRORS as exc:  # a machine inductor cannot build on (no C++ compiler, say): nothing lost
            log(f"draftops: compiling failed, the eager forward runs instead: {str(exc).splitlines()[0]}")
            raise CompileUnavailable from exc
        if kind in self.built and counters["stats"]["unique_graphs"] > graphs_before:
            self.rebuilt += 1  # timings that include this call include compiling: say so
            log(f"draftops: {self._graph_name(width, capture)} were compiled again for an input not seen before "
                f"({n} tokens at {start}..{end})")
        self.built.add(kind)
        if not capture:
            return logits, None
        in_order = dict(zip(sorted(capture), by_layer))
        return logits, torch.cat([in_order[i] for i in capture], -1)

    def _graph_name(self, width: str, capture: tuple[int, ...]) -> str:
        """"the 30-layer llama model's one-token steps[ with the hidden states entering layers 2, 15, 27]"."""
        config = self.model.config
        return (f"the {config.num_hidden_layers}-layer {config.model_type} model's {self.WIDTHS[width]}"
                + (f" with the hidden states entering layers {', '.join(map(str, capture))}" if capture else ""))

    def _wide_pass(self, tokens: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], start: int,
                   end: int, positions: torch.Tensor, mask: torch.Tensor | None, *,
                   capture: tuple[bool, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`_pass` under a code object of its own: dynamo keeps graphs per code object, and the 2-4-token graph,
        dynamic in the number of tokens, would otherwise run the wide passes on kernels built for 2-4 rows."""
        return self._pass(tokens, keys, values, start, end, positions, mask, capture=capture)

    def _pass(self, tokens: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], start: int, end: int,
              positions: torch.Tensor, mask: torch.Tensor | None, *,
              capture: tuple[bool, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """-> (logits [1, T, V], the hidden states entering each layer flagged in `capture`, in the layers' order)."""
        lean, inner = self.lean[0], self.model.model
        b, n = tokens.shape
        x = inner.embed_tokens(tokens)
        rotation = rotations(self.model, lean.layers, x, positions[None])
        shape, count = (b, n, lean.heads, lean.kv_heads), len(self.layers)
        masks = window_masks(lean.layers, mask, positions, start, end)
        captured = []
        for i, layer in enumerate(self.layers):
            if capture and capture[i]:
                captured.append(x)
            projected = F.linear(layer.input_norm(x), self.stacked[i], self.stacked_bias[i]).split(layer.qkv.sizes, -1)
            q, k, v = layer.heads(*projected, shape, lean.rotate, rotation[layer.rotation])
            keys[i][:, :, start:end], values[i][:, :, start:end] = k, v
            out = layer.attend(q, keys[i][:, :, :end], values[i][:, :, :end], masks[layer.window])
            x = layer.add_attention(x, F.linear(out, layer.o_proj.weight, layer.o_proj.bias))
            h = layer.mlp_norm(x)
            gate, up = F.linear(h, self.stacked[count + i], self.stacked_bias[count + i]).split(layer.gate_up.sizes, -1)
            x = layer.add_mlp(x, F.linear(layer.act(gate) * up, layer.down_proj.weight, layer.down_proj.bias))
        head = self.model.lm_head
        logits = soft_capped(F.linear(inner.norm(x), head.weight, head.bias), self.model.config)
        return logits, captured
