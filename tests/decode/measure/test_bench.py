"""decode.measure.bench's cost accounting, its denominator and its llama.cpp rows, on hand-made timings."""
from __future__ import annotations

import contextlib
from pathlib import Path
from types import SimpleNamespace

import pytest

import decode.measure.bench_llamacpp as bench_llamacpp
import decode.serving.llamacpp as llamacpp
from decode.drafters.chain import ModelDrafter, make_drafter
from decode.drafters.lookup import LookupThenModelDrafter, PromptLookupDrafter
from decode.drafters.protocol import DECODER, DRAFT, LOOKUP
from decode.drafters.tree_drafter import make_tree_drafter
from decode.generation_stats import GenerationStats
from decode.measure.bench import in_run_costs, method_results
from decode.measure.bench_llamacpp import (
    LLAMA_CPP_SPECULATIVE,
    LLAMA_CPP_TARGET_ONLY,
    gguf_draft,
    llama_cpp_rows,
    llama_cpp_servers,
    llama_cpp_summary,
)
from decode.measure.bench_rows import TARGET_ONLY, TARGET_ONLY_TORCH
from decode.runtime.forward import ModelRunner
from decode.serving.llamacpp import Completion, LlamaCppError
from decode.step_costs import costed_drafter, step_costs


def test_in_run_costs_split_the_decoders_time_into_model_calls_and_bookkeeping():
    # plain decoding: 100 tokens in 4 s -> 40 ms a token
    target_only = {"seconds": 4.0, "new_tokens": 100}
    a = GenerationStats(new_tokens=60, target_calls=30, draft_calls=120, prefill_s=0.1, draft_s=0.6, verify_s=1.5,
                        total_s=2.4)
    b = GenerationStats(new_tokens=40, target_calls=20, draft_calls=80, prefill_s=0.1, draft_s=0.4, verify_s=1.0,
                        total_s=1.6)
    costs = in_run_costs([a, b], target_only)
    assert costs["target_step_s"] == pytest.approx(0.04)
    assert costs["c"] == pytest.approx((1.0 / 200) / 0.04)  # 5 ms a draft call
    assert costs["v"] == pytest.approx((2.5 / 50) / 0.04)  # 50 ms a verify
    assert costs["drafts_per_round"] == pytest.approx(4.0)
    assert costs["overhead_free_bound"] == pytest.approx(4.0 / 3.7)  # model time 0.2 + 1.0 + 2.5
    assert costs["model_time_share"] == pytest.approx(3.7 / 4.0)
    # a model-free decoder (lookup, suffix decoding): no draft calls, so c is 0; its search time stays in the bound
    lookup = GenerationStats(new_tokens=60, target_calls=30, draft_calls=0, prefill_s=0.1, draft_s=0.2, verify_s=1.5,
                             total_s=1.9)
    costs = in_run_costs([lookup], {"seconds": 2.4, "new_tokens": 60})
    assert costs["c"] == 0.0 and costs["drafts_per_round"] == 0.0
    assert costs["overhead_free_bound"] == pytest.approx(2.4 / 1.8)


def bench_rows(seconds_per_token: dict[str, float]) -> tuple[dict, dict]:
    """Two prompts of 10 and 30 new tokens, each method at its hand-made seconds per token; all outputs alike."""
    outputs = {name: [[1] * 10, [2] * 30] for name in seconds_per_token}
    seconds = {name: [10 * s, 30 * s] for name, s in seconds_per_token.items()}
    return outputs, seconds


def test_speedups_are_against_the_faster_target_only_row():
    # the target on torch's stock kernels (40 ms a token) beats it on draftops' kernels (50 ms a token)
    outputs, seconds = bench_rows({TARGET_ONLY: 0.05, TARGET_ONLY_TORCH: 0.04, "speculative": 0.02})
    results, baseline = method_results(outputs, seconds, seed=0)
    assert baseline == TARGET_ONLY_TORCH and "speedup" not in results[TARGET_ONLY_TORCH]
    assert results["speculative"]["speedup"]["value"] == pytest.approx(2.0)  # 0.04 / 0.02, not 0.05 / 0.02
    assert results[TARGET_ONLY]["speedup"]["value"] == pytest.approx(0.8)
    assert results[TARGET_ONLY]["tokens_per_s"]["value"] == pytest.approx(20.0)
    assert all(r["same_output_as_target"] == 2 and r["new_tokens"] == 40 for r in results.values())

    outputs, seconds = bench_rows({TARGET_ONLY: 0.03, TARGET_ONLY_TORCH: 0.04, "speculative": 0.02})
    results, baseline = method_results(outputs, seconds, seed=0)
    assert baseline == TARGET_ONLY and results["speculative"]["speedup"]["value"] == pytest.approx(1.5)
    assert results[TARGET_ONLY_TORCH]["speedup"]["value"] == pytest.approx(0.75)

    outputs, seconds = bench_rows({TARGET_ONLY: 0.05, "speculative": 0.02})  # kernels already torch's: one row
    assert method_results(outputs, seconds, seed=0)[1] == TARGET_ONLY


