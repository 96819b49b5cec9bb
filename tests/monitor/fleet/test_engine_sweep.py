"""`draftops engine sweep` against a fake OpenAI-compatible engine on 127.0.0.1 (a threaded HTTP server whose draft pays
while few requests run at once and costs beyond), and the recommended setting in each engine's own terms."""
import contextlib
import http.server
import json
import threading
import time

import pytest

from monitor.fleet.engine_settings import recommendations, setting
from monitor.fleet.engine_sweep import RESULT_FILE, TABLE_FILE, SweepResult, levels, sweep
from pipeline.cli import main
from tests.monitor.check.test_run import write_traffic
from tests.monitor.deploy_world import llamacpp_text

TOKENS = 16


class FakeEngine(http.server.BaseHTTPRequestHandler):
    """POST /v1/chat/completions: `max_tokens` tokens after `seconds(active, drafting)` of work, shared as the
    requests served at once (`active`) change while it runs; GET /metrics: llama-server's counters, 0.6 of the draft
    tokens accepted."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        asked = body.get("speculative.n_max") if server.per_request else None
        drafting = server.draft and asked != 0
        tokens = asked or 3
        with server.lock:
            server.active += 1
            server.bodies.append(body)
        work, last = 1.0, time.monotonic()
        while work > 0:  # progress by the wall time that passed, so a loaded machine's late wake-ups cost no work
            time.sleep(0.002)
            now = time.monotonic()
            work -= (now - last) / server.seconds(server.active, drafting, tokens)
            last = now
        with server.lock:
            server.active -= 1
            if drafting:
                server.drafts += body["max_tokens"]
                server.draft_tokens += tokens * body["max_tokens"]
        answer = json.dumps({"choices": [{"message": {"content": "x"}}],
                             "usage": {"completion_tokens": body["max_tokens"]}}).encode()
        self._send(answer)

    def do_GET(self):
        s = self.server
        self._send(llamacpp_text(s.drafts, s.draft_tokens, round(0.6 * s.draft_tokens)).encode())

    def _send(self, body):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


BASE_SECONDS = 0.8  # a request's time without the draft: long beside a loaded machine's delays in starting requests


def paying_until_four(active, drafting, tokens=3):
    """The draft quarters a request's time while at most 2 run at once, and doubles it beyond."""
    return (BASE_SECONDS / 4 if active <= 2 else BASE_SECONDS * 2) if drafting else BASE_SECONDS


