"""decode.runtime.lean.LeanDecoder against its reference, the transformers forward with a DynamicCache, on Llama (the
other families: tests/decode/runtime/test_lean_layers.py), and `lean_problem`, the one check of which models it runs."""
from __future__ import annotations

import copy

import pytest
import torch
import torch._inductor.freezing
from torch._dynamo.utils import counters
from transformers import DynamicCache

from decode.factory import model_decoder
from decode.runtime.compiled_pass import (
    COMPILED_MAX_TOKENS,
    SHORT_PASS_TOKENS,
    compile_options,
    narrow_gemm_blocks,
    template_options,
)
from decode.runtime.forward import ModelRunner, forward_logits, greedy_decode, rollback
from decode.runtime.lean import LeanDecoder, compiled_lean, lean_problem, use_compiled_passes
from pipeline.families import FAMILY_NAMES
from tests.decode.tiny import greedy_reference, tiny_llama
from tests.families import FAMILIES, tiny_family


@pytest.mark.parametrize("draft_vocab,compiled", [(None, False), (40, False), (None, True)],
                         ids=["eager", "reduced-head", "compiled"])
@torch.inference_mode()
def test_same_logits_as_the_transformers_forward_through_blocks_and_rollbacks(draft_vocab, compiled):
    model = tiny_llama(5, draft_vocab=draft_vocab)
    lean = LeanDecoder(model, compiled=compiled)
    assert lean_problem(model) is None
    tokens = torch.randint(0, 128, (300,), generator=torch.Generator().manual_seed(0))
    ref_cache, cache = DynamicCache(config=model.config), lean.new_cache()
    position = 0
    # compiled: inductor's kernels move these float64 logits by up to ~1.3e-5 (measured), and the argmax must agree;
    # eager: the same function to rounding
    tolerance = 1e-4 if compiled else 1e-10
    # a prefill, single steps, verify-sized blocks, rollbacks, and growth past the first capacity (256)
    for n, keep_last, back in [(40, True, 0), (1, True, 0), (5, False, 2), (1, True, 0), (3, False, 3), (230, False, 0),
                               (6, False, 1)]:
        block = tokens[position:position + n]
        expected = forward_logits(model, block, ref_cache, position, keep_last)
        got = lean.forward_logits(block, cache, position, keep_last)
        torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        position += n - back
        rollback(ref_cache, position)
        rollback(cache, position)
        assert cache.get_seq_length() == ref_cache.get_seq_length() == position