class FakeServer:
    """Stands in for a started `decode.serving.llamacpp.LlamaServer`: a fixed completion per prompt, with its
    timings."""

    def __init__(self, replies: dict[int, tuple[list[int], int, int]]):
        self.replies, self.asked = replies, []

    def complete(self, prompt: list[int], max_new_tokens: int) -> Completion:
        self.asked.append((prompt, max_new_tokens))
        tokens, drafted, accepted = self.replies[prompt[0]]
        return Completion(tokens, {"draft_n": drafted, "draft_n_accepted": accepted})


def test_llama_cpp_rows_compare_its_speculative_row_with_its_own_target_alone():
    alone = FakeServer({1: ([5] * 10, 0, 0), 2: ([6] * 30, 0, 0)})
    spec = FakeServer({1: ([5] * 10, 12, 6), 2: ([6] * 29 + [7], 40, 30)})
    completions = {}
    rows = llama_cpp_rows({LLAMA_CPP_TARGET_ONLY: alone, LLAMA_CPP_SPECULATIVE: spec}, 32, completions)
    rows[LLAMA_CPP_SPECULATIVE]([1, 9])  # a warm-up: its completion is not counted
    outputs = {name: [rows[name]([1, 9]), rows[name]([2, 9])] for name in rows}
    assert alone.asked == [([1, 9], 32), ([2, 9], 32)] and outputs[LLAMA_CPP_TARGET_ONLY][1] == [6] * 30
    seconds = {LLAMA_CPP_TARGET_ONLY: [1.0, 3.0], LLAMA_CPP_SPECULATIVE: [0.5, 1.5]}  # twice as fast
    summary = llama_cpp_summary(outputs, seconds, completions, seed=0)
    assert summary["speedup_vs_llama_cpp_target_only"]["value"] == pytest.approx(2.0)
    assert summary["same_output_as_llama_cpp_target_only"] == 1  # the second prompt's last token differs
    assert (summary["drafted"], summary["accepted"], summary["acceptance"]) == (52, 36, pytest.approx(36 / 52))

    # the llama.cpp rows never become the denominator, however fast
    outputs, seconds = bench_rows({TARGET_ONLY: 0.05, "speculative": 0.02, LLAMA_CPP_TARGET_ONLY: 0.01,
                                   LLAMA_CPP_SPECULATIVE: 0.008})
    results, baseline = method_results(outputs, seconds, seed=0)
    assert baseline == TARGET_ONLY and results[LLAMA_CPP_TARGET_ONLY]["speedup"]["value"] == pytest.approx(5.0)


def test_llama_cpp_servers_say_why_their_rows_cannot_run_and_on_makes_that_an_error(tmp_path, monkeypatch):
    with contextlib.ExitStack() as stack:
        assert llama_cpp_servers("off", "t.gguf", None, 5, tmp_path, stack) == (None, None)
        servers, why = llama_cpp_servers("auto", "t.gguf", None, 5, tmp_path, stack)
        assert servers is None and why == "llama.cpp's draft-model speculation takes a layer draft, not prompt lookup"
        with pytest.raises(LlamaCppError, match="^--llama-cpp on: llama.cpp's draft-model speculation takes a layer"):
            llama_cpp_servers("on", "t.gguf", None, 5, tmp_path, stack)
        layer_draft = SimpleNamespace(model=object(), path=tmp_path, fingerprint="f1")
        monkeypatch.setattr(llamacpp, "find_server", lambda: None)
        assert llama_cpp_servers("auto", "t.gguf", layer_draft, 5, tmp_path, stack) == (
            None, "llama-server is not built here (make llama-cpp)")
        monkeypatch.setattr(llamacpp, "find_server", lambda: Path("llama-server"))
        servers, why = llama_cpp_servers("auto", "HuggingFaceTB/SmolLM2-135M-Instruct", layer_draft, 5, tmp_path,
                                         stack)
        assert servers is None and why.startswith("the GGUF format takes its vocabulary from the target's GGUF")