@contextlib.contextmanager
def fake_engine(draft=True, seconds=paying_until_four, per_request=True):
    """`per_request`: the engine takes each request's `speculative.n_max` (builds that ignore it: False)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeEngine)
    server.draft, server.seconds, server.active, server.draft_tokens = draft, seconds, 0, 0
    server.drafts, server.per_request = 0, per_request
    server.lock, server.bodies = threading.Lock(), []
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


PROMPTS = [[{"role": "user", "content": f"question {i}"}] for i in range(5)]


def test_levels_are_powers_of_two_up_to_the_maximum():
    assert levels(8) == [1, 2, 4, 8] and levels(6) == [1, 2, 4, 6] and levels(1) == [1]


def test_the_sweep_finds_where_the_draft_stops_paying_through_two_endpoints():
    with fake_engine() as (drafted, url), fake_engine(draft=False) as (_, plain):
        result = sweep(url=url, plain_url=plain, plain_body={}, kind="llamacpp", draft_tokens=3, model=None,
                       prompts=PROMPTS, max_concurrency=8, requests=8, max_tokens=TOKENS, timeout=30,
                       metrics_url=f"{url}/metrics")
    speedups = result.speedups()
    assert list(speedups) == [1, 2, 4, 8]
    assert speedups[1] > 1.3 and speedups[2] > 1.3 and speedups[4] < 0.8 and speedups[8] < 0.8
    assert result.boundary == 4
    drafted_passes = [p for p in result.passes if p.draft]
    assert all(p.acceptance == pytest.approx(0.6, abs=0.01) for p in drafted_passes)
    assert all(p.completion_tokens == 8 * TOKENS and len(p.tokens_per_second) == 8 for p in result.passes)
    assert drafted_passes[0].time_per_output_token < BASE_SECONDS / TOKENS
    assert result.settings() == {1: "--draft-max 3 --draft-min 0", 2: "--draft-max 3 --draft-min 0",
                                 4: "no --model-draft (speculation off)", 8: "no --model-draft (speculation off)"}
    table = result.markdown("sweep")
    assert "| 4 |" in table and "Speculation stops paying at concurrency 4." in table


def test_one_endpoint_with_the_engines_per_request_switch(tmp_path, mlflow_uri):
    traffic = tmp_path / "traffic.jsonl"
    write_traffic(traffic, 0, 60)
    with fake_engine() as (server, url):
        code = main(["engine", "sweep", "--url", url, "--plain-body", '{"speculative.n_max": 0}', "--kind",
                     "llamacpp", "--draft-tokens", "4", "--max-concurrency", "4", "--requests", "4", "--max-tokens",
                     str(TOKENS), "--out", str(tmp_path / "out"), f"traffic.path={traffic}",
                     "traffic.heldout_fraction=0.5", f"tracking.uri={mlflow_uri}", "tracking.system_metrics=false"])
    assert code == 0
    result = json.loads((tmp_path / "out" / RESULT_FILE).read_text())
    assert result["boundary_concurrency"] == 4 and result["engine"] == "llamacpp"
    assert result["settings"]["1"] == "--draft-max 4 --draft-min 0"
    assert sum(1 for b in server.bodies if b.get("speculative.n_max") == 0) == len(server.bodies) // 2
    assert all(b["temperature"] == 0 and b["max_tokens"] == TOKENS for b in server.bodies)
    assert all(b["cache_prompt"] is False for b in server.bodies)  # each pass prefills its prompts afresh
    assert "| concurrency |" in (tmp_path / "out" / TABLE_FILE).read_text()
    from mlflow import MlflowClient
    client = MlflowClient()
    run = client.search_runs([client.get_experiment_by_name("draftops-engine").experiment_id])[0]
    assert run.info.run_name == "engine-sweep" and run.data.metrics["engine/boundary_concurrency"] == 4


def test_a_sweep_needs_one_way_to_run_without_the_draft(capsys):
    assert main(["engine", "sweep", "--url", "http://127.0.0.1:9", "--kind", "vllm"]) == 2
    assert "give --plain-url" in capsys.readouterr().err


def test_an_engine_that_cannot_be_reached_is_one_line(tmp_path, capsys):
    traffic = tmp_path / "traffic.jsonl"
    write_traffic(traffic, 0, 20)
    assert main(["engine", "sweep", "--url", "http://127.0.0.1:9", "--plain-url", "http://127.0.0.1:9", "--kind",
                 "vllm", "--timeout", "2", f"traffic.path={traffic}", "traffic.heldout_fraction=0.5"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("draftops:")]
    assert errors == ["draftops: error: http://127.0.0.1:9: ConnectionRefusedError: [Errno 111] Connection refused"]


def test_vllm_setting_carries_its_batch_size_rule():
    assert setting("vllm", 5, True, 4) == ('--speculative-config \'{"num_speculative_tokens": 5, '
                                           '"disable_by_batch_size": 4}\'')
    assert setting("vllm", 5, True, None) == '--speculative-config \'{"num_speculative_tokens": 5}\''
    assert setting("vllm", 5, False, 4) == "no --speculative-config (speculation off)"


def test_llamacpp_setting_is_draft_max_and_min():
    assert recommendations("llamacpp", 3, {1: 1.4, 2: 1.1, 4: 0.9}, 4) == {
        1: "--draft-max 3 --draft-min 0", 2: "--draft-max 3 --draft-min 0", 4: "no --model-draft (speculation off)"}


def test_sglang_setting_is_its_speculative_steps():
    assert setting("sglang", 3, True, 8) == ("--speculative-num-steps 3 --speculative-num-draft-tokens 4 "
                                             "--speculative-eagle-topk 1")
    assert setting("sglang", 3, False, 8) == "no --speculative-algorithm (speculation off)"
    with pytest.raises(ValueError, match="engine kind 'tgi'"):
        setting("tgi", 3, True, None)


def test_a_result_with_no_boundary_says_it_paid_everywhere():
    from monitor.fleet.engine_sweep import Pass
    result = SweepResult("vllm", 5, [Pass(1, True, 2, 20, 1.0, [10.0, 10.0], 0.1, 0.5),
                                     Pass(1, False, 2, 20, 2.0, [5.0, 5.0], 0.2)])
    assert result.boundary is None and result.speedups() == {1: 2.0}
    assert "paid at every concurrency" in result.markdown("x")


def fewer_tokens_pay_more(active, drafting, tokens=3):
    """Drafting pays at every concurrency, most with 2 draft tokens a round."""
    return 0.2 / (3 if tokens == 2 else 1.5) if drafting else 0.2


def test_several_numbers_of_draft_tokens_each_swept_and_the_fastest_recommended(tmp_path):
    with fake_engine(seconds=fewer_tokens_pay_more) as (server, url):
        result = sweep(url=url, plain_url=None, plain_body={"speculative.n_max": 0}, kind="llamacpp",
                       draft_tokens=[2, 5], model=None, prompts=PROMPTS, max_concurrency=2, requests=2,
                       max_tokens=TOKENS, timeout=30, metrics_url=f"{url}/metrics")
    assert sorted({b.get("speculative.n_max") for b in server.bodies}) == [0, 2, 5]
    assert [(p.concurrency, p.draft, p.draft_tokens) for p in result.passes] == [
        (1, True, 2), (1, True, 5), (1, False, None), (2, True, 2), (2, True, 5), (2, False, None)]
    assert result.best_draft_tokens() == {1: 2, 2: 2} and result.boundary is None
    assert result.settings() == {1: "--draft-max 2 --draft-min 0", 2: "--draft-max 2 --draft-min 0"}
    assert "throughput by draft tokens" in result.markdown("x") and "2: " in result.markdown("x")


def test_several_numbers_of_draft_tokens_need_the_engines_per_request_count():
    from monitor.fleet.engine_sweep import SweepError
    with pytest.raises(SweepError, match="llama-server takes and vllm does not"):
        sweep(url="http://127.0.0.1:9", plain_url="http://127.0.0.1:9", plain_body={}, kind="vllm",
              draft_tokens=[2, 5], model=None, prompts=PROMPTS, max_concurrency=1, requests=1, max_tokens=TOKENS,
              timeout=2, metrics_url=None)


def test_an_engine_that_ignores_the_per_request_switch_is_one_line_not_a_table():
    """llama-server builds that disable per-request speculative settings keep drafting under `--plain-body`: the sweep
    would compare the draft with itself, so it stops and says so."""
    from monitor.fleet.engine_sweep import SweepError
    with fake_engine(per_request=False) as (_, url):
        with pytest.raises(SweepError, match="kept drafting with --plain-body .* give --plain-url"):
            sweep(url=url, plain_url=None, plain_body={"speculative.n_max": 0}, kind="llamacpp", draft_tokens=3,
                  model=None, prompts=PROMPTS, max_concurrency=1, requests=1, max_tokens=TOKENS, timeout=30,
                  metrics_url=f"{url}/metrics")
        with pytest.raises(SweepError, match="ignores the per-request number"):
            sweep(url=url, plain_url=url, plain_body={}, kind="llamacpp", draft_tokens=[1, 2], model=None,
                  prompts=PROMPTS, max_concurrency=1, requests=1, max_tokens=TOKENS, timeout=30,
                  metrics_url=f"{url}/metrics")
