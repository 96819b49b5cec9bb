"""Speculative decoding of the real SmolLM2-135M-Instruct target (slow: `make test-integration`).

The prompts are the held-out split of the traffic draftops ships, so a clone with nothing beside it runs the test."""
import pytest
import torch

from decode.drafters.protocol import DECODER
from decode.drafters.suffix import SuffixIndex
from decode.drafters.tree_drafter import make_tree_drafter
from decode.factory import model_decoder
from decode.models.feature_draft import feature_draft_from_target
from decode.models.layer_draft import draft_from_target_layers, reduce_vocabulary
from decode.runtime.forward import ModelRunner, greedy_decode
from decode.runtime.lean import compiled_lean, use_compiled_passes
from decode.serving.loading import load_model
from pipeline.sources import eos_token_ids
from pipeline.traffic import DEFAULT_TRAFFIC, encode_prompts, first_per_category, load_traffic

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def target():
    return load_model("smollm2-135m-instruct", device="cpu")  # with the decoder's CPU kernels


def target_only(target, prompt: list[int], eos: list[int]) -> torch.Tensor:
    """HF greedy `generate` on the target alone: 32 new tokens."""
    ids = torch.tensor([prompt])
    return target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0])[0, len(prompt):]


def test_greedy_equals_target_only_on_shipped_heldout_traffic(target):
    """Any draft must leave greedy output unchanged: here a 2-layer cut of the target with an 8k-row head, on two
    held-out requests of every category and the held-out conversations (several turns)."""
    torch.manual_seed(0)
    draft = draft_from_target_layers(target.model, [0, 1]).eval()
    token_ids = torch.arange(8192)
    reduce_vocabulary(draft, token_ids, target.model.get_output_embeddings().weight.detach())
    eos = eos_token_ids(target.model, target.tokenizer)
    decoder = model_decoder(target.model, draft, gamma=4, draft_token_ids=token_ids, eos_token_ids=eos)
    traffic = load_traffic(DEFAULT_TRAFFIC)
    heldout = traffic.split("heldout")
    requests = first_per_category(heldout, 2) + [r for r in heldout if len(r.messages) > 1]
    prompts, _ = encode_prompts(requests, target.tokenizer, max_prompt_tokens=384)
    accepted = 0
    for request, prompt in zip(requests, prompts):
        reference = target_only(target, prompt, eos)
        result = decoder.generate(prompt, max_new_tokens=32)
        assert result.token_ids == reference.tolist(), f"{request.id} diverged from target-only greedy decoding"
        accepted += result.stats.accepted
    assert {r.category for r in requests} == set(traffic.categories()) and len(requests) == 17 and accepted > 0


@pytest.mark.parametrize("trees", [False, True], ids=["chain", "tree"])
def test_greedy_with_a_feature_draft_equals_target_only(target, trees):
    """The EAGLE-3 feature draft (untrained: from the target's own weights, an 8k-row head) reads the target's
    hidden states of every verify pass, chains or trees (every node's states, the accepted path's handed over);
    with prompt lookup first, as the default decoder runs. One held-out request of every category."""
    draft = feature_draft_from_target(target.model, torch.arange(8192)).eval()
    eos = eos_token_ids(target.model, target.tokenizer)
    if trees:
        draft = make_tree_drafter(DECODER, target.model, draft, budget_schedule=[[320, 4], [1280, 8], [2048, 4]],
                                  branching=4, lookup_min_ngram=3)
    decoder = model_decoder(target.model, draft, gamma=3, lookup_min_ngram=None if trees else 3,
                                 eos_token_ids=eos)
    requests = first_per_category(load_traffic(DEFAULT_TRAFFIC).split("heldout"), 1)
    prompts, _ = encode_prompts(requests, target.tokenizer, max_prompt_tokens=384)
    for request, prompt in zip(requests, prompts):
        reference = target_only(target, prompt, eos)
        result = decoder.generate(prompt, max_new_tokens=32)
        assert result.token_ids == reference.tolist(), f"{request.id} diverged from target-only greedy decoding"
        assert result.stats.draft_calls > 0


