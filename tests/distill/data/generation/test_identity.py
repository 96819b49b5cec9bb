"""The response + top-k cache filled through inference servers (`distill.data.generation.generate`): the built-in
format, keyed by the engine's identity, never read as another teacher's; and a tiny distill job generating through a
fake server, its lineage tag naming the engine."""
from __future__ import annotations

import json

import pytest

from distill.data.generation.generate import ForeignCache, engine_cached_responses
from distill.data.generation.journal import Journal, Record
from distill.data.responses import ENGINE_FILE, DamagedCache, cached_responses, load_responses
from pipeline.config import load_config
from pipeline.traffic import Request
from tests.conftest import make_tiny_model, make_tokenizer
from tests.distill.fake_engine import STOP, FakeEngine, answer

PROMPTS = [[1, 10, 11, 12], [1, 20, 21], [1, 30, 31, 32, 33, 34], [1, 5], [1, 6, 7, 8]]
REQUESTS = [Request(f"q{i}", "c", ({"role": "user", "content": "x"},)) for i in range(len(PROMPTS))]
KW = dict(samples=3, max_new_tokens=6, temperature=0.8, seed=7, topk=4, stop_ids=[STOP], vocab_size=64)


def responses_cfg(*urls: str, **extra):
    overrides = ["distill.responses.engine=openai", f"distill.responses.servers=[{','.join(urls)}]",
                 "distill.responses.concurrency=2", *(f"distill.responses.{k}={v}" for k, v in extra.items())]
    return load_config(None, overrides).distill.responses


def test_engine_responses_fill_the_builtin_cache_format_once():
    with FakeEngine("llamacpp") as a, FakeEngine("llamacpp") as b:
        cfg = responses_cfg(a.url, b.url)
        made = engine_cached_responses(cfg, "fp", REQUESTS, PROMPTS, **KW)
        assert not made.hit and made.stats.completed[a.url] + made.stats.completed[b.url] == 15
        out = made.responses
        assert len(out) == 15 and out.request_ids[:2] == ["q0#0", "q1#0"] and out.request_ids[-1] == "q4#2"
        for r, (prompt, response) in enumerate(zip(out.prompt_ids, out.response_ids)):
            sample, index = divmod(r, len(PROMPTS))
            assert prompt == PROMPTS[index]
            greedy = sample == 0
            seed = 0 if greedy else (7 + sample) * 1_000_003 + index * 7_919
            assert response == answer(prompt, 0.0 if greedy else 0.8, seed, 6, 4)[0]
            values, ids = out.teacher_rows(r)
            assert values.shape == (len(response), 4) and ids[:, 0].tolist() == response
        for sample in range(3):  # each round saved as the built-in generator saves it
            assert len(load_responses(made.path / f"sample-{sample}")) == 5
        assert not (made.path / "engine-journal.jsonl").exists()
        recorded = json.loads((made.path / ENGINE_FILE).read_text())
        assert recorded["identity"] == made.identity.key() and recorded["topk"] == 4
        asked = a.requests + b.requests
        again = engine_cached_responses(cfg, "fp", REQUESTS, PROMPTS, **KW)
        assert again.hit and again.path == made.path and a.requests + b.requests == asked  # nothing asked again
        assert again.responses.response_ids == out.response_ids


def test_an_engine_cache_is_never_read_as_another_teachers():
    model, tokenizer = make_tiny_model(len(make_tokenizer()), seed=0), make_tokenizer()
    with FakeEngine("llamacpp", ftype="Q4_0") as q4, FakeEngine("llamacpp", ftype="F32") as f32:
        q4_made = engine_cached_responses(responses_cfg(q4.url), "fp", REQUESTS, PROMPTS, **KW)
        f32_made = engine_cached_responses(responses_cfg(f32.url), "fp", REQUESTS, PROMPTS, **KW)
        assert not f32_made.hit and f32_made.path != q4_made.path  # another quantization: another entry
        assert f32.requests == 15
        more_k = engine_cached_responses(responses_cfg(f32.url, topk=3), "fp", REQUESTS, PROMPTS, **KW)
        assert not more_k.hit and more_k.path != f32_made.path  # another top-k asked: another entry
    # the target in this process, same prompts and settings: its own entry, generated, not the engine's
    builtin, path, hit = cached_responses(model, tokenizer, "fp", REQUESTS, PROMPTS, samples=3, max_new_tokens=6,
                                          temperature=0.8, batch_size=2, seed=7, topk=4)
    assert not hit and path not in (q4_made.path, f32_made.path) and not (path / ENGINE_FILE).exists()
    # an entry that records another engine is refused by both readers
    (path / ENGINE_FILE).write_text(json.dumps({"identity": q4_made.identity.key()}))
    with pytest.raises(DamagedCache, match="inference server"):
        cached_responses(model, tokenizer, "fp", REQUESTS, PROMPTS, samples=3, max_new_tokens=6, temperature=0.8,
                         batch_size=2, seed=7, topk=4)
    from distill.data.generation.generate import check_entry

    with pytest.raises(ForeignCache, match="another teacher"):
        check_entry(q4_made.path, f32_made.identity)


def test_the_journal_survives_a_torn_last_line_and_counts_a_response_once(tmp_path):
    import torch

    journal = Journal(tmp_path / "j.jsonl")
    record = Record([5, 2], torch.tensor([[-0.1, -2.0], [-0.5, -1.0]]).half(), torch.tensor([[5, 7], [2, 9]]).int())
    journal.append((0, 1), record)
    journal.append((0, 1), Record([9], record.logprobs[:1], record.indices[:1]))  # a duplicate: the first wins
    journal.append((0, 2), record)
    journal.close()
    with open(tmp_path / "j.jsonl", "ab") as f:
        f.write(b'{"sample": 0, "index": 3, "k": 2, "tok')  # a kill mid-write
    loaded = Journal(tmp_path / "j.jsonl").load()
    assert sorted(loaded) == [(0, 1), (0, 2)] and loaded[(0, 1)].tokens == [5, 2]
    assert torch.equal(loaded[(0, 2)].indices, record.indices) and torch.equal(loaded[(0, 2)].logprobs,
                                                                               record.logprobs)
    again = Journal(tmp_path / "j.jsonl")
    again.append((0, 3), record)  # the torn line is cut off before appending
    again.close()
    assert sorted(Journal(tmp_path / "j.jsonl").load()) == [(0, 1), (0, 2), (0, 3)]


def test_a_tiny_distill_job_generates_its_training_data_through_a_server(tmp_path):
    """`distill.responses.engine=openai`: the training responses come from the server, the held-out ones from the
    target itself; the registered version's lineage names the engine."""
    import mlflow

    from distill.train import run_distill
    from tests.distill.tiny_job import tiny_config

    with FakeEngine("llamacpp", ftype="Q8_0") as server:
        cfg = tiny_config(tmp_path, "distill.responses.engine=openai", f"distill.responses.servers=[{server.url}]",
                          "distill.max_new_tokens=8")
        result = run_distill(cfg)
        trained = result.metrics["train_responses"]
        assert server.requests == trained  # every training response, and only those, asked of the server
    assert result.teacher.startswith("engine llamacpp") and "Q8_0" in result.teacher
    version = mlflow.MlflowClient().get_model_version(cfg.tracking.registered_model, result.version)
    assert version.tags["draftops.teacher"] == result.teacher
