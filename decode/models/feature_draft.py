"""A feature-level draft (EAGLE-3, Li et al. 2025): one decoder layer that reads the target's own hidden states.

The draft fuses the states entering three target layers (`feature_layers`) with one linear layer (`fc`) and runs one
Llama decoder layer over [norm(embedding of the next token), norm(features)], then the target's final norm and a
(reduced-vocabulary) head. Its parameter names follow `speculators`' Eagle3 layout, so the export
(`distill.register`) is a rename-free copy. It is apart from the layer drafts (`decode.models.layer_draft`) because it
needs the target's features at every pass: `FeatureDrafter` asks the decoder for them.
`FeatureDraft.step` is the one computation, for decoding and for training's unroll (`FeatureDraft.unroll`);
`tests/decode/models/test_feature_draft.py` checks the two agree.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from decode.models.architectures import PROJECTIONS, draft_layer_config, llama_layer_weights, norm_gain
from decode.runtime.lean import KVCache
from decode.sampling import Warp, confident, draft_token

FEATURES = "features"  # the draft family's name in configs and run records


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low, middle and high layers (`speculators`' default [2, L/2, L-3]); a model of fewer than 7 layers
    gets its last three (increasing, so vLLM can capture them, from 3 layers on)."""
    if num_layers >= 7:
        return 2, num_layers // 2, num_layers - 3
    low = max(num_layers - 3, 0)
    return low, min(low + 1, num_layers - 1), min(low + 2, num_layers - 1)