def tree_case(target):
    """A 2-layer cut of the target with an 8k-row head, and one held-out request of every category with its prompt
    and the target's greedy reply -> (draft, draft token ids, eos ids, requests, prompts, references)."""
    draft = draft_from_target_layers(target.model, [0, 1]).eval()
    token_ids = torch.arange(8192)
    reduce_vocabulary(draft, token_ids, target.model.get_output_embeddings().weight.detach())
    eos = eos_token_ids(target.model, target.tokenizer)
    requests = first_per_category(load_traffic(DEFAULT_TRAFFIC).split("heldout"), 1)
    prompts, _ = encode_prompts(requests, target.tokenizer, max_prompt_tokens=384)
    return draft, token_ids, eos, requests, prompts, [target_only(target, prompt, eos).tolist() for prompt in prompts]


def test_greedy_with_token_trees_equals_target_only(target):
    """Tree rounds as docs/concepts.md#token-trees measures them: prompt lookup's branches, suffix decoding's
    candidates and the draft's tree (4 per level) under the sweep's budgets, one target pass a round. The suffix index
    holds the target's greedy replies to half of the requests, so suffix candidates are accepted there and the draft's
    tree works elsewhere. One held-out request of every category."""
    draft, token_ids, eos, requests, prompts, references = tree_case(target)
    drafter = make_tree_drafter(DECODER, target.model, draft, budget_schedule=[[320, 4], [1280, 8], [2048, 4]],
                                branching=4, draft_token_ids=token_ids, lookup_min_ngram=2, suffix=True,
                                suffix_index=SuffixIndex(references[: len(references) // 2]))
    decoder = model_decoder(target.model, drafter, gamma=5, eos_token_ids=eos)
    accepted = {}
    for request, prompt, reference in zip(requests, prompts, references):
        result = decoder.generate(prompt, max_new_tokens=32)
        assert result.token_ids == reference, f"{request.id} diverged from target-only greedy decoding"
        for source, n in result.stats.accepted_by_source.items():
            accepted[source] = accepted.get(source, 0) + n
    assert accepted.get("suffix", 0) > 0 and accepted.get("draft", 0) > 0


def test_greedy_through_compiled_passes_equals_target_only():
    """`decode.compiled`: the target's and the draft's passes as compiled graphs (minutes to build). Trees of 3 nodes
    (4-token passes) from prompt lookup, suffix decoding and the draft; chains of 5 (6-token verifies: the wide graph,
    on its own GEMM blocks); plain greedy decoding through the compiled target. A fresh target: the module's stays
    eager for the others. One held-out request of every category."""
    target = load_model("smollm2-135m-instruct", device="cpu")
    draft, token_ids, eos, requests, prompts, references = tree_case(target)
    use_compiled_passes(target.model)
    use_compiled_passes(draft)
    drafter = make_tree_drafter(DECODER, target.model, draft, budget_schedule=[[2048, 3]], branching=4,
                                draft_token_ids=token_ids, lookup_min_ngram=2, suffix=True,
                                suffix_index=SuffixIndex(references[: len(references) // 2]))
    decoder = model_decoder(target.model, drafter, gamma=5, eos_token_ids=eos)
    chains = model_decoder(target.model, draft, gamma=5, draft_token_ids=token_ids, eos_token_ids=eos)
    assert decoder.target_runner.lean is compiled_lean(target.model)
    runner = ModelRunner(target.model)
    for request, prompt, reference in zip(requests, prompts, references):
        assert decoder.generate(prompt, max_new_tokens=32).token_ids == reference, f"{request.id}: trees"
        assert chains.generate(prompt, max_new_tokens=32).token_ids == reference, f"{request.id}: chains"
        assert greedy_decode(runner, prompt, 32, eos) == reference, f"{request.id}: plain"
    assert compiled_lean(target.model).compiled.built == {"step", "short", "wide"}
