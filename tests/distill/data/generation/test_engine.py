"""The engine client (`distill.data.generation.engine`) against fake OpenAI-compatible servers in this process: spread
over servers, retries, timeouts, fewer top-k entries than asked, one-line errors; and what the servers report
(`identity`)."""
from __future__ import annotations

import pytest
import torch

from distill.data.generation.engine import EngineError, EngineRequest, Server, Settings, generate
from distill.data.generation.identity import DifferentTeachers, EngineUnavailable, common_identity, probe
from distill.losses import TopKTeacher, distillation_loss
from tests.distill.fake_engine import STOP, FakeEngine, Faults, answer

SETTINGS = Settings(max_new_tokens=8, topk=5, stop_ids=(STOP,), vocab_size=64)


def requests(n: int, temperature: float = 0.8) -> list[EngineRequest]:
    return [EngineRequest((1, i), f"r{i}#1", [1, 3 + i % 30, 4 + i % 7], temperature, 1000 + i) for i in range(n)]


def run(servers, reqs, settings=SETTINGS, **kw):
    got = {}

    def keep(request, parsed):
        assert request.key not in got  # each request is handed over once
        got[request.key] = parsed

    stats = generate(servers, reqs, settings, on_result=keep, **{"concurrency": 2, "timeout": 5.0, "retries": 3,
                                                                 "backoff": 0.01, **kw})
    return got, stats


def expected(request: EngineRequest, settings=SETTINGS):
    return answer(request.prompt, request.temperature, request.seed, settings.max_new_tokens, settings.topk)


@pytest.mark.parametrize("api", ["vllm", "llamacpp", "sglang"])
def test_requests_are_spread_over_every_server_and_each_answered_once(api):
    reqs = requests(40)
    with FakeEngine(api, faults=Faults(delay_s=0.01)) as a, FakeEngine(api, faults=Faults(delay_s=0.01)) as b:
        got, stats = run([Server(a.url, api, a.served), Server(b.url, api, b.served)], reqs)
    assert sorted(got) == sorted(r.key for r in reqs)
    assert stats.completed[a.url] > 0 and stats.completed[b.url] > 0 and sum(stats.completed.values()) == 40
    assert stats.retries == 0 and stats.fewest_topk == 5
    for request in reqs:
        tokens, top = expected(request)
        assert got[request.key].tokens == tokens
        assert got[request.key].top == [sorted(row, key=lambda p: (-p[0], p[1])) for row in top]


def test_server_errors_and_bodies_cut_short_are_retried():
    reqs = requests(12)
    with FakeEngine(faults=Faults(error_first=3, cut_first=5)) as server:
        got, stats = run([Server(server.url, "vllm")], reqs)
    assert sorted(got) == sorted(r.key for r in reqs) and stats.retries == 5
    assert all(got[r.key].tokens == expected(r)[0] for r in reqs)


def test_a_hung_request_times_out_and_is_retried_on_another_server():
    reqs = requests(6)
    with FakeEngine(faults=Faults(hang_first=2, hang_s=3.0)) as slow, FakeEngine() as fast:
        got, stats = run([Server(slow.url, "vllm"), Server(fast.url, "vllm")], reqs, timeout=0.5)
    assert sorted(got) == sorted(r.key for r in reqs) and stats.retries >= 2


def test_a_request_that_keeps_failing_is_one_line_naming_server_and_request():
    with FakeEngine(faults=Faults(error_first=10**6)) as server:
        with pytest.raises(EngineError) as caught:
            run([Server(server.url, "vllm")], requests(1), retries=2)
    message = str(caught.value)
    assert "\n" not in message and server.url in message and "request r0#1" in message and "503" in message
    assert "after 2 retries" in message


def test_a_dead_server_leaves_its_requests_to_the_others():
    with FakeEngine() as alive:
        dead = Server("http://127.0.0.1:9", "vllm")  # nothing listens on the discard port
        got, stats = run([dead, Server(alive.url, "vllm")], requests(10), retries=5)
    assert len(got) == 10 and stats.completed[alive.url] == 10 and stats.completed[dead.url] == 0


@pytest.mark.parametrize("faults,match", [(Faults(bad_token=True), "outside the target's vocabulary"),
                                          (Faults(truncate=True), "truncated")])
