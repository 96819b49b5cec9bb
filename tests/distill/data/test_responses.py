import torch

from decode.runtime.kernels import cpu_linear_of
from distill.data.responses import (
    cached_responses,
    generate_responses,
    generation_model,
    hf_generate,
    teacher_forced_topk,
)
from pipeline.traffic import Request
from tests.conftest import make_tiny_model, make_tokenizer

PROMPTS = [[1, 10, 11, 12], [1, 20, 21], [1, 30, 31, 32, 33, 34], [1, 5], [1, 6, 7, 8]]


def setup():
    tokenizer = make_tokenizer()
    return make_tiny_model(len(tokenizer), seed=0), tokenizer


def test_greedy_responses_with_recorded_top_k_match_a_teacher_forced_pass():
    model, tokenizer = setup()
    out = generate_responses(model, tokenizer, PROMPTS, max_new_tokens=6, temperature=0.0, batch_size=2, seed=0,
                             topk=5)
    assert len(out) == len(PROMPTS) and out.prompt_ids == PROMPTS
    assert out.offsets.tolist() == [0] + torch.tensor([len(r) for r in out.response_ids]).cumsum(0).tolist()
    forced = teacher_forced_topk(model, [p + r for p, r in zip(PROMPTS, out.response_ids)],
                                 [len(p) for p in PROMPTS], 5)
    for i, response in enumerate(out.response_ids):
        assert 1 <= len(response) <= 6
        assert 2 not in response[:-1]  # a response stops at its first EOS
        values, ids = out.teacher_rows(i)
        assert values.dtype == torch.float16 and ids.dtype == torch.int32 and values.shape == (len(response), 5)
        assert ids[:, 0].tolist() == response  # greedy: the response token is the target's top-1
        torch.testing.assert_close(values.float(), forced[i][0].float(), atol=2e-3, rtol=0)
        assert torch.equal(ids, forced[i][1])
    # batching and left padding do not change greedy responses
    again = generate_responses(model, tokenizer, PROMPTS, max_new_tokens=6, temperature=0.0, batch_size=5, seed=0,
                               topk=5)
    assert again.response_ids == out.response_ids


def test_continuous_batching_gives_transformers_generate_greedy_responses_and_teacher():
    """The lean engine (`decode.runtime.batch_generation`) and the fallback for other architectures agree."""
    model, tokenizer = setup()
    ours = generate_responses(model, tokenizer, PROMPTS, max_new_tokens=6, temperature=0.0, batch_size=2, seed=0,
                              topk=5)
    theirs = hf_generate(model, tokenizer, PROMPTS, max_new_tokens=6, temperature=0.0, batch_size=2, seed=0, topk=5)
    assert ours.response_ids == theirs.response_ids and torch.equal(ours.offsets, theirs.offsets)
    assert torch.equal(ours.topk_indices, theirs.topk_indices)
    torch.testing.assert_close(ours.topk_logprobs.float(), theirs.topk_logprobs.float(), atol=2e-3, rtol=0)


