"""The lean forward (`decode.runtime.lean.LeanDecoder`) on every family's layers (`decode.runtime.lean_layers`: Llama
3's rotary scaling and the families beyond Llama), against transformers.

The reference is each family's own transformers forward, with SDPA attention: transformers' eager attention takes its
softmax in float32 (up to 1e-5 off in these float64 models), where SDPA, like the lean forward, stays in float64, and
the two agree to rounding (~1e-14). Gemma 2 has no SDPA attention in transformers (its scores are soft-capped): its
reference is the eager one, its softmax kept in float64 here (`float64_softmax`). The tolerance is 1e-5.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from decode.factory import model_decoder
from decode.runtime.compiled_pass import compile_options, template_options
from decode.runtime.forward import ModelRunner, compact, greedy_decode, rollback
from decode.runtime.lean import LeanDecoder, compiled_lean, use_compiled_passes
from decode.token_tree import ROOT, TokenTree
from tests.decode.tiny import greedy_reference
from tests.families import tiny_family

TOLERANCE = dict(rtol=1e-5, atol=1e-5)
# (family, sliding window) on texts longer than the window: Mistral's and Phi-3's on every layer, Qwen2's and Qwen3's
# on the layers from `max_window_layers` (2) on, Gemma's on every other layer, as `config.layer_types` marks them; and
# each without a window (Gemma: one of 4096); Llama 3's rotary scaling and tied head
CASES = [("llama3", None), ("qwen2", None), ("qwen2", 16), ("qwen3", None), ("qwen3", 16), ("mistral", 16),
         ("mistral", None), ("phi3", 16), ("phi3", None), ("gemma2", 16), ("gemma2", None), ("gemma3", 16),
         ("gemma3", None)]
IDS = [f"{family}-window{window}" for family, window in CASES]


@pytest.fixture(autouse=True)
def float64_softmax(monkeypatch):
    """transformers' eager attention with its softmax in the scores' own float64, not float32."""
    softmax = torch.nn.functional.softmax

    def kept(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", kept)


def build(family: str, window: int | None = None, seed: int = 0, dtype: torch.dtype = torch.float64):
    """`tests.families.tiny_family`, where Qwen2/3 take a window on their last two layers (their configs' way)."""
    if window is None or family not in ("qwen2", "qwen3"):
        return tiny_family(family, seed, window=window, dtype=dtype)
    config = tiny_family(family).config
    config = type(config)(**(config.to_dict() | dict(use_sliding_window=True, sliding_window=window,
                                                    max_window_layers=2, layer_types=None)))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def reference(family: str, window: int | None, seed: int = 0) -> torch.nn.Module:
    model = build(family, window, seed)
    if family != "gemma2":
        model.set_attn_implementation("sdpa")
    return model


@torch.no_grad()
def full_logits(model, tokens: list[int] | torch.Tensor) -> torch.Tensor:
    """transformers' logits at every position of `tokens`, fed at once without a cache."""
    return model(torch.as_tensor(tokens)[None]).logits[0]


def close_copy(model: torch.nn.Module, seed: int, noise: float = 0.03) -> torch.nn.Module:
    """A draft close to `model` (its weights plus relative noise), so that rounds accept and reject."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(noise * param.std() * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return draft


@pytest.mark.parametrize("family,window", CASES, ids=IDS)
@torch.inference_mode()
def test_prefill_and_cached_continuations_give_transformers_logits(family, window):
    """A prefill, single steps, verify-sized blocks and rollbacks, past the window where there is one."""
    model = reference(family, window)
    lean = LeanDecoder(model)
    tokens = torch.randint(0, 128, (70,), generator=torch.Generator().manual_seed(0))
    expected = full_logits(model, tokens)
    cache, position = lean.new_cache(), 0
    for n, back in [(20, 0), (1, 0), (1, 0), (5, 2), (1, 0), (3, 3), (6, 1), (30, 0)]:
        got = lean.forward_logits(tokens[position:position + n], cache, position, False)
        torch.testing.assert_close(got, expected[position:position + n], **TOLERANCE)
        position += n - back
        rollback(cache, position)
    assert position > 40
    if window is not None:  # the window is in force: without it, the same weights give other logits past it
        unwindowed = reference(family, None)
        difference = (full_logits(unwindowed, tokens) - expected).abs().amax(-1)
        assert difference[:window].max() < 1e-10 and difference[window:].min() > 1e-3


@pytest.mark.parametrize("family,window", CASES, ids=IDS)
@torch.inference_mode()
def test_a_token_tree_gives_each_paths_logits(family, window):
    """`forward_tree` of a tree over a prefix longer than the window: each node's logits are those of its
    root-to-node path fed plainly (the window counted in positions, a node at its depth); then the accepted path
    compacted into place goes on as if fed plainly."""
    model = reference(family, window)
    runner = ModelRunner(model)
    assert runner.lean is not None
    prefix = torch.randint(0, 128, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    tree = TokenTree()
    for parent, token in [(ROOT, 7), (0, 9), (ROOT, 11), (0, 3), (1, 4), (2, 5), (4, 6)]:
        tree.add(parent, token, "s")
    cache, start = runner.new_cache(), len(prefix) - 1
    runner.forward(torch.tensor(prefix[:-1]), cache, 0, True)
    logits = runner.forward_tree(torch.tensor(prefix[-1:] + tree.tokens), cache, start,
                                 start + torch.tensor([0, *tree.depths]), tree.attention_mask())
    torch.testing.assert_close(logits[0], full_logits(model, prefix)[-1], **TOLERANCE)
    for node in range(len(tree)):
        path = prefix + [tree.tokens[i] for i in tree.path(node)]
        torch.testing.assert_close(logits[node + 1], full_logits(model, path)[-1], **TOLERANCE)
    accepted = prefix + [tree.tokens[i] for i in tree.path(6)]  # 7 9 4 6: nodes 0 1 4 6
    compact(cache, start + 1, [start + 1 + node for node in tree.path(6)])
    block = [5, 8, 2]
    got = runner.forward(torch.tensor(block), cache, len(accepted), False)
    torch.testing.assert_close(got, full_logits(model, accepted + block)[-3:], **TOLERANCE)


@pytest.mark.parametrize("family,window", CASES, ids=IDS)
@torch.inference_mode()
def test_a_batch_and_a_ragged_batch_give_each_sequences_logits(family, window):
    model = reference(family, window)
    lean = LeanDecoder(model)
    tokens = torch.randint(0, 128, (3, 40), generator=torch.Generator().manual_seed(2))
    expected = torch.stack([full_logits(model, row) for row in tokens])
    cache = lean.new_cache(batch=3)
    torch.testing.assert_close(lean.forward_batch(tokens[:, :24], cache, 0, False), expected[:, :24], **TOLERANCE)
    torch.testing.assert_close(lean.forward_batch(tokens[:, 24:25], cache, 24, True), expected[:, 24:25],
                               **TOLERANCE)
    torch.testing.assert_close(lean.forward_batch(tokens[:, 25:30], cache, 25, False), expected[:, 25:30],
                               **TOLERANCE)
    # rows at lengths of their own, past the window: row 0 goes on from slot 30, row 1 from slot 22 (its slots 22-29
    # are stale and rewritten), row 2 from slot 26
    starts = torch.tensor([30, 22, 26])
    got = lean.forward_ragged(torch.stack([tokens[b, s : s + 4] for b, s in enumerate(starts.tolist())]), cache,
                              starts)
    for b, start in enumerate(starts.tolist()):
        torch.testing.assert_close(got[b], expected[b, start : start + 4], **TOLERANCE)


@pytest.mark.parametrize("family,window", [case for case in CASES if case != ("phi3", None)],
                         ids=[i for i in IDS if i != "phi3-windowNone"])
def test_speculative_decoding_on_the_lean_forward_gives_the_targets_greedy_tokens(family, window):
    target = build(family, window)  # eager attention, as loaded: the reference's own greedy tokens
    draft = close_copy(target, seed=5)
    prompt = [5, 9, 2, 77, 3, 9, 2, 77, 14, 60, 8, 1]
    expected = greedy_reference(target, prompt, 40)
    for budget in (0, 6):  # chains, trees
        decoder = model_decoder(target, draft, 4, tree_budget=budget)
        assert decoder.target_runner.lean is not None
        out = decoder.generate(prompt, max_new_tokens=40)
        assert out.token_ids == expected
        assert out.stats.accepted > 0


@torch.inference_mode()
def test_compiled_passes_of_a_qwen2_with_windowed_layers_decode_what_the_eager_ones_do():
    """Greedy speculative decoding, trees and chains, with the target's passes compiled (float32: inductor's C++
    GEMMs) gives the eager decoder's tokens: q/k/v biases, a tied head, and a window of 8 on two of the four layers,
    passed well within the text. (The draft stays eager: compiling is minutes on a small CPU.)"""
    target = build("qwen2", 8, dtype=torch.float32)
    draft = close_copy(target, seed=3)
    prompt = [5, 9, 2, 77, 3, 9, 2, 77]
    expected = [model_decoder(target, draft, 4, tree_budget=budget).generate(prompt, max_new_tokens=24).token_ids
                for budget in (0, 3)]
    plain = greedy_decode(ModelRunner(target), prompt, 24)  # one-token steps
    use_compiled_passes(target)
    compiled = [model_decoder(target, draft, 4, tree_budget=budget) for budget in (0, 3)]
    assert compiled[0].target_runner.lean is compiled_lean(target)
    assert [d.generate(prompt, max_new_tokens=24).token_ids for d in compiled] == expected
    assert greedy_decode(ModelRunner(target), prompt, 24) == plain == expected[0]
    assert compiled_lean(target).compiled.built == {"step", "short", "wide"}  # built, not abandoned for eager


def test_a_soft_capped_attention_compiles_its_passes_with_atens_products_too():
    """Gemma 2's soft-capped attention is batched products no C++ GEMM template takes: its graphs may use ATen's
    (with C++ templates alone it failed to build, and the eager forward ran instead). Checked by hand: compiled
    Gemma 2 and Gemma 3 passes (windows of 8) decode as the eager ones (docs/families.md)."""
    options = compile_options(torch.device("cpu"))
    gemma = LeanDecoder(tiny_family("gemma2", dtype=torch.float32), compiled=True).compiled
    qwen = LeanDecoder(tiny_family("qwen2", dtype=torch.float32), compiled=True).compiled
    assert gemma.options == options and qwen.options == template_options(options) != options