def test_unknown_tokens_and_truncated_responses_stop_the_run_with_one_line(faults, match):
    with FakeEngine("llamacpp", faults=faults) as server:
        with pytest.raises(EngineError, match=match) as caught:
            run([Server(server.url, "llamacpp")], requests(20, temperature=0.0))
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"{server.url}: request r")
    assert server.requests < 20 + 4  # not retried: the same request would give the same answer


def test_a_bad_request_is_not_retried():
    """vLLM refuses a top-k above its --max-logprobs (default 20) with HTTP 400: said at once, not retried."""
    with FakeEngine(faults=Faults(max_logprobs=20)) as server:
        with pytest.raises(EngineError, match="HTTP 400.*greater than max allowed: 20"):
            run([Server(server.url, "vllm")], requests(3), Settings(8, 64, (STOP,), 64), concurrency=1)
        assert server.requests == 1


def test_fewer_top_k_entries_than_asked_are_padded_into_the_tail_bucket():
    with FakeEngine(faults=Faults(topk_cap=3)) as server:
        got, stats = run([Server(server.url, "vllm")], requests(8))
    assert stats.fewest_topk == 3
    parsed = next(iter(got.values()))
    values, ids = parsed.teacher_rows(5)
    assert (ids[:, 3:] == -1).all() and torch.isneginf(values[:, 3:]).all()
    # the loss on the padded rows is the loss with k = 3: the tail bucket takes the rest
    logits = torch.randn(len(parsed.tokens), 64)
    padded = distillation_loss(logits, TopKTeacher(values, ids))
    narrow = distillation_loss(logits, TopKTeacher(values[:, :3], ids[:, :3]))
    torch.testing.assert_close(padded, narrow)


@pytest.mark.parametrize("api", ["vllm", "llamacpp", "sglang"])
def test_identity_is_what_the_server_reports(api):
    with FakeEngine(api, served="m1") as server:
        identity = probe(server.url)
        assert identity.api == api and identity.model == "m1"
        assert probe(server.url, api=api, model="m1") == identity
        with pytest.raises(EngineUnavailable, match="does not serve 'm2'"):
            probe(server.url, api=api, model="m2")
    if api == "llamacpp":
        assert identity.quantization == "F32" and identity.version == "b1-fake"
        assert identity.fingerprint == "size-1234-params-567"  # the GGUF is not on this machine: what it says of it


def test_servers_of_one_job_serve_one_model():
    with FakeEngine("llamacpp", ftype="Q8_0") as a, FakeEngine("llamacpp", ftype="Q4_0") as b, \
            FakeEngine("llamacpp", ftype="Q8_0") as c:
        same = {a.url: probe(a.url), c.url: probe(c.url)}
        assert common_identity(same).quantization == "Q8_0"
        with pytest.raises(DifferentTeachers, match="different models"):
            common_identity({a.url: probe(a.url), b.url: probe(b.url)})


def test_an_unreachable_server_is_named():
    with pytest.raises(EngineUnavailable, match="127.0.0.1:9"):
        probe("http://127.0.0.1:9", timeout=2.0)


def test_an_error_in_a_worker_thread_ends_the_job_through_the_caller_with_what_was_kept():
    """Whatever a worker meets (here the journal's disk failing at the 5th response), the job ends in the calling
    thread with one EngineError line; the responses kept before it were handed over once, and no others."""
    got = {}

    def keep(request, parsed):
        if len(got) == 4:
            raise OSError(28, "No space left on device")
        got[request.key] = parsed

    with FakeEngine() as server:
        with pytest.raises(EngineError, match="No space left on device") as caught:
            generate([Server(server.url, "vllm")], requests(12), SETTINGS, on_result=keep, concurrency=2, timeout=5.0)
    assert len(got) == 4 and "\n" not in str(caught.value) and "8 of 12 requests remain" in str(caught.value)


def test_retrying_stops_after_give_up_after_without_an_answer_whatever_the_retries():
    import time

    with FakeEngine(faults=Faults(hang_first=10**6, hang_s=30.0)) as server:
        start = time.monotonic()
        with pytest.raises(EngineError, match="no response kept for [23] s of retries") as caught:
            run([Server(server.url, "vllm")], requests(4), retries=10**6, timeout=0.5, give_up_after=2.0)
        assert time.monotonic() - start < 2.0 + 0.5 + 2.0  # the bound, one attempt's deadline, slack
    assert "no whole answer within 0.5 s" in str(caught.value) and "4 of 4 requests remain" in str(caught.value)
