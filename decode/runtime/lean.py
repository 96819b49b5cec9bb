"""A lean forward for decoder-only transformers of Llama's block: the model's own modules, without transformers'
generic machinery.

Per call, transformers builds masks, cache objects, output dataclasses and keyword plumbing, a large share of a small
draft's step (it runs γ times a round). `LeanDecoder` calls the same modules in the order the family's
`ForCausalLM.forward` does (gpt-fast style: explicit positions into a preallocated KV cache), so it computes the same
function, the transformers forward being the reference. How each family's block differs is read off its layers in
`decode.runtime.lean_layers`; the compiled passes are `decode.runtime.compiled_pass`. `lean_problem` is the one check of
whether the lean forward runs a model: a model it refuses runs on the transformers forward (`notice_fallback`) or is
refused in one line (`require_lean`). docs/concepts.md#the-cpu-runtime.
"""
from __future__ import annotations

import sys

import torch

from decode.runtime.compiled_pass import COMPILED_MAX_TOKENS, SHORT_PASS_TOKENS, CompiledPass, CompileUnavailable
from decode.runtime.lean_layers import lean_layers, rotary_function, rotations, soft_capped, window_masks
from pipeline.families import FAMILIES, FAMILY_NAMES

COMPILED_ATTRIBUTE = "_draftops_compiled"  # where a model keeps its compiled forward (`use_compiled_passes`)
FALLBACK_ATTRIBUTE = "_draftops_fallback_noticed"  # set on a model once its fallback notice is out


def lean_problem(model) -> str | None:
    """Why the lean forward cannot run `model`, in one line; None if it can: a family of `pipeline.families.FAMILIES`
    in eval mode, with eager or SDPA attention and no tensor-parallel slicing of its projections
    (`pretraining_tp`)."""
    config = model.config
    if config.model_type not in FAMILIES:
        return f"the lean forward runs {FAMILY_NAMES} models"
    if model.training:
        return "the lean forward runs models in eval mode, not in training mode"
    if (slices := getattr(config, "pretraining_tp", 1)) > 1:
        return f"the lean forward runs whole projections, not {slices} tensor-parallel slices (pretraining_tp)"
    if (attention := getattr(config, "_attn_implementation", "sdpa")) not in ("sdpa", "eager"):
        return f"the lean forward runs eager or sdpa attention, not {attention}"
    return None


def require_lean(model, user: str) -> None:
    """Refuse, in one line (ValueError), a model the lean forward cannot run (`lean_problem`) for `user`, what needs
    the lean forward (continuous batching, compiled passes, batched measurements)."""
    if (problem := lean_problem(model)) is not None:
        raise ValueError(f"{user} runs on the lean forward, which cannot run this {model.config.model_type} model: "
                         f"{problem}")


def notice_fallback(model, compiled: bool = False) -> None:
    """One line on stderr, once per model, that `model` runs on the transformers forward (where `lean_problem` says
    why): the same tokens, with transformers' per-call cost; `compiled`: and that `decode.compiled` was asked for but
    does not apply (the compiled passes are the lean forward's)."""
    if model.__dict__.get(FALLBACK_ATTRIBUTE):
        return
    model.__dict__[FALLBACK_ATTRIBUTE] = True
    extra = "; decode.compiled does not apply to it" if compiled else ""
    print(f"draftops: notice: this {model.config.model_type} model runs on the transformers forward, not the lean one "
          f"(the same tokens, more time per call{extra}): {lean_problem(model)}", file=sys.stderr, flush=True)


class _CompiledHolder:
    """A model's compiled forward, kept on the model itself so that it lives and dies with it (a weak-keyed table would
    keep the model alive: the forward refers to it). A copy of the model (`copy.deepcopy`: the int8 copy, a bfloat16
    copy for generation) is another model and gets no compiled forward."""

    def __init__(self, lean: LeanDecoder | None):
        self.lean = lean

    def __deepcopy__(self, memo) -> _CompiledHolder:
        return _CompiledHolder(None)


def use_compiled_passes(model) -> None:
    """From now on, `decode.runtime.forward.ModelRunner` runs `model`'s passes compiled (`LeanDecoder(model,
    compiled=True)`), one compiled forward per model shared by every runner of it (the decoder's, the cost timings'),
    so that each graph is compiled once a process."""
    require_lean(model, "decode.compiled")
    if compiled_lean(model) is None:
        model.__dict__[COMPILED_ATTRIBUTE] = _CompiledHolder(LeanDecoder(model, compiled=True))


def compiled_lean(model) -> LeanDecoder | None:
    """The compiled forward `use_compiled_passes` gave `model`, if any."""
    holder = model.__dict__.get(COMPILED_ATTRIBUTE)
    return None if holder is None else holder.lean


def build_compiled_graphs(model, capture: tuple[int, ...] = ()) -> None:
    """Every graph `model`'s compiled passes can run with `capture` (`LeanDecoder.build_graphs`), built now where
    `use_compiled_passes` gave it some; a no-op otherwise."""
    lean = None if model is None else compiled_lean(model)
    if lean is not None:
        lean.build_graphs(capture)