class FeatureDraft(nn.Module):
    """The EAGLE-3 draft head over a target of any supported family. Index i pairs the target's features at position
    i with token i+1 and sits at position i+1; its output predicts token i+2. Beyond the verified tokens the draft
    feeds its own output hidden state as the next index's features. The token embeddings are the target's, shared,
    frozen and read as their plain rows (a Gemma target's embedding scale is its own forward's, which vLLM and
    `speculators` do not apply to a draft either; the layer's input norm makes it moot). The layer is a Llama layer
    whatever the target's family (`decode.models.architectures.draft_layer_config`), as speculators and vLLM build
    EAGLE-3 drafts."""

    def __init__(self, target_config, embed_tokens: nn.Embedding, *, feature_layers: tuple[int, ...] | None = None,
                 token_ids: torch.Tensor | None = None, norm_before_residual: bool = False,
                 intermediate_size: int | None = None):
        """target_config: the target's config (the Llama layer takes its shapes, `draft_layer_config`), or a saved
        draft's layer config; embed_tokens: the target's embeddings (shared, not trained, not saved); token_ids: the
        target ids of a reduced head's rows (None: full vocab); norm_before_residual: the layer adds its attention
        output to the normed features rather than to the features themselves (speculators' option of that name, its
        trainer's default; EAGLE-3's own layer does not); intermediate_size: the layer's MLP width (None: the
        config's)."""
        super().__init__()
        config = draft_layer_config(target_config)
        config.intermediate_size = intermediate_size or config.intermediate_size
        hidden = config.hidden_size
        self.config = config
        self.target_architectures = list(getattr(target_config, "architectures", None) or [])
        layers = target_config.get_text_config(decoder=True).num_hidden_layers
        self.feature_layers = tuple(feature_layers or default_feature_layers(layers))
        self.embed_tokens = embed_tokens.requires_grad_(False)
        self.fc = nn.Linear(len(self.feature_layers) * hidden, hidden, bias=False)
        layer = LlamaDecoderLayer(config, 0)
        attention, head_dim = layer.self_attn, layer.self_attn.head_dim
        attention.q_proj = nn.Linear(2 * hidden, config.num_attention_heads * head_dim, bias=config.attention_bias)
        attention.k_proj = nn.Linear(2 * hidden, config.num_key_value_heads * head_dim, bias=config.attention_bias)
        attention.v_proj = nn.Linear(2 * hidden, config.num_key_value_heads * head_dim, bias=config.attention_bias)
        layer.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([layer])
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        rows = config.vocab_size if token_ids is None else len(token_ids)
        self.lm_head = nn.Linear(hidden, rows, bias=False)
        self.register_buffer("token_ids", None if token_ids is None else torch.as_tensor(token_ids).long(),
                             persistent=False)
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, head_dim
        self.norm_before_residual = norm_before_residual

    @property
    def layer(self) -> LlamaDecoderLayer:
        return self.layers[0]

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def new_cache(self) -> KVCache:
        weight = self.fc.weight
        return KVCache(1, self.kv_heads, self.head_dim, weight.dtype, weight.device)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., 3H] -> the layer's hidden input [..., H], in the draft's precision (training keeps
        float32 weights beside a bfloat16 target; the features cache stores float16)."""
        return self.fc(features.to(self.fc.weight.dtype))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def project(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """q, k, v [B, heads, T, d] of hidden [B, T, H] paired with `tokens` [B, T] at `positions` [B, T]; and the
        residual the layer adds its attention output to."""
        layer, (b, n) = self.layer, tokens.shape
        embedded = F.embedding(tokens, self.embed_tokens.weight)  # plain rows: no family's embedding scale
        normed = layer.hidden_norm(hidden)
        x = torch.cat([layer.input_layernorm(embedded), normed], dim=-1)
        attention = layer.self_attn
        q = attention.q_proj(x).view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = attention.k_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attention.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(x, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v, normed if self.norm_before_residual else hidden

    def finish(self, q, keys, values, mask, residual) -> torch.Tensor:
        """Attention of q over keys/values under mask, then the layer's residual and MLP -> output hidden."""
        layer, (b, _, n, _) = self.layer, q.shape
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=layer.self_attn.scaling,
                                             enable_gqa=True)
        h = residual + layer.self_attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, cache: KVCache, start: int,
             positions: torch.Tensor, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Decoding: indices start..start+T-1 with hidden [T, H] and tokens [T] at positions [T], causally after the
        cache's first `start` entries -> output hidden [T, H] (logits: `logits`). With tree_mask [T, m] (a token
        tree's level, as `decode.runtime.lean.LeanDecoder.forward_tree`): each index sees every entry before the last m
        and those of the last m its row allows, instead of causally."""
        n, end = tokens.shape[0], start + tokens.shape[0]
        cache.reserve(end)
        q, k, v, residual = self.project(hidden[None], tokens[None], positions[None])
        cache.keys[0][:, :, start:end], cache.values[0][:, :, start:end] = k, v
        if tree_mask is not None:
            mask = torch.ones(n, end, dtype=torch.bool, device=tokens.device)
            mask[:, end - tree_mask.shape[1] :] = tree_mask
        else:
            mask = None if n == 1 else torch.arange(end, device=tokens.device)[None, :] <= torch.arange(
                start, end, device=tokens.device)[:, None]
        cache.length = end
        return self.finish(q, cache.keys[0][:, :, :end], cache.values[0][:, :, :end], mask, residual)[0]

    def unroll(self, features: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               steps: int, first: torch.Tensor | None = None,
               fed: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Training-time test over whole right-padded sequences: features [B, T, 3H] (the target's, at every
        position), input_ids and attention_mask [B, T] -> per step j the output hidden [B, R, H] at indices
        first[b] .. first[b] + R - 1 (R: the longest row's tokens from its `first` on; default first 0: every
        index), where index i predicts token i+2+j (as decoding j tokens past index i, with the right tokens fed in
        between). Step j at index i sees the step-0 entries of indices <= i and its own entries of steps 1..j at
        index i (EAGLE-3's and HASS's masks): exactly what decoding j tokens past a verified prefix sees.

        Every index still feeds step 0's keys and values (later indices attend to them); only the indices from
        `first` on run attention and MLP and are unrolled further: training starts them a few indices before the
        response (`window_start`), since prompt indices are never scored. Indices past a row's end (its padding, or
        past T) give outputs to ignore. fed(j, hidden): the tokens [B, R] fed to step j >= 1 at the window's indices,
        given step j - 1's output (the on-policy stage feeds the draft's own proposals); default the sequence's own."""
        b, n = input_ids.shape
        device = input_ids.device
        first = torch.zeros(b, dtype=torch.long, device=device) if first is None else first.to(device)
        window = first[:, None] + torch.arange(int((attention_mask.sum(1) - first).max()), device=device)  # [B, R]
        inside = window.clamp(max=n - 1)
        valid = attention_mask.bool()
        # step 0 sees indices <= i of its own sequence; step j > 0 adds its own entry at index i in each step 1..j
        causal = (torch.arange(n, device=device)[None, None, :] <= window[:, :, None]) & valid[:, None, :]
        diagonal = torch.eye(window.shape[1], dtype=torch.bool, device=device).expand(b, -1, -1)
        padded = torch.cat([input_ids, input_ids.new_zeros(b, steps)], dim=1)  # the token after index i: i + 1
        q, k, v, residual = self.project(self.fuse(features), padded[:, 1 : n + 1],
                                         torch.arange(1, n + 1, device=device).expand(b, n))
        q = q.gather(2, inside[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[3]))
        residual = residual.gather(1, inside[:, :, None].expand(-1, -1, residual.shape[2]))
        keys, values = [k], [v]
        hidden = self.finish(q, k, v, causal[:, None], residual)
        outputs = [hidden]
        for j in range(1, steps):
            tokens = padded.gather(1, (window + 1 + j).clamp(max=n + steps - 1)) if fed is None else fed(j, hidden)
            q, k, v, residual = self.project(hidden, tokens, window + 1 + j)
            keys.append(k)
            values.append(v)
            mask = torch.cat([causal] + [diagonal] * j, dim=-1)[:, None]
            hidden = self.finish(q, torch.cat(keys, 2), torch.cat(values, 2), mask, residual)
            outputs.append(hidden)
        return outputs