@torch.inference_mode()
def test_a_batch_gives_each_sequences_own_logits():
    model = tiny_llama(5)
    lean = LeanDecoder(model)
    tokens = torch.randint(0, 128, (3, 30), generator=torch.Generator().manual_seed(1))
    alone = []
    for row in tokens:  # each sequence on its own: a prefill of 24 tokens, a step, then a 5-token verify block
        cache = lean.new_cache()
        lean.forward_logits(row[:24], cache, 0, True)
        step = lean.forward_logits(row[24:25], cache, 24, True)
        alone.append((step, lean.forward_logits(row[25:30], cache, 25, False)))
    cache = lean.new_cache(batch=3)
    lean.forward_batch(tokens[:, :24], cache, 0, True)
    step = lean.forward_batch(tokens[:, 24:25], cache, 24, True)
    block = lean.forward_batch(tokens[:, 25:30], cache, 25, False)
    assert step.shape == (3, 1, 128) and block.shape == (3, 5, 128)
    for i, (step_alone, block_alone) in enumerate(alone):
        torch.testing.assert_close(step[i], step_alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(block[i], block_alone, rtol=1e-5, atol=1e-5)
    # a cache repeated from one sequence's continues as that sequence does in every row
    single = lean.new_cache()
    lean.forward_logits(tokens[0, :24], single, 0, True)
    repeated = single.repeated(4)
    assert repeated.keys[0].shape[0] == 4 and repeated.get_seq_length() == 24
    rows = lean.forward_batch(tokens[0, 24:30].repeat(4, 1), repeated, 24, False)
    for row in rows:
        torch.testing.assert_close(row[1:], alone[0][1], rtol=1e-5, atol=1e-5)


def test_decoder_output_is_the_same_with_and_without_it(target, close_draft):
    prompt = [5, 9, 2, 77, 3]
    lean = model_decoder(target, close_draft, 4)
    plain = model_decoder(target, close_draft, 4, lean=False)
    assert lean.drafter.runner.lean is not None and lean.target_runner.lean is not None
    assert plain.drafter.runner.lean is None and plain.target_runner.lean is None
    a, b = lean.generate(prompt, max_new_tokens=40), plain.generate(prompt, max_new_tokens=40)
    assert a.token_ids == b.token_ids == greedy_reference(target, prompt, 40)
    assert (a.stats.accepted, a.stats.draft_calls) == (b.stats.accepted, b.stats.draft_calls)
    for seed in range(3):
        assert (lean.generate(prompt, max_new_tokens=20, temperature=1.0, seed=seed).token_ids
                == plain.generate(prompt, max_new_tokens=20, temperature=1.0, seed=seed).token_ids)


def test_the_lean_forward_runs_every_family_and_says_why_not_of_other_models():
    assert all(lean_problem(tiny_family(family)) is None for family in FAMILIES)
    assert lean_problem(tiny_family("gpt_neox")) == f"the lean forward runs {FAMILY_NAMES} models"
    model = tiny_llama(6)
    model.train()
    assert lean_problem(model) == "the lean forward runs models in eval mode, not in training mode"
    model.eval().config.pretraining_tp = 2
    assert lean_problem(model) == ("the lean forward runs whole projections, not 2 tensor-parallel slices "
                                   "(pretraining_tp)")
    model.config.pretraining_tp = 1
    model.config._attn_implementation = "flex_attention"
    assert lean_problem(model) == "the lean forward runs eager or sdpa attention, not flex_attention"


def test_a_model_the_lean_forward_does_not_run_says_so_once_per_model(capsys):
    model = tiny_family("gpt_neox")
    runners = [ModelRunner(model), ModelRunner(model)]
    assert all(runner.lean is None for runner in runners)
    assert capsys.readouterr().err.splitlines() == [
        "draftops: notice: this gpt_neox model runs on the transformers forward, not the lean one (the same tokens, "
        f"more time per call): the lean forward runs {FAMILY_NAMES} models"]
    ModelRunner(tiny_family("gpt_neox", seed=1))
    assert "gpt_neox model runs on the transformers forward" in capsys.readouterr().err
    ModelRunner(tiny_family("qwen2"))
    ModelRunner(tiny_family("gpt_neox", seed=2), lean=False)  # asked for the transformers forward: nothing to say
    assert capsys.readouterr().err == ""


@torch.inference_mode()
def test_the_compiled_forward_builds_one_graph_per_width_class_whatever_the_length(monkeypatch):
    """Compiling takes minutes on the real target: prompts of other lengths, passes of other widths, a one-token tree
    level and a cache that grows past its capacity (or fills it exactly) must not build new graphs in the middle of
    decoding. Three graphs: steps, passes up to SHORT_PASS_TOKENS, wider ones; prefills and passes wider than
    COMPILED_MAX_TOKENS stay eager."""
    torch._dynamo.reset()
    counters.clear()
    frozen = []  # per graph built, how many of its inputs were frozen into it as constants

    def freeze(dynamo_gm, aot_gm, example_inputs):
        graph, kept = torch._inductor.freezing._freeze(dynamo_gm, aot_gm, example_inputs)
        frozen.append(len(example_inputs) - len(kept))
        return graph, kept

    monkeypatch.setattr(torch._inductor.freezing, "freeze", freeze)
    model = tiny_llama(2).to(torch.float32)  # the dtype inductor's C++ GEMMs run
    runner = ModelRunner(model, compiled=True)
    assert compiled_lean(model) is runner.lean and ModelRunner(model).lean is runner.lean
    assert ModelRunner(model, compiled=False).lean.compiled is None
    copied = copy.deepcopy(model)  # another model: it compiles its own, if asked
    assert compiled_lean(copied) is None and ModelRunner(copied).lean.compiled is None
    for length in (7, 250, 255, 600):  # 255 + 1 fills the first capacity (256) exactly
        greedy_decode(runner, [1 + i % 100 for i in range(length)], 3, [])
    cache = runner.new_cache()
    tokens = torch.arange(1, 60)
    runner.forward(tokens[:20], cache, 0, True)
    for n in (2, 5, 3, SHORT_PASS_TOKENS, 6, COMPILED_MAX_TOKENS, COMPILED_MAX_TOKENS + 1):
        runner.forward(tokens[20 : 20 + n], cache, 20, False)
        rollback(cache, 20)
    for n in (1, 3):  # a draft's tree level of one node, and of three, under a tree mask
        runner.forward_tree(tokens[20 : 20 + n], cache, 20, torch.full((n,), 20), torch.eye(n, dtype=torch.bool))
        rollback(cache, 20)
    assert counters["stats"]["unique_graphs"] == 3 and runner.lean.compiled.rebuilt == 0
    # every weight in every graph: the embedding; per layer two norms, q|k|v, o, gate|up and down; the final norm,
    # the head and the rotary frequencies
    assert frozen == [1 + 2 * 6 + 3] * 3
    assert runner.lean.compiled.built == {"step", "short", "wide"}


def test_compiled_passes_use_cpp_gemms_on_register_blocks_of_at_most_four_rows():
    """inductor's fp32 AVX-512 micro-kernels are narrowed to 4-row blocks while a pass compiles (8-row blocks spill
    their accumulators), and the table is inductor's own again afterwards."""
    import torch._inductor.compile_fx  # noqa: F401
    from torch._inductor.codegen.cpp_micro_gemm import VecAVX512, micro_gemm_configs

    def fp32_blocks():
        return [c.register_blocking for configs in micro_gemm_configs.values() for c in configs
                if c.vec_isa_cls is VecAVX512 and c.input_dtype == c.input2_dtype == torch.float32]

    before = fp32_blocks()
    assert max(block.block_m for block in before) > 4
    with narrow_gemm_blocks(4):
        assert [(b.block_m, b.block_n) for b in fp32_blocks()] == [(min(4, b.block_m), b.block_n) for b in before]
    assert fp32_blocks() == before
    options = compile_options(torch.device("cpu"))
    assert template_options(options) == {**options, "max_autotune_gemm_backends": "CPP"}
    assert template_options(compile_options(torch.device("cuda"))) == {}


@torch.inference_mode()
def test_the_compiled_forward_decodes_what_the_eager_one_does():
    """Greedy speculative decoding with trees and with chains through compiled passes (target and draft, float32:
    inductor's C++ GEMMs) gives the eager decoder's tokens."""
    target, draft = tiny_llama(2).to(torch.float32), tiny_llama(3).to(torch.float32)
    prompt = [5, 9, 2, 77, 3, 9, 2, 77]
    eager = [model_decoder(target, draft, 4, tree_budget=budget) for budget in (0, 3)]
    expected = [d.generate(prompt, max_new_tokens=30).token_ids for d in eager]
    use_compiled_passes(target)
    use_compiled_passes(draft)
    compiled = [model_decoder(target, draft, 4, tree_budget=budget) for budget in (0, 3)]
    assert compiled[0].target_runner.lean is compiled_lean(target) and eager[0].target_runner.lean.compiled is None
    assert [d.generate(prompt, max_new_tokens=30).token_ids for d in compiled] == expected


@torch.inference_mode()
def test_models_of_one_architecture_each_run_their_own_weights_compiled():
    """Compiled graphs are built without guards on the model's modules: two models alike but for their weights must
    still each get graphs of their own (their weights are frozen into them)."""
    models = [tiny_llama(seed).to(torch.float32) for seed in (2, 3)]
    tokens = torch.arange(1, 20)
    for model in models:
        logits = []
        for lean in (LeanDecoder(model, compiled=True), LeanDecoder(model)):
            cache = lean.new_cache()
            lean.forward_logits(tokens[:10], cache, 0, True)
            logits.append(torch.cat([lean.forward_logits(tokens[10:11], cache, 10, False),
                                     lean.forward_logits(tokens[11:14], cache, 11, False)]))
        torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_compiled_passes_return_the_hidden_states_a_feature_draft_reads():
    """A feature draft's decoder reads the hidden states entering some of the target's layers at every target pass:
    compiled passes return them as the eager forward does (their own graphs per set of layers, built once)."""
    torch._dynamo.reset()
    counters.clear()
    model = tiny_llama(5).to(torch.float32)
    compiled, eager = LeanDecoder(model, compiled=True), LeanDecoder(model)
    layers = (model.config.num_hidden_layers - 1, 0)  # in the order asked, not the layers' order
    tokens = torch.arange(1, 40)
    caches = [lean.new_cache() for lean in (compiled, eager)]
    for lean, cache in zip((compiled, eager), caches):
        lean.forward_logits(tokens[:8], cache, 0, True)
    start = 8
    for n in (1, 3, 6, 1, 2):
        got, want = (lean.forward_features(tokens[start : start + n], cache, start, layers)
                     for lean, cache in zip((compiled, eager), caches))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        start += n
    tree = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    got, want = (lean.forward_tree_features(tokens[start : start + 3], cache, start, torch.arange(start, start + 3),
                                            tree, layers) for lean, cache in zip((compiled, eager), caches))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert compiled.compiled.built == {"step+features", "short+features", "wide+features"}
    # three whole graphs, no graph break: a pass dynamo gives up on runs eager, right but slow
    assert counters["stats"]["unique_graphs"] == 3 and not counters["graph_break"]
    assert compiled.compiled.rebuilt == 0


@torch.inference_mode()
def test_where_a_graph_cannot_be_built_the_eager_forward_runs_instead(capsys):
    model = tiny_llama(4).to(torch.float32)
    compiled, eager = LeanDecoder(model, compiled=True), LeanDecoder(model)

    def no_compiler(*args):
        raise torch._inductor.exc.InductorError(RuntimeError("C++ compile error: g++ not found"), "")

    compiled.compiled.graphs = no_compiler
    tokens = torch.arange(1, 12)
    caches = [lean.new_cache() for lean in (compiled, eager)]
    for lean, cache in zip((compiled, eager), caches):
        lean.forward_logits(tokens[:8], cache, 0, True)
    got = compiled.forward_logits(tokens[8:11], caches[0], 8, False)
    assert compiled.compiled is None and caches[0].get_seq_length() == 11
    assert torch.equal(got, eager.forward_logits(tokens[8:11], caches[1], 8, False))
    err = capsys.readouterr().err
    assert "compiling the 2-layer llama model's passes of 2-4 tokens" in err
    assert "compiling failed, the eager forward runs instead" in err and "g++ not found" in err