def attention_dtype(model) -> torch.dtype:
    """The precision a batch of sequences keeps its keys and values and attends in: float32 on a CPU for a model in
    bfloat16 or float16, else the model's own. torch's CPU attention in bf16 is several times slower than in fp32
    (docs/results.md#the-cpu-runtime), enough to cancel what bf16 products gain in `distill.generation_dtype`; the
    projections stay in the model's precision."""
    weight = model.model.embed_tokens.weight
    if weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return weight.dtype


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


class LeanDecoder:
    """`forward_logits` for a causal LM the lean forward runs (`lean_problem`: None), with any lm_head (e.g. a
    reduced-vocabulary one)."""

    def __init__(self, model, compiled: bool = False, cache_dtype: torch.dtype | None = None):
        """cache_dtype: the keys', values' and attention's precision (default: the weights'); `attention_dtype`."""
        config = model.config
        self.model, self.inner = model, model.model
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = self.inner.layers[0].self_attn.head_dim
        # per decoder layer: its q, k, v projections and its gate, up projections, each as one product
        # (`decode.runtime.kernels.ConcatLinear`, as gpt-fast and serving engines do): a few-row step pays per product
        self.layers = lean_layers(model)
        self.rotate = rotary_function(model)
        # compiled: the passes after the prompt (one sequence, at most COMPILED_MAX_TOKENS tokens, `_forward`) run
        # through torch.compile of the same function; prefills, wider passes and batches stay eager. Compiling takes
        # minutes on a small CPU, hence opt-in (`decode.compiled`).
        self.compiled = CompiledPass(self) if compiled else None
        self.cache_dtype = cache_dtype or model.model.embed_tokens.weight.dtype

    @torch.inference_mode()  # as decoders run: dynamo guards on the grad mode
    def build_graphs(self, capture: tuple[int, ...] = ()) -> None:
        """The compiled passes' graphs of every width, capturing `capture`, built now on a scratch cache. A graph first
        needed in the middle of a request stalls it for the minutes compiling takes (a feature draft's one-token
        verify, say, after a round the draft proposed nothing), so a decoder builds them all when it is built, as a
        serving engine captures its graphs at startup. Without compiled passes a no-op; a graph built before is
        not built again (the passes run, on the scratch cache)."""
        if self.compiled is None:
            return
        device = self.inner.embed_tokens.weight.device
        for n in (1, SHORT_PASS_TOKENS, COMPILED_MAX_TOKENS):
            if self.compiled is None:  # compiling failed: the eager forward runs instead
                return
            cache = self.new_cache()
            self.forward_logits(torch.zeros(2, dtype=torch.long, device=device), cache, 0, False)  # eager prefill
            tokens = torch.zeros(n, dtype=torch.long, device=device)
            if capture:
                self.forward_features(tokens, cache, 2, capture)
            else:
                self.forward_logits(tokens, cache, 2, False)

    def new_cache(self, batch: int = 1) -> KVCache:
        device = self.inner.embed_tokens.weight.device
        return KVCache(len(self.inner.layers), self.kv_heads, self.head_dim, self.cache_dtype, device, batch)

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
        them (`decode.token_tree.TokenTree.attention_mask`). Slots and positions differ: a node sits at its depth.
        `tests/decode/test_token_tree.py` checks it against feeding each root-to-node path plainly."""
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
        if (self.compiled is not None and not ragged and tokens.shape[0] == 1
                and tokens.shape[1] <= COMPILED_MAX_TOKENS and start >= 2):
            # start >= 2: a prefill (start 0) stays eager, and a start of 0 or 1 would be a graph of its own (torch
            # specializes those); a slot past `end`: a slice `[:end]` that is the whole buffer would be a new graph
            # too (a guard on end == capacity); growing the buffer stays out of the graph, as does the length
            cache.reserve(end + 1)
            try:
                logits, features = self.compiled(tokens, cache.keys, cache.values, start, end, positions, mask,
                                                 capture)
            except CompileUnavailable:
                self.compiled = None
            else:
                cache.length = end
                return (logits[:, -1:] if keep_last else logits), features
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
        rotation = rotations(self.model, self.layers, x, positions if ragged else positions[None])
        shape = (b, n, self.heads, self.kv_heads)
        masks = window_masks(self.layers, mask, positions, start, end)
        captured = {}
        for i, layer in enumerate(self.layers):
            if i in capture:
                captured[i] = x
            q, k, v = layer.heads(*layer.qkv(layer.input_norm(x)), shape, self.rotate, rotation[layer.rotation])
            if q.dtype != self.cache_dtype:
                q, k, v = q.to(self.cache_dtype), k.to(self.cache_dtype), v.to(self.cache_dtype)
            if ragged:  # [B, T, heads, dim] into each row's own slots
                keys[i][rows, :, positions], values[i][rows, :, positions] = k.transpose(1, 2), v.transpose(1, 2)
            else:
                keys[i][:, :, start:end], values[i][:, :, start:end] = k, v
            out = layer.attend(q, keys[i][:, :, :end], values[i][:, :, :end], masks[layer.window])
            x = layer.add_attention(x, layer.o_proj(out.to(x.dtype)))
            gate, up = layer.gate_up(layer.mlp_norm(x))
            x = layer.add_mlp(x, layer.down_proj(layer.act(gate) * up))
        x = self.inner.norm(x[:, -1:] if keep_last else x)
        features = torch.cat([captured[i] for i in capture], -1) if capture else None
        return soft_capped(self.model.lm_head(x), self.model.config), features
