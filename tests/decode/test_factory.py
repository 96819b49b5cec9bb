"""Every decoder comes from `decode.factory`: eval, bench, the sweep and the monitor build the same decoder from one
config, sampling settings and length included."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from decode.drafters.protocol import DECODER, DRAFT, LOOKUP
from decode.factory import build_decoder, model_decoder
from decode.measure.bench import bench_decoders
from decode.measure.bench_rows import DRAFT_ONLY_CHAIN
from decode.measure.evaluate import eval_decoders
from decode.measure.sweep_drafts import Draft
from decode.runtime.lean import compiled_lean
from decode.speculative import SpeculativeDecoder
from monitor.check.prompt_acceptance import live_decoder
from pipeline.config import DecodeConfig, load_config
from pipeline.families import FAMILY_NAMES
from tests.decode.models.test_feature_draft import make_feature_draft
from tests.decode.tiny import greedy_reference, perturbed_copy, tiny_llama
from tests.families import perturbed, tiny_family


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(0)
    target.generation_config.eos_token_id = 7
    draft = perturbed_copy(target, 1, 0.1)
    return (SimpleNamespace(model=target, tokenizer=None, source="target", path=None),
            SimpleNamespace(model=draft, tokenizer=None, token_ids=None, source="draft", path=None))


def test_eval_bench_sweep_and_monitor_build_the_same_decoders_from_one_config(models):
    target, draft = models
    cfg = load_config(None, ["decode.tree_budget_schedule=[[64, 4], [512, 6]]", "decode.gamma=3",
                             "decode.max_new_tokens=17", "decode.temperature=0"])
    evaluated = eval_decoders(target, draft, cfg.decode)
    _, _, benched = bench_decoders(target, draft, cfg.decode, None, None, None)
    live = live_decoder(cfg, target, draft)
    swept = Draft("draft", draft.model).decoder(target.model, cfg.decode.gamma)
    assert all(isinstance(d, SpeculativeDecoder) for d in [*evaluated.values(), *benched.values(), live, swept])
    # the draft alone in chain rounds: eval's draft row, bench's draft_only_chain row and the monitor's live check
    alone = evaluated[DRAFT].settings
    assert alone["rounds"] == "chain" and alone["gamma"] == 3 and alone["max_new_tokens"] == 17
    assert alone["eos_token_ids"] == [7]
    assert benched[DRAFT_ONLY_CHAIN].settings == alone == live.settings
    # the configured decoder: eval's and bench's are one decoder (trees with the config's budgets)
    assert evaluated[DECODER].settings == benched["speculative"].settings
    assert evaluated[DECODER].settings["rounds"] == "tree"
    # the sweep's cells: the same draft alone at the same γ, greedy; by design timed at fixed lengths (EOS ignored)
    # and without the confidence stop, whose block lengths the sweep's acceptance walk does not model
    own = ("eos_token_ids", "max_new_tokens", "drafter")
    assert {k: v for k, v in swept.settings.items() if k not in own} == {k: v for k, v in alone.items() if k not in own}
    assert swept.settings["eos_token_ids"] == [] and swept.settings["drafter"] == "draft"
    assert alone["drafter"] == f"draft(min_confidence={cfg.decode.draft_min_confidence})"


def test_the_decoder_generates_with_the_configs_sampling_and_length(models):
    target, draft = models
    cfg = load_config(None, ["decode.tree_budget_schedule=null", "decode.suffix=false", "decode.max_new_tokens=9",
                             "decode.temperature=0.7", "decode.top_k=20", "decode.top_p=0.9"])
    decoder = build_decoder(target, draft, cfg.decode)
    assert (decoder.sampling.max_new_tokens, decoder.sampling.temperature, decoder.sampling.top_k,
            decoder.sampling.top_p) == (9, 0.7, 20, 0.9)
    result = decoder.generate([1, 2, 3], seed=0)
    assert len(result.token_ids) <= 9
    assert result.token_ids == decoder.generate([1, 2, 3], max_new_tokens=9, temperature=0.7, top_k=20, top_p=0.9,
                                                seed=0).token_ids


def test_a_decoder_takes_a_drafter_and_the_factory_builds_it_from_a_model(models):
    target, draft = models
    with pytest.raises(TypeError, match="decode.factory.model_decoder"):
        SpeculativeDecoder(target.model, draft.model, 3)
    assert model_decoder(target.model, draft.model, 3).settings["eos_token_ids"] == [7]


def test_compiled_passes_fall_back_to_the_eager_forward(capsys):
    """Every supported family runs on the lean forward, compiled too: a model it does not run (GPT-NeoX, which the CLI
    refuses, built here directly) decodes through transformers' forward, said once per model."""
    model = tiny_family("gpt_neox")
    target = SimpleNamespace(model=model, tokenizer=None, source="target", path=None)
    draft = SimpleNamespace(model=perturbed(model, 1, 0.05), tokenizer=None, token_ids=None, source="draft", path=None)
    decoder, prompt = build_decoder(target, draft, DecodeConfig(compiled=True)), [5, 9, 2, 77, 3]
    assert decoder.generate(prompt, max_new_tokens=8).token_ids == greedy_reference(model, prompt, 8)
    build_decoder(target, None, DecodeConfig(compiled=True), kind=LOOKUP)  # said once per model
    assert capsys.readouterr().err.splitlines() == [
        f"draftops: notice: this gpt_neox model runs on the transformers forward, not the lean one (the same tokens, "
        f"more time per call{extra}): the lean forward runs {FAMILY_NAMES} models"
        for extra in ("; decode.compiled does not apply to it", "")]  # the target's, then the draft's


@torch.inference_mode()
def test_a_compiled_decoder_builds_every_graph_it_can_need_before_its_first_request():
    """Compiling a graph takes minutes on the real target: a feature draft's decoder that first needs its one-token
    verify in the middle of a request (after a round its draft proposed nothing) stalled that request for them. The
    decoder builds every width, capturing the draft's layers, when it is built; decoding then builds none."""
    torch._dynamo.reset()
    counters.clear()
    model = tiny_llama(6).to(torch.float32)  # the dtype inductor's C++ GEMMs run
    draft = make_feature_draft(model)
    target = SimpleNamespace(model=model, tokenizer=None, source="target", path=None)
    drafts = SimpleNamespace(model=draft, tokenizer=None, token_ids=None, source="draft", path=None)
    decoder = build_decoder(target, drafts, DecodeConfig(compiled=True, tree_budget=0, gamma=3), kind=DRAFT)
    passes = compiled_lean(model).compiled
    assert passes.built == {"step+features", "short+features", "wide+features"}
    built = counters["stats"]["unique_graphs"]
    for prompt in ([5, 9, 2, 77, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]):
        decoder.generate(prompt, max_new_tokens=12)
    runner = decoder.target_runner  # a one-token verify with features: the pass that stalled
    cache = runner.new_cache()
    runner.forward_features(torch.tensor([5, 9, 2]), cache, 0, draft.feature_layers)
    runner.forward_features(torch.tensor([4]), cache, 3, draft.feature_layers)
    assert counters["stats"]["unique_graphs"] == built and passes.rebuilt == 0