def test_llama_cpp_servers_start_both_rows_on_a_draft_exported_once_per_fingerprint(tmp_path, monkeypatch):
    exports, started = [], []

    def fake_export(source, fmt, out, *, force, vocabulary):
        exports.append((source, fmt, vocabulary))
        out.mkdir(parents=True, exist_ok=True)
        (out / "draft-f16.gguf").write_text(f"export {len(exports)}")
        return out

    @contextlib.contextmanager
    def fake_server(model, *, draft=None, draft_max=5, threads=None, log=None):
        started.append((model, draft, draft_max))
        yield f"server {len(started)}"

    monkeypatch.setattr(bench_llamacpp, "export_format", fake_export)
    monkeypatch.setattr(bench_llamacpp, "draft_source", lambda source: f"located {source}")
    monkeypatch.setattr(llamacpp, "find_server", lambda: Path("llama-server"))
    monkeypatch.setattr(bench_llamacpp, "LlamaServer", fake_server)
    target = tmp_path / "target.gguf"
    target.write_text("gguf")
    draft = SimpleNamespace(model=object(), path=tmp_path / "draft-checkpoint", fingerprint="f1")
    folder = tmp_path / "llama.cpp"
    with contextlib.ExitStack() as stack:
        servers, why = llama_cpp_servers("on", str(target), draft, 4, folder, stack)
    assert why is None and servers == {LLAMA_CPP_TARGET_ONLY: "server 1", LLAMA_CPP_SPECULATIVE: "server 2"}
    gguf = folder / "draft" / "draft-f16.gguf"
    assert started == [(target, None, 5), (target, gguf, 4)]
    assert exports == [(f"located {draft.path}", "gguf", target)]
    # the same draft again: the GGUF beside its recorded fingerprint is reused; another draft is exported anew
    assert gguf_draft(draft, target, folder) == gguf and len(exports) == 1
    draft.fingerprint = "f2"
    assert gguf_draft(draft, target, folder) == gguf and len(exports) == 2 and gguf.read_text() == "export 2"
    assert (folder / "draft.fingerprint").read_text() == "f2"


def test_the_cost_model_charges_the_chain_drafter_behind_hybrids_and_trees(target, close_draft):
    hybrid = make_drafter(DECODER, target, close_draft, lookup_min_ngram=2)
    assert isinstance(hybrid, LookupThenModelDrafter) and costed_drafter(hybrid, 128) is hybrid.model
    chain = make_drafter(DRAFT, target, close_draft)
    assert costed_drafter(chain, 128) is chain
    tree = make_tree_drafter(DECODER, target, close_draft, budget=4, lookup_min_ngram=2)
    model = costed_drafter(tree, 128)
    assert isinstance(model, ModelDrafter) and model.runner.model is close_draft
    lookup_tree = costed_drafter(make_tree_drafter(LOOKUP, target, budget=4), 128)
    assert isinstance(lookup_tree, PromptLookupDrafter) and lookup_tree.vocab_size == 128


class CountingRunner(ModelRunner):
    """A target runner that records the tokens of every tree pass."""

    def __init__(self, model):
        super().__init__(model)
        self.tree_passes: list[tuple[int, list[int]]] = []

    def forward_tree(self, tokens, cache, start, positions, tree_mask):
        self.tree_passes.append((start, positions.tolist()))
        return super().forward_tree(tokens, cache, start, positions, tree_mask)


def test_step_costs_time_the_trees_own_verify_for_tree_rounds(target, close_draft):
    runner, prompt = CountingRunner(target), list(range(1, 11))
    drafter = costed_drafter(make_tree_drafter(DECODER, target, close_draft, budget=4), 128)
    chain = step_costs(runner, drafter, prompt, gamma=3, reps=2)
    assert "v_tree" not in chain and not runner.tree_passes
    costs = step_costs(runner, drafter, prompt, gamma=3, reps=2, tree_budget=4)
    assert costs["tree_budget"] == 4
    assert costs["v_tree"] == pytest.approx(costs["tree_verify_s"] / costs["target_step_s"])
    # 2 warm-up passes and 2 timed, each of the pending token and 4 nodes after the 10-token prompt: the root's two
    # children at depth 1, their first child's two at depth 2 (`decode.step_costs.measure_costs`'s tree verify)
    assert runner.tree_passes == [(10, [10, 11, 11, 12, 12])] * 4
