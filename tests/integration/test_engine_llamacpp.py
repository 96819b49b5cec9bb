"""The engine source against real llama-servers (make test-llamacpp): two replicas of the default target's GGUF with
two slots each, a few held-out prompts, a greedy and a sampled round; the engine's teacher next to the fp32 target's
own on the same tokens."""
from __future__ import annotations

import pytest
import torch

from decode.serving.export import target_gguf
from decode.serving.llamacpp import LlamaServer, find_server
from distill.data.generation.generate import engine_cached_responses
from distill.data.responses import teacher_forced_topk
from pipeline.config import load_config
from pipeline.sources import DEFAULT_TARGET, eos_token_ids, resolve_model
from pipeline.traffic import encode_prompts, load_traffic


@pytest.fixture(scope="module")
def server():
    """llama-server, found before the test's own $DRAFTOPS_HOME hides the build."""
    found = find_server()
    if found is None:
        pytest.fail("no llama-server: `make test-llamacpp` builds it first (draftops llama-cpp build)")
    return found


@pytest.mark.llamacpp
def test_two_llama_servers_fill_the_cache_with_the_targets_teacher(server, tmp_path):
    target = resolve_model(DEFAULT_TARGET, device="cpu")
    requests = load_traffic("default").split("heldout")[:6]
    prompts, _ = encode_prompts(requests, target.tokenizer, max_prompt_tokens=384)
    gguf = target_gguf(DEFAULT_TARGET)
    with LlamaServer(gguf, slots=2, context=2048, threads=1, binary=server, log=tmp_path / "a.log") as a, \
            LlamaServer(gguf, slots=2, context=2048, threads=1, binary=server, log=tmp_path / "b.log") as b:
        cfg = load_config(None, ["distill.responses.engine=openai", f"distill.responses.servers=[{a.url},{b.url}]",
                                 "distill.responses.concurrency=2"]).distill.responses
        made = engine_cached_responses(cfg, target.fingerprint, requests, prompts, samples=2, max_new_tokens=32,
                                       temperature=0.8, seed=0, topk=16,
                                       stop_ids=eos_token_ids(target.model, target.tokenizer),
                                       vocab_size=target.model.config.vocab_size)
    assert made.identity.api == "llamacpp" and made.identity.weights == str(gguf) and made.identity.fingerprint
    assert made.stats.completed[a.url] > 0 and made.stats.completed[b.url] > 0 and len(made.responses) == 12
    out = made.responses
    greedy = range(len(requests))
    sequences = [out.prompt_ids[i] + out.response_ids[i] for i in greedy]
    forced = teacher_forced_topk(target.model, sequences, [len(out.prompt_ids[i]) for i in greedy], 16)
    agree, gaps = [], []
    for i in greedy:
        values, ids = out.teacher_rows(i)
        assert ids[:, 0].tolist() == out.response_ids[i]  # greedy: each token is the server's top-1
        assert values.shape[1] == 16 and (ids >= 0).all()
        agree += (ids[:, 0] == forced[i][1][:, 0]).tolist()
        gaps += (values[:, 0].float() - forced[i][0][:, 0].float()).abs().tolist()
    # the GGUF's weights are the target's (the fp32 target is converted from it); llama.cpp's own kernels and
    # activation rounding leave near-ties to fall either way
    assert sum(agree) / len(agree) > 0.9, sum(agree) / len(agree)
    assert torch.tensor(gaps).median() < 0.05, torch.tensor(gaps).median()
