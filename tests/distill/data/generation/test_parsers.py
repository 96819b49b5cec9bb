"""Completion responses of vLLM, llama-server and SGLang -> token ids and top-k log-probs (`distill.data.generation
.parsers`). llama-server's fixtures were recorded from the llama-server `make llama-cpp` builds, serving the default
target's GGUF; vLLM's and SGLang's are written from their documented response formats."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from distill.data.generation.engine import Settings, check_completion
from distill.data.generation.parsers import MalformedResponse, parse_llamacpp, parse_sglang, parse_vllm

FIXTURES = Path(__file__).parents[2] / "fixtures" / "engine"
SETTINGS = Settings(max_new_tokens=24, topk=4, stop_ids=(2,), vocab_size=49152)


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_llamacpp_completion_greedy_recorded():
    body = load("llamacpp_completion_greedy")
    parsed = parse_llamacpp(body, 4)
    assert parsed.tokens == body["tokens"] and parsed.tokens[-1] == 2 and parsed.finish == "stop"
    assert len(parsed.top) == len(parsed.tokens) and parsed.returned_k() == 4
    for token, row, entry in zip(parsed.tokens, parsed.top, body["completion_probabilities"]):
        assert row[0][1] == token  # greedy: the chosen token is the top-1
        assert [lp for lp, _ in row] == sorted((lp for lp, _ in row), reverse=True)
        assert row[0][0] == pytest.approx(entry["logprob"])
    check_completion(parsed, SETTINGS)  # ends with the stop id
    values, ids = parsed.teacher_rows(4)
    assert values.dtype == torch.float16 and ids.dtype == torch.int32 and values.shape == (len(parsed.tokens), 4)
    assert ids[:, 0].tolist() == parsed.tokens
    # more columns than the server returned: padded with -inf / -1 (the loss's tail bucket)
    values, ids = parsed.teacher_rows(6)
    assert torch.isneginf(values[:, 4:]).all() and (ids[:, 4:] == -1).all()


def test_llamacpp_completion_sampled_to_the_length_limit_recorded():
    body = load("llamacpp_completion_sampled_length")
    parsed = parse_llamacpp(body, 4)
    assert parsed.finish == "length" and len(parsed.tokens) == 6 and 2 not in parsed.tokens
    check_completion(parsed, Settings(6, 4, (2,), 49152))  # exactly max_new_tokens: complete
    with pytest.raises(MalformedResponse, match="truncated"):
        check_completion(parsed, Settings(8, 4, (2,), 49152))  # shorter than asked and no stop: cut short


def test_llamacpp_v1_completions_recorded_matches_its_own_completion():
    v1 = parse_llamacpp(load("llamacpp_v1_completions_greedy"), 4)
    native = parse_llamacpp(load("llamacpp_completion_greedy"), 4)
    assert v1.tokens == native.tokens and v1.finish == "stop"
    for a, b in zip(v1.top, native.top):
        assert [t for _, t in a] == [t for _, t in b]
        assert [lp for lp, _ in a] == pytest.approx([lp for lp, _ in b], abs=1e-4)


def test_llamacpp_token_without_an_entry_gets_no_top_k():
    """llama-server leaves out the entry of a token that ends inside a UTF-8 character."""
    body = load("llamacpp_completion_greedy")
    body["completion_probabilities"] = body["completion_probabilities"][:2] + body["completion_probabilities"][3:]
    parsed = parse_llamacpp(body, 4)
    assert parsed.top[2] is None and parsed.top[3][0][1] == parsed.tokens[3] and parsed.returned_k() == 0
    values, ids = parsed.teacher_rows(4)
    assert torch.isneginf(values[2]).all() and (ids[2] == -1).all()


def test_llamacpp_truncated_context_and_missing_fields_are_errors():
    body = load("llamacpp_completion_greedy")
    with pytest.raises(MalformedResponse, match="context"):
        parse_llamacpp({**body, "truncated": True}, 4)
    with pytest.raises(MalformedResponse, match="n_probs"):
        parse_llamacpp({k: v for k, v in body.items() if k != "completion_probabilities"}, 4)


def test_vllm_completions_greedy_recorded_format():
    parsed = parse_vllm(load("vllm_completions_greedy_length"), 4)
    assert parsed.tokens == [504, 9552, 1230, 339, 5248, 12634] and parsed.finish == "length"
    assert all(row[0][1] == t for row, t in zip(parsed.top, parsed.tokens))
    check_completion(parsed, Settings(6, 4, (2,), 49152))


def test_vllm_sampled_token_outside_the_top_k_is_dropped_and_minus_9999_is_kept_as_no_mass():
    parsed = parse_vllm(load("vllm_completions_sampled_stop"), 4)
    assert parsed.tokens == [43, 1113, 3735, 2] and parsed.finish == "stop"
    # 5 entries (the sampled token and the top 4): the 4 most likely, best first
    assert parsed.top[0] == [(-0.35, 504), (-1.9, 43), (-1.9, 49), (-2.5, 2)]
    assert 1113 not in [t for _, t in parsed.top[1]] and len(parsed.top[1]) == 4
    assert parsed.top[3][-1] == (-9999.0, 0)
    values, _ = parsed.teacher_rows(4)
    assert values[3, -1].float().exp() == 0
    check_completion(parsed, SETTINGS)


def test_vllm_token_strings_must_be_token_ids():
    body = load("vllm_completions_greedy_length")
    body["choices"][0]["logprobs"]["tokens"][1] = "The"
    with pytest.raises(MalformedResponse, match="return_tokens_as_token_ids"):
        parse_vllm(body, 4)
    body = load("vllm_completions_greedy_length")
    body["choices"][0]["logprobs"] = None
    with pytest.raises(MalformedResponse, match="logprobs"):
        parse_vllm(body, 4)


def test_sglang_generate_recorded_format():
    parsed = parse_sglang(load("sglang_generate_stop"), 3)
    assert parsed.tokens == [504, 9552, 1230, 314, 216, 34, 30, 2] and parsed.finish == "stop"
    assert parsed.top[3] == [(-0.8, 339), (-1.2, 314), (-2.0, 359)]  # sampled 314, not the top-1
    check_completion(parsed, SETTINGS)
    assert parse_sglang([load("sglang_generate_stop")], 3).tokens == parsed.tokens  # a batch of one
    body = load("sglang_generate_stop")
    body["meta_info"]["finish_reason"] = {"type": "abort", "message": "client disconnected"}
    with pytest.raises(MalformedResponse, match="abort"):
        parse_sglang(body, 3)


def test_unknown_token_ids_and_stops_inside_a_response_are_errors():
    parsed = parse_llamacpp(load("llamacpp_completion_greedy"), 4)
    with pytest.raises(MalformedResponse, match="outside the target's vocabulary"):
        check_completion(parsed, Settings(24, 4, (2,), 1000))
    parsed.tokens = parsed.tokens[:3] + [2] + parsed.tokens[3:]
    parsed.top = parsed.top[:3] + [parsed.top[-1]] + parsed.top[3:]
    with pytest.raises(MalformedResponse, match="truncated"):
        check_completion(parsed, SETTINGS)


def test_log_probs_are_log_probabilities():
    body = load("vllm_completions_greedy_length")
    body["choices"][0]["logprobs"]["top_logprobs"][0] = {"token_id:504": 0.7}
    with pytest.raises(MalformedResponse, match="not a log-probability"):
        parse_vllm(body, 4)
    assert math.isinf(parse_vllm({"choices": [{"finish_reason": "length", "logprobs": {
        "tokens": ["token_id:5"], "top_logprobs": [{"token_id:5": None}]}}]}, 2).top[0][0][0])