def test_sampled_responses_are_reproducible_and_cached(monkeypatch):
    model, tokenizer = setup()
    # generated twice from scratch: the same seed gives the same samples, another seed others
    sample = dict(max_new_tokens=5, temperature=1.0, batch_size=2, topk=4)
    one, two = (generate_responses(model, tokenizer, PROMPTS, seed=7, **sample) for _ in range(2))
    assert one.response_ids == two.response_ids and torch.equal(one.topk_logprobs, two.topk_logprobs)
    assert generate_responses(model, tokenizer, PROMPTS, seed=8, **sample).response_ids != one.response_ids
    requests = [Request(f"q{i}", "c", ({"role": "user", "content": "x"},)) for i in range(len(PROMPTS))]
    kw = dict(samples=3, max_new_tokens=5, temperature=1.0, batch_size=2, seed=7, topk=4)
    first, path, hit = cached_responses(model, tokenizer, "fp", requests, PROMPTS, **kw)
    assert not hit and path.parent.name == "responses" and path.name.startswith("fp-")
    assert len(first) == 15 and first.request_ids[:2] == ["q0#0", "q1#0"] and first.request_ids[-1] == "q4#2"
    assert first.offsets[-1] == first.num_response_tokens == first.topk_logprobs.shape[0]
    monkeypatch.setattr("distill.data.responses.generate_rounds", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    second, path2, hit = cached_responses(model, tokenizer, "fp", requests, PROMPTS, **kw)
    assert hit and path2 == path and second.response_ids == first.response_ids
    assert torch.equal(second.topk_indices, first.topk_indices)
    # a smaller k is a slice of the cache; a larger one is computed once by a teacher-forced pass, then reused
    smaller, _, _ = cached_responses(model, tokenizer, "fp", requests, PROMPTS, **{**kw, "topk": 2})
    assert torch.equal(smaller.topk_indices, first.topk_indices[:, :2])
    larger, path3, hit = cached_responses(model, tokenizer, "fp", requests, PROMPTS, **{**kw, "topk": 6})
    assert hit and path3 == path and larger.topk_indices.shape == (first.num_response_tokens, 6)
    assert torch.equal(larger.topk_indices[:, :4], first.topk_indices)
    monkeypatch.setattr("distill.data.responses.teacher_forced_topk",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    again, _, _ = cached_responses(model, tokenizer, "fp", requests, PROMPTS, **{**kw, "topk": 6})
    assert torch.equal(again.topk_logprobs, larger.topk_logprobs)


def test_a_damaged_cache_entry_is_generated_again(isolated_home):
    """A truncated teacher file or a dataset that does not fit its offsets is regenerated, not a traceback forever."""
    model, tokenizer = setup()
    requests = [Request(f"q{i}", "c", ({"role": "user", "content": "x"},)) for i in range(len(PROMPTS))]
    kw = dict(samples=2, max_new_tokens=5, temperature=1.0, batch_size=2, seed=7, topk=4)
    first, path, _ = cached_responses(model, tokenizer, "fp", requests, PROMPTS, **kw)
    teacher = path / "sample-1" / "teacher_topk.safetensors"
    teacher.write_bytes(teacher.read_bytes()[:100])  # a write cut short
    (path / "sample-0.old").mkdir()  # and a swap cut between its renames, on top of a complete entry
    again, _, hit = cached_responses(model, tokenizer, "fp", requests, PROMPTS, **kw)
    assert not hit and again.response_ids == first.response_ids
    assert torch.equal(again.topk_indices, first.topk_indices)
    assert sorted(p.name for p in path.iterdir()) == ["sample-0", "sample-1"]
    _, _, hit = cached_responses(model, tokenizer, "fp", requests, PROMPTS, **kw)
    assert hit


def test_generation_model_is_the_target_or_its_bfloat16_copy(monkeypatch):
    """`distill.generation_dtype`: auto takes bfloat16 where the measurement (`distill.precision`) picks it."""
    import distill.precision as choice

    model, _ = setup()
    assert generation_model(model, "float32") is model
    copy = generation_model(model, "bfloat16")
    assert copy is not model and next(copy.parameters()).dtype == torch.bfloat16
    # its products on weights packed once, where oneDNN packs bf16 (AVX-512); torch's product elsewhere
    assert cpu_linear_of(copy) == ("onednn" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "torch")
    assert next(model.parameters()).dtype == torch.float32  # the target itself is left as it was
    torch.testing.assert_close(copy.lm_head.weight.float(), model.lm_head.weight, atol=1e-2, rtol=1e-2)
    monkeypatch.setattr(choice, "bf16_units", lambda: [])
    assert generation_model(model, "auto") is model
    monkeypatch.setattr(choice, "bf16_units", lambda: ["avx512_bf16"])
    monkeypatch.setattr(choice, "step_costs", lambda model, rows: (2.0, 1.0))
    assert next(generation_model(model, "auto").parameters()).dtype == torch.bfloat16
    monkeypatch.setattr(choice, "step_costs", lambda model, rows: (1.0, 2.0))
    assert generation_model(model, "auto") is model  # bf16 units, but bf16 measured slower
    assert generation_model(copy, "auto") is copy  # already bfloat16: nothing to gain


def test_responses_of_another_precision_are_cached_apart(isolated_home):
    model, tokenizer = setup()
    requests = [Request(f"q{i}", "c", ({"role": "user", "content": "x"},)) for i in range(len(PROMPTS))]
    kw = dict(samples=1, max_new_tokens=5, temperature=1.0, batch_size=2, seed=7, topk=4)
    _, fp32_path, _ = cached_responses(model, tokenizer, "fp", requests, PROMPTS, **kw)
    bf16, bf16_path, hit = cached_responses(generation_model(model, "bfloat16"), tokenizer, "fp", requests, PROMPTS,
                                            **kw)
    assert not hit and bf16_path != fp32_path and len(bf16) == len(PROMPTS)
    _, again, hit = cached_responses(model, tokenizer, "fp", requests, PROMPTS, **kw)
    assert hit and again == fp32_path


def test_suffix_index_command_indexes_the_targets_greedy_responses_from_distills_cache(tmp_path, capsys):
    from decode.drafters.suffix import SuffixIndex
    from decode.serving.loading import load_model
    from distill.data.responses import cached_responses
    from pipeline.cli import main
    from pipeline.traffic import encode_prompts, load_traffic
    from tests.distill.tiny_job import write_target, write_traffic

    target, traffic = write_target(tmp_path / "target"), write_traffic(tmp_path / "traffic.jsonl", n=12)
    overrides = ["device=cpu", "distill.max_new_tokens=6", "distill.generation_batch_size=4", "distill.topk=4"]
    out = tmp_path / "index.json"
    assert main(["suffix-index", "--target", str(target), "--traffic", str(traffic), "--split", "all", "--limit", "5",
                 "--out", str(out), *overrides]) == 0
    printed = capsys.readouterr().out
    assert f"5 target responses to the all split of {traffic}" in printed and f"decode.suffix_index={out}" in printed

    # the same responses distillation generates (greedy, distill's settings), now from the cache
    model = load_model(str(target), device="cpu")
    requests = load_traffic(traffic).split("all")[:5]
    prompts, _ = encode_prompts(requests, model.tokenizer, 512)
    responses, _, cached = cached_responses(model.model, model.tokenizer, model.fingerprint, requests, prompts,
                                            samples=1, max_new_tokens=6, temperature=0.8, batch_size=4, seed=0,
                                            topk=4)
    assert cached and SuffixIndex.load(out).sequences() == responses.response_ids
    assert main(["suffix-index", "--target", str(target), "--traffic", str(tmp_path / "none.jsonl"), "--out",
                 str(out), *overrides]) == 2
    assert "none.jsonl" in capsys.readouterr().err