def window_start(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """Per row, the first index a `steps`-step unroll must run for the positions loss_mask marks: step j at index i
    predicts token i+2+j, and step j at i reads step j-1 at i, so index p - steps, for the first marked position p
    (0 for a row with none)."""
    marked = loss_mask.any(dim=1)
    return torch.where(marked, (loss_mask.long().argmax(dim=1) - steps).clamp(min=0), 0)


def feature_draft_from_target(target, token_ids: torch.Tensor | None = None,
                              feature_layers: tuple[int, ...] | None = None,
                              norm_before_residual: bool = False) -> FeatureDraft:
    """A feature draft that starts from the target's own weights, of any supported family (read as a Llama layer's,
    `decode.models.architectures.llama_layer_weights`): the decoder layer is the target's last layer (the features
    half of q/k/v from it, the embedding half from layer 0, which reads embeddings), `fc` passes the highest captured
    state through, and the final norm and head rows are the target's."""
    draft = FeatureDraft(target.config, target.get_input_embeddings(), feature_layers=feature_layers,
                         token_ids=token_ids, norm_before_residual=norm_before_residual).to(
        device=target.device, dtype=target.dtype)
    config, layer, hidden = target.config, draft.layer, draft.config.hidden_size
    first, last = (llama_layer_weights(target.model.layers[i], config) for i in (0, -1))
    with torch.no_grad():
        for name, path in PROJECTIONS.items():  # q/k/v read [embeddings of layer 0's input; features of the last's]
            linear = layer.get_submodule(path)
            reads_both = name in ("q", "k", "v")
            linear.weight.copy_(torch.cat([first.weights[name], last.weights[name]], 1) if reads_both
                                else last.weights[name])
            if linear.bias is not None:
                linear.bias.copy_(last.biases.get(name, torch.zeros_like(linear.bias)))
        layer.input_layernorm.weight.copy_(first.input_norm)
        layer.hidden_norm.weight.copy_(last.input_norm)
        layer.post_attention_layernorm.weight.copy_(last.mlp_norm)
        draft.fc.weight.zero_()
        draft.fc.weight[:, -hidden:] = torch.eye(hidden)
        draft.norm.weight.copy_(norm_gain(target.model.norm, config.get_text_config(decoder=True).model_type))
        head = target.get_output_embeddings().weight
        draft.lm_head.weight.copy_(head if token_ids is None else head[token_ids.to(head.device)])
    return draft


def random_feature_draft(target, token_ids: torch.Tensor | None = None,
                         feature_layers: tuple[int, ...] | None = None,
                         norm_before_residual: bool = False, intermediate_size: int | None = None) -> FeatureDraft:
    """A feature draft whose `fc` and decoder layer start from random weights (normal with the target's
    `initializer_range`, biases 0) and its norms at 1, as speculators' EAGLE-3 heads start; only the head rows are the
    target's (the embeddings are shared). intermediate_size: the layer's MLP width (None: the target's)."""
    draft = FeatureDraft(target.config, target.get_input_embeddings(), feature_layers=feature_layers,
                         token_ids=token_ids, norm_before_residual=norm_before_residual,
                         intermediate_size=intermediate_size).to(
        device=target.device, dtype=target.dtype)
    std = getattr(target.config.get_text_config(decoder=True), "initializer_range", 0.02)
    with torch.no_grad():
        for module in [draft.fc, *draft.layer.modules()]:
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
        head = target.get_output_embeddings().weight
        draft.lm_head.weight.copy_(head if token_ids is None else head[token_ids.to(head.device)])
    return draft


@dataclass
class FeatureState:
    """A feature drafter's state: its cache holds `verified` indices built from target features; `pending` holds the
    target features of the next indices, not fed yet (the round's accepted positions)."""

    cache: KVCache
    pending: torch.Tensor
    verified: int = 0


class FeatureDrafter:
    """Proposes with a `FeatureDraft` from the target's features, which the decoder hands over after every target
    pass (`observe`). `feature_layers` tells the decoder which of the target's hidden states to capture."""

    def __init__(self, draft: FeatureDraft, vocab_size: int, device: torch.device, *,
                 min_confidence: float | None = None):
        """min_confidence: end a block at the first draft after the first whose top probability is below this
        (`decode.sampling.confident`)."""
        if next(draft.parameters()).device != device:
            raise ValueError(f"target is on {device} but the feature draft on {next(draft.parameters()).device}")
        if draft.token_ids is None and draft.lm_head.out_features != vocab_size:
            raise ValueError(f"vocab mismatch: the feature draft predicts {draft.lm_head.out_features} tokens, the "
                             f"target {vocab_size}")
        self.model, self.vocab_size, self.device = draft, vocab_size, device
        self.token_ids = draft.token_ids  # the target ids of the head's rows (None: the full vocabulary)
        self.feature_layers, self.min_confidence = draft.feature_layers, min_confidence
        self.context = getattr(draft.config, "max_position_embeddings", None)
        self.name = FEATURES if min_confidence is None else f"{FEATURES}(min_confidence={min_confidence:g})"

    def start(self, prompt: list[int]) -> FeatureState:
        width = len(self.feature_layers) * self.model.config.hidden_size
        return FeatureState(self.model.new_cache(), torch.empty(0, width, dtype=self.model.fc.weight.dtype,
                                                                device=self.device))

    def observe(self, state: FeatureState, features: torch.Tensor) -> None:
        """The target's features [m, 3H] at the positions after those already handed over."""
        state.pending = torch.cat([state.pending, features.to(state.pending.dtype)])

    def feed_pending(self, state: FeatureState, seq: list[int]) -> torch.Tensor:
        """Feed the pending target features, each paired with the token after its position, in one forward ->
        the draft's output hidden [1, H] at the last index, which predicts the token after `seq`."""
        start, m = state.verified, state.pending.shape[0]
        if start + m != len(seq) - 1:
            raise RuntimeError(f"the feature drafter has features for {start + m} positions, the sequence needs "
                               f"{len(seq) - 1}: the decoder did not hand over every target pass")
        hidden = self.model.fuse(state.pending)
        tokens = torch.tensor(seq[start + 1 :], device=self.device)
        positions = torch.arange(start + 1, start + m + 1, device=self.device)
        state.pending, state.verified = state.pending[:0], start + m
        return self.model.step(hidden, tokens, state.cache, start, positions)[-1:]

    def propose(self, state: FeatureState, seq: list[int], k: int, warp: Warp, generator):
        """Up to k drafts after `seq`: the pending target features first (`feed_pending`), then the draft's own
        hidden state for each further token. Returns (drafts [k'], q [k', V] or None when greedy, forwards run)."""
        if k < 1 or len(seq) == 1:  # a one-token prompt: no target features yet
            return torch.empty(0, dtype=torch.long, device=self.device), None if warp.greedy else torch.empty(
                0, self.vocab_size, device=self.device), 0
        out, calls = self.feed_pending(state, seq), 1
        drafts, probs = [], []
        for i in range(k):
            logits = self.model.logits(out)[0]
            if i > 0 and self.min_confidence is not None and not confident(logits, self.min_confidence):
                break
            token, q = draft_token(logits, warp, self.model.token_ids, self.vocab_size, generator)
            probs += [] if q is None else [q]
            drafts.append(token)
            if i + 1 < k:  # the next index pairs this output with the token it proposed, at that token's position
                position = torch.tensor([len(seq) + i], device=self.device)
                out, calls = self.model.step(out, token[None], state.cache, len(seq) - 1 + i, position), calls + 1
        q = None if warp.greedy else torch.stack(probs)
        return torch.stack(drafts), q, calls

    def rollback(self, state: FeatureState, length: int) -> None:
        """Forget the draft's own entries (the target's features of the kept tokens come through `observe`)."""
        state.cache.crop(min(state.verified, length - 1))
        state.verified = state.cache.length
