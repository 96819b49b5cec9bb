"""A lean forward for Llama-architecture models: the model's own modules, without transformers' generic machinery.

Per call, transformers builds masks, cache objects, output dataclasses and keyword plumbing, a large share of a small
draft's step (it runs γ times a round); docs/results.md#the-cpu-runtime has the measurement.
`LeanLlama` calls the same embedding, norm, projection, rotary and MLP modules in the order `LlamaForCausalLM.forward`
does (gpt-fast style: explicit positions into a preallocated KV cache), so it computes the same function; the
transformers forward is the reference, and `tests/decode/test_lean.py` holds the parity test. `forward_tree` feeds a
token tree (`decode.tree`) at per-node positions under a tree mask; `tests/decode/test_tree.py` checks it against
feeding each root-to-node path plainly.
The eager forward runs each decoder layer's q, k, v projections as one product and its gate and up as another
(`decode.runtime.kernels.ConcatLinear`, as gpt-fast and serving engines do): a few-row step pays per product called.

`LeanLlama(model, compiled=True)` runs the passes a decoder makes after the prompt (a step, a verify block, a tree:
one sequence, at most `COMPILED_MAX_TOKENS` tokens, past position 1, no features) through `torch.compile` of the
same function (`CompiledPass`, parity-tested against the eager forward); prefills, wider passes, batches and feature
captures stay eager. A step of a small model on a CPU is mostly per-call cost and weight reads: on a CPU the graph is
compiled with the weights frozen into it, inductor's C++ GEMM templates on weights it packs once, and a C++ wrapper,
so that one call runs the whole pass. Passes of more than `SHORT_PASS_TOKENS` tokens have a graph of their own, its
GEMMs C++ templates on register blocks of at most `WIDE_PASS_BLOCK_ROWS` rows (`narrow_gemm_blocks`). Compiling
takes minutes on a small CPU and is redone by every process (inductor's graph cache cannot store the packed weights),
so it is opt-in (`decode.compiled`); docs/results.md#the-cpu-runtime has the measurement.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from decode.runtime.kernels import ConcatLinear

# what a graph that cannot be built raises (inductor wraps its own errors in the second)
COMPILE_ERRORS = (torch._dynamo.exc.BackendCompilerFailed, torch._inductor.exc.InductorError)
COMPILED_ATTRIBUTE = "_draftops_compiled"  # where a model keeps its compiled forward (`use_compiled_passes`)
COMPILED_MAX_TOKENS = 16  # the widest pass run compiled
SHORT_PASS_TOKENS = 4  # passes of 2-4 tokens share a graph, wider ones have their own
WIDE_PASS_BLOCK_ROWS = 4  # the wide graph's GEMM micro-kernels take this many rows at a time (`narrow_gemm_blocks`)


class _CompiledHolder:
    """A model's compiled forward, kept on the model itself so that it lives and dies with it (a weak-keyed table would
    keep the model alive: the forward refers to it). A copy of the model (`copy.deepcopy`: the int8 copy, a bfloat16
    copy for generation) is another model and gets no compiled forward."""

    def __init__(self, lean: LeanLlama | None):
        self.lean = lean

    def __deepcopy__(self, memo) -> _CompiledHolder:
        return _CompiledHolder(None)


def use_compiled_passes(model) -> None:
    """From now on, `decode.runtime.forward.ModelRunner` runs `model`'s passes compiled (`LeanLlama(model,
    compiled=True)`), one compiled forward per model shared by every runner of it (the decoder's, the cost timings'),
    so that each graph is compiled once a process."""
    if not LeanLlama.supports(model):
        raise ValueError("decode.compiled compiles the lean forward: it needs a Llama-architecture model in eval mode")
    if compiled_lean(model) is None:
        model.__dict__[COMPILED_ATTRIBUTE] = _CompiledHolder(LeanLlama(model, compiled=True))


def compiled_lean(model) -> LeanLlama | None:
    """The compiled forward `use_compiled_passes` gave `model`, if any."""
    holder = model.__dict__.get(COMPILED_ATTRIBUTE)
    return None if holder is None else holder.lean


def compile_options(device: torch.device) -> dict:
    """inductor's options for a compiled pass on `device`. On a CPU: weights frozen into the graph as constants, GEMMs
    from inductor's C++ templates on weights packed once (autotuned against ATen), and the wrapper in C++."""
    if device.type != "cpu":
        return {}
    return {"freezing": True, "cpp_wrapper": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
            "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}  # no tables on stderr


def wide_pass_options(options: dict) -> dict:
    """`compile_options` for the graph of passes wider than `SHORT_PASS_TOKENS`: on a CPU, inductor's C++ GEMM
    templates only (`narrow_gemm_blocks` makes them fit these widths); autotuning against ATen's packed products picked
    kernels slower in the whole pass than in isolation. Where no template fits a product, inductor runs ATen's."""
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


def own_method(function, instance):
    """`function` bound to `instance` through a copy of its code object: dynamo keeps graphs, and their guards, per
    code object."""
    code = function.__code__.replace()
    return types.MethodType(types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__,
                                               function.__closure__), instance)


class CompileUnavailable(RuntimeError):
    """`CompiledPass` could not build its graph on this machine."""


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class KVCache:
    """Per-layer keys and values [batch, kv_heads, capacity, head_dim], grown by doubling; `length` positions are
    valid (the same for every sequence of a batch).

    `get_seq_length` and `crop` follow transformers' DynamicCache, so `decode.runtime.forward.rollback` works on both.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 batch: int = 1):
        self.length = 0
        self.keys = [torch.empty(batch, kv_heads, 0, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [k.clone() for k in self.keys]

    def repeated(self, batch: int) -> KVCache:
        """A cache of `batch` sequences, each a copy of this one-sequence cache's valid positions."""
        copy = KVCache(0, 0, 0, self.keys[0].dtype, self.keys[0].device)
        copy.length = self.length
        copy.keys = [entry[:1, :, : self.length].repeat(batch, 1, 1, 1) for entry in self.keys]
        copy.values = [entry[:1, :, : self.length].repeat(batch, 1, 1, 1) for entry in self.values]
        return copy

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (a negative length drops that many from the end)."""
        self.length = length if length >= 0 else max(0, self.length + length)

    def compact(self, start: int, slots: list[int]) -> None:
        """Keep the first `start` positions, then the entries at `slots` (ascending, each >= start) moved to
        start, start+1, ...: a tree round keeps the accepted path of the nodes it fed."""
        end = start + len(slots)
        if slots != list(range(start, end)):
            index = torch.tensor(slots, device=self.keys[0].device)
            for store in (self.keys, self.values):
                for entry in store:
                    entry[:, :, start:end] = entry[:, :, index]
        self.length = end

    def reserve(self, end: int) -> None:
        capacity = self.keys[0].shape[2]
        if end <= capacity:
            return
        grown = max(end, 2 * capacity, 256)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                # zeros, not empty memory: a masked slot's value still enters attention as 0 × value, and a NaN in
                # never-written memory would survive that (rows of a ragged batch end before the batch's last slot)
                new = old.new_zeros(*old.shape[:2], grown, old.shape[3])
                new[:, :, :capacity] = old
                store[i] = new


class LeanLlama:
    """`forward_logits` for a `LlamaForCausalLM` (any lm_head, e.g. a reduced-vocabulary one)."""

    def __init__(self, model, compiled: bool = False):
        config = model.config
        self.model, self.inner = model, model.model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # per decoder layer: its q, k, v projections and its gate, up projections, each as one product
        self.qkv = [ConcatLinear([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
                    for layer in self.inner.layers]
        self.gate_up = [ConcatLinear([layer.mlp.gate_proj, layer.mlp.up_proj]) for layer in self.inner.layers]
        self.compiled = CompiledPass(self) if compiled else None

    @staticmethod
    def supports(model) -> bool:
        config = model.config
        return (config.model_type == "llama" and not model.training and not getattr(config, "pretraining_tp", 1) > 1
                and getattr(config, "_attn_implementation", "sdpa") in ("sdpa", "eager"))

    def new_cache(self, batch: int = 1) -> KVCache:
        weight = self.inner.embed_tokens.weight
        return KVCache(len(self.inner.layers), self.kv_heads, self.head_dim, weight.dtype, weight.device, batch)

    def forward_logits(self, tokens: torch.Tensor, cache: KVCache, start: int, keep_last: bool) -> torch.Tensor:
        """Feed tokens [T] at positions start..start+T-1 -> logits [T, V] (or [1, V] if keep_last)."""
        n, end = tokens.shape[0], start + tokens.shape[0]
        positions = torch.arange(start, end, device=tokens.device)
        # a block of n > 1 queries sees every cached position and the block causally
        mask = None if n == 1 else torch.arange(end, device=tokens.device)[None, :] <= positions[:, None]
        return self._forward(tokens[None], cache, start, positions, mask, keep_last)[0][0]

    def forward_batch(self, tokens: torch.Tensor, cache: KVCache, start: int, keep_last: bool) -> torch.Tensor:
        """`forward_logits` of a batch: tokens [B, T] at positions start..start+T-1 of every sequence of a cache of
        B sequences of one length -> logits [B, T, V] (or [B, 1, V] if keep_last). What a serving engine's batched
        step or verify costs (`decode.step_costs.measure_batch_costs`)."""
        n, end = tokens.shape[1], start + tokens.shape[1]
        positions = torch.arange(start, end, device=tokens.device)
        mask = None if n == 1 else torch.arange(end, device=tokens.device)[None, :] <= positions[:, None]
        return self._forward(tokens, cache, start, positions, mask, keep_last)[0]

    def forward_ragged(self, tokens: torch.Tensor, cache: KVCache, starts: torch.Tensor) -> torch.Tensor:
        """`forward_batch` with a start per sequence: tokens [B, T] into slots starts[b]..starts[b]+T-1 of row b,
        each seeing its own row's slots up to its position -> logits [B, T, V]. Sequences of a batch that accept
        different numbers of drafted tokens go on at different lengths (`decode.measure.batched`); a row's slots past
        its length are stale and never seen."""
        return self.forward_ragged_features(tokens, cache, starts, ())[0]

    def forward_ragged_features(self, tokens: torch.Tensor, cache: KVCache, starts: torch.Tensor,
                                layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_ragged`, and the hidden states entering `layers` at every token -> (logits [B, T, V], features
        [B, T, len(layers) * H] or None without layers): continuous batching records a feature draft's inputs."""
        n = tokens.shape[1]
        positions = starts[:, None] + torch.arange(n, device=tokens.device)
        end = int(positions.max()) + 1
        mask = torch.arange(end, device=tokens.device)[None, None, :] <= positions[:, :, None]
        return self._forward(tokens, cache, 0, positions, mask[:, None], False, layers)

    def forward_features(self, tokens: torch.Tensor, cache: KVCache, start: int, layers: tuple[int, ...],
                         keep_last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_logits` of every token (of the last, if keep_last), and the hidden states entering `layers` at
        every token, concatenated -> (logits [T or 1, V], features [T, len(layers) * H]): what a feature draft
        (`decode.models.feature_draft`) reads."""
        n, end = tokens.shape[0], start + tokens.shape[0]
        positions = torch.arange(start, end, device=tokens.device)
        mask = None if n == 1 else torch.arange(end, device=tokens.device)[None, :] <= positions[:, None]
        logits, features = self._forward(tokens[None], cache, start, positions, mask, keep_last, layers)
        return logits[0], features[0]

    def forward_tree(self, tokens: torch.Tensor, cache: KVCache, start: int, positions: torch.Tensor,
                     tree_mask: torch.Tensor) -> torch.Tensor:
        """Feed tokens [T] into cache slots start..start+T-1 at `positions` [T] -> logits [T, V]. tree_mask [T, m]
        (m >= T) says which of the last m slots (start+T-m .. start+T-1) each token sees; it sees every slot before
        them (`decode.tree.TokenTree.attention_mask`). Slots and positions differ: a node sits at its depth."""
        return self.forward_tree_features(tokens, cache, start, positions, tree_mask, ())[0]

    def forward_tree_features(self, tokens: torch.Tensor, cache: KVCache, start: int, positions: torch.Tensor,
                              tree_mask: torch.Tensor, layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_tree`, and the hidden states entering `layers` at every node, concatenated -> (logits [T, V],
        features [T, len(layers) * H] or None without layers): a feature draft reads the accepted path's."""
        n, end = tokens.shape[0], start + tokens.shape[0]
        mask = torch.ones(n, end, dtype=torch.bool, device=tokens.device)
        mask[:, end - tree_mask.shape[1] :] = tree_mask
        logits, features = self._forward(tokens[None], cache, start, positions, mask, False, layers)
        return logits[0], None if features is None else features[0]

    def _forward(self, tokens: torch.Tensor, cache: KVCache, start: int, positions: torch.Tensor,
                 mask: torch.Tensor | None, keep_last: bool,
                 capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [B, T] -> (logits [B, T or 1, V], features [B, T, len(capture) * H] or None). positions [T] go
        into slots start..start+T-1 of every row; positions [B, T] (`forward_ragged`) into the slots they name."""
        ragged = positions.dim() == 2
        end = int(positions.max()) + 1 if ragged else start + tokens.shape[1]
        if (self.compiled is not None and not ragged and not capture and tokens.shape[0] == 1
                and tokens.shape[1] <= COMPILED_MAX_TOKENS and start >= 2):
            # start >= 2: a prefill (start 0) stays eager, and a start of 0 or 1 would be a graph of its own (torch
            # specializes those); a slot past `end`: a slice `[:end]` that is the whole buffer would be a new graph
            # too (a guard on end == capacity); growing the buffer stays out of the graph, as does the length
            cache.reserve(end + 1)
            try:
                logits = self.compiled(tokens, cache.keys, cache.values, start, end, positions, mask)
            except CompileUnavailable:
                self.compiled = None
            else:
                cache.length = end
                return (logits[:, -1:] if keep_last else logits), None
        cache.reserve(end)
        out = self._layers(tokens, cache.keys, cache.values, start, end, positions, mask, keep_last, capture)
        cache.length = end
        return out

    def _layers(self, tokens: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], start: int, end: int,
                positions: torch.Tensor, mask: torch.Tensor | None, keep_last: bool,
                capture: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_forward`'s computation, into cache buffers `keys`/`values` that hold at least `end` slots."""
        b, n = tokens.shape
        ragged = positions.dim() == 2
        rows = torch.arange(b, device=tokens.device)[:, None] if ragged else None
        x = self.inner.embed_tokens(tokens)
        cos, sin = self.inner.rotary_emb(x, positions if ragged else positions[None])
        captured = {}
        for i, layer in enumerate(self.inner.layers):
            if i in capture:
                captured[i] = x
            attention, h = layer.self_attn, layer.input_layernorm(x)
            q, k, v = self.qkv[i](h)
            q = q.view(b, n, self.heads, self.head_dim).transpose(1, 2)
            k = k.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            if ragged:  # [B, T, heads, dim] into each row's own slots
                keys[i][rows, :, positions], values[i][rows, :, positions] = k.transpose(1, 2), v.transpose(1, 2)
            else:
                keys[i][:, :, start:end], values[i][:, :, start:end] = k, v
            out = F.scaled_dot_product_attention(q, keys[i][:, :, :end], values[i][:, :, :end],
                                                 attn_mask=mask, scale=attention.scaling, enable_gqa=True)
            x = x + attention.o_proj(out.transpose(1, 2).reshape(b, n, -1))
            h = layer.post_attention_layernorm(x)
            gate, up = self.gate_up[i](h)
            x = x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        x = self.inner.norm(x[:, -1:] if keep_last else x)
        features = torch.cat([captured[i] for i in capture], -1) if capture else None
        return self.model.lm_head(x), features


class CompiledPass(torch.nn.Module):
    """`LeanLlama._layers` of one sequence, every logit, as a module for `torch.compile`: the products are plain
    `F.linear` on the weights (q, k, v and gate, up on the eager forward's stacked weights), which inductor compiles
    itself, where the eager forward calls draftops' packed kernels that it cannot trace. Freezing makes the weights
    constants of the graph, so a model whose weights change afterwards needs a new `LeanLlama`.

    One module per model: graphs are built on first use, one for steps (one token, no mask), one for passes of 2 to
    `SHORT_PASS_TOKENS` tokens and one for wider passes up to `COMPILED_MAX_TOKENS` (a block or a tree under a mask;
    the number of tokens and the context length are dynamic). The step and short graphs' GEMMs are autotuned (C++
    template against ATen) at the width they are first called with; the wide graph's are C++ templates on narrower
    register blocks (`wide_pass_options`, `narrow_gemm_blocks`): kernels picked for 2 rows are not the fastest for 8."""

    WIDTHS = {"step": "one-token steps", "short": f"passes of 2-{SHORT_PASS_TOKENS} tokens",
              "wide": f"passes of {SHORT_PASS_TOKENS + 1}-{COMPILED_MAX_TOKENS} tokens"}

    def __init__(self, lean: LeanLlama):
        super().__init__()
        self.lean = [lean]  # in a list: not a submodule (its model's modules are registered below)
        self.model = lean.model
        # the eager forward's stacked weights (q, k, v and gate, up), shared
        stacked = [stack.current() for stack in (*lean.qkv, *lean.gate_up)]
        self.stacked = torch.nn.ParameterList([torch.nn.Parameter(layer.weight, requires_grad=False)
                                               for layer in stacked])
        self.stacked_bias = [layer.bias for layer in stacked]
        # applied around each call, not passed to torch.compile: dynamo reads `freezing` itself, outside the options
        # torch.compile hands inductor, and without it the weights are graph inputs that no GEMM template packs
        self.options = compile_options(next(lean.model.parameters()).device)
        self.wide_options = wide_pass_options(self.options)
        # graphs of code objects of this module's own, so that no guard on its modules is needed to tell its graphs
        # from another model's: those guards (every weight, norm and layer attribute) would be checked on every call,
        # and the weights are frozen into the graphs anyway
        unguarded = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        self.graphs = torch.compile(own_method(CompiledPass._pass, self), dynamic=True, options=unguarded)
        self.wide_graphs = torch.compile(own_method(CompiledPass._wide_pass, self), dynamic=True, options=unguarded)
        self.built: set[str] = set()  # the `WIDTHS` whose graph was built

    def forward(self, tokens: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], start: int,
                end: int, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """tokens [1, T] at `positions` [T] into slots start..end-1 (the buffers hold more than `end`) -> logits
        [1, T, V]."""
        for buffer in (*keys, *values):  # only the capacity varies: sizes that equal the number of tokens fed (the
            if not hasattr(buffer, "_dynamo_static_indices"):  # kv heads, say) would otherwise be tied to it
                for dim in (0, 1, 3):
                    torch._dynamo.mark_static(buffer, dim)
        n = tokens.shape[1]
        width = "step" if n == 1 else "short" if n <= SHORT_PASS_TOKENS else "wide"
        wide = width == "wide"
        graphs, options = (self.wide_graphs, self.wide_options) if wide else (self.graphs, self.options)
        if width not in self.built:
            config = self.model.config
            log(f"draftops: compiling the {config.num_hidden_layers}-layer {config.model_type} model's "
                f"{self.WIDTHS[width]} (decode.compiled: minutes on a small CPU, once per process)")
        try:  # the options on every call: a graph dynamo rebuilds is built as the first was. Floats (norm epsilons,
            # the attention scale) are constants of the graph: traced as symbols, dynamo would restart its analysis
            with (torch._inductor.config.patch(options), torch._dynamo.config.patch(specialize_float=True),
                  narrow_gemm_blocks(WIDE_PASS_BLOCK_ROWS) if wide else contextlib.nullcontext()):
                logits = graphs(tokens, keys, values, start, end, positions, mask)
        except COMPILE_ERRORS as exc:  # a machine inductor cannot build on (no C++ compiler, say): nothing lost
            log(f"draftops: compiling failed, the eager forward runs instead: {str(exc).splitlines()[0]}")
            raise CompileUnavailable from exc
        self.built.add(width)
        return logits

    def _wide_pass(self, tokens: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], start: int,
                   end: int, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """`_pass` under a code object of its own: dynamo keeps graphs per code object, and the 2-4-token graph,
        dynamic in the number of tokens, would otherwise run the wide passes on kernels autotuned for 2 rows."""
        return self._pass(tokens, keys, values, start, end, positions, mask)

    def _pass(self, tokens: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], start: int, end: int,
              positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        lean, inner = self.lean[0], self.model.model
        b, n = tokens.shape
        x = inner.embed_tokens(tokens)
        cos, sin = inner.rotary_emb(x, positions[None])
        sizes = [lean.heads * lean.head_dim, lean.kv_heads * lean.head_dim, lean.kv_heads * lean.head_dim]
        layers = len(inner.layers)  # self.stacked: every layer's q, k, v, then every layer's gate, up
        for i, layer in enumerate(inner.layers):
            attention, mlp = layer.self_attn, layer.mlp
            q, k, v = F.linear(layer.input_layernorm(x), self.stacked[i], self.stacked_bias[i]).split(sizes, -1)
            q = q.view(b, n, lean.heads, lean.head_dim).transpose(1, 2)
            k = k.view(b, n, lean.kv_heads, lean.head_dim).transpose(1, 2)
            v = v.view(b, n, lean.kv_heads, lean.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            keys[i][:, :, start:end], values[i][:, :, start:end] = k, v
            out = F.scaled_dot_product_attention(q, keys[i][:, :, :end], values[i][:, :, :end],
                                                 attn_mask=mask, scale=attention.scaling, enable_gqa=True)
            x = x + F.linear(out.transpose(1, 2).reshape(b, n, -1), attention.o_proj.weight, attention.o_proj.bias)
            h = layer.post_attention_layernorm(x)
            gate, up = F.linear(h, self.stacked[layers + i], self.stacked_bias[layers + i]).chunk(2, -1)
            x = x + F.linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        head = self.model.lm_head
        return F.linear(inner.norm(x), head.weight, head.bias)
