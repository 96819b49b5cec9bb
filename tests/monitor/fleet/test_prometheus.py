"""Windows from Prometheus' HTTP API, against recorded answers.

data/prometheus/ holds answers in the documented format of `/api/v1/query_range` (resultType matrix) and
`/api/v1/query` (vector): ten hourly windows ending at END of two vLLM replicas (10.0.0.5:8000 with two engine cores
and a second model's series, 10.0.0.6:8000 whose acceptance falls by 10 points over the last three hours, one
missing point), an SGLang replica (its acceptance gauge's hourly means, one idle hour), `up` (10.0.0.8:8000 down,
Prometheus itself up) and the counters' names by instance; and a `bad_data` error answer.
"""
import http.server
import json
import threading
import urllib.parse
from pathlib import Path

import pytest

from monitor.check.decision import Decision, Status, with_fleet
from monitor.fleet.prometheus import PrometheusError, api_get, fleet_windows, queries, state_path
from monitor.fleet.verdicts import fleet_verdict, read_fleet
from pipeline.config import load_config

DATA = Path(__file__).parent.parent / "data" / "prometheus"
END = 1788645600  # the last window's end (a multiple of 1 h)
NOW = END + 600
A, B, C, D = "10.0.0.5:8000", "10.0.0.6:8000", "10.0.0.7:30000", "10.0.0.8:8000"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


class Recorded:
    """Prometheus as recorded: each query answered from data/prometheus by what it asks for; the URLs asked kept."""

    def __init__(self, error: bool = False):
        self.asked: list[str] = []
        self.error = error

    def __call__(self, url: str, timeout: float) -> dict:
        self.asked.append(url)
        if self.error:
            return json.loads((DATA / "error_bad_data.json").read_text())
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["query"][0]
        if "/api/v1/query_range" in url:
            name = next(key for key, part in (("per_pos", "per_pos"), ("accepted", "num_accepted_tokens"),
                                               ("draft_tokens", "num_draft_tokens"), ("drafts", "num_drafts"),
                                               ("gauge", "spec_accept_rate"), ("verify_calls", "verify_calls"))
                        if part in query)
            return json.loads((DATA / f"query_range_{name}.json").read_text())
        return json.loads((DATA / ("query_engines.json" if query.startswith("count by") else "query_up.json"))
                          .read_text())


def config(tmp_path, engines=None, **monitor):
    engines = [{"replica": A, "model": MODEL}, {"replica": B}, {"replica": C, "kind": "sglang"}, {"replica": D}] \
        if engines is None else engines
    overrides = [f"monitor.state_dir={tmp_path}", "monitor.prometheus_url=http://prometheus.invalid:9090",
                 "monitor.prometheus_selector=job=~\"vllm|sglang\"", f"monitor.engines={json.dumps(engines)}",
                 "monitor.server_baseline_windows=7", "monitor.server_recent_windows=3",
                 *(f"monitor.{k}={v}" for k, v in monitor.items())]
    return load_config(None, overrides)


def test_queries_ask_for_increase_over_the_window_at_a_step_of_one_window(tmp_path):
    cfg = config(tmp_path)
    assert queries(cfg)["accepted"] == ('increase({__name__=~"(?:vllm|llamacpp):spec_decode_num_accepted_tokens_'
                                        'total", job=~"vllm|sglang"}[1h])')
    assert queries(cfg)["gauge"] == 'avg_over_time(sglang:spec_accept_rate{job=~"vllm|sglang"}[1h])'
    prometheus = Recorded()
    fleet_windows(cfg, "1", prometheus, now=NOW)
    ranges = [urllib.parse.parse_qs(urllib.parse.urlsplit(u).query) for u in prometheus.asked if "query_range" in u]
    assert len(ranges) == 6 and all(u.startswith("http://prometheus.invalid:9090/api/v1/") for u in prometheus.asked)
    # the first reading takes the last 7 + 3 windows: ends END - 9 h ... END, one window apart
    assert {(r["start"][0], r["end"][0], r["step"][0]) for r in ranges} == {(str(END - 9 * 3600), str(END), "3600")}


def test_each_replica_gets_its_windows_from_the_recorded_answers(tmp_path):
    windows = fleet_windows(config(tmp_path), "1", Recorded(), now=NOW)
    assert list(windows) == [A, B, C, D]
    a, b, c, d = (windows[n] for n in (A, B, C, D))
    assert a.engine == "vllm" and len(a.baseline) == 7 and len(a.recent) == 3 and a.error is None
    first = json.loads((DATA / "query_range_accepted.json").read_text())["data"]["result"]
    both_cores = sum(float(s["values"][0][1]) for s in first if s["metric"]["instance"] == A
                     and s["metric"]["model_name"] == MODEL)
    assert a.baseline[0].counters.accepted == pytest.approx(both_cores)  # the other model's series left out
    assert a.baseline[0].end == "2026-09-05T13:00:00+00:00" and a.baseline[0].start == "2026-09-05T12:00:00+00:00"
    assert len(a.baseline[0].counters.accepted_per_pos) == 4
    assert b.recent[-1].counters.acceptance < 0.6 < b.baseline[0].counters.acceptance
    assert c.engine == "sglang" and all(w.counters.gauge and w.counters.draft_tokens == 1 for w in c.baseline)
    assert len(c.baseline) + len(c.recent) == 9  # the idle hour (its verify counter did not move) is not a window
    assert d.error == 'Prometheus: up{instance="10.0.0.8:8000"} is 0 (its last scrape failed)'
    assert "first reading from Prometheus" in a.notes[0]


def test_the_replica_on_an_updated_target_is_drift_and_named_and_the_others_are_not(tmp_path):
    reading = read_fleet(config(tmp_path), "1", get=Recorded(), now=NOW)
    verdict, replicas = fleet_verdict(reading)
    assert reading.source == "prometheus" and verdict == "DRIFT"
    assert replicas == {A: "OK", B: "DRIFT", C: "collecting", D: "unreachable"}
    b = next(r for r in reading.replicas if r.name == B)
    assert b.test.alarm and b.test.level == pytest.approx(0.05 / 3)  # A and B tested, and their summed windows
    assert b.outlier.named and b.outlier.rest_acceptance > b.outlier.acceptance + 0.05
    assert [o.replica for o in reading.outliers()] == [B]
    assert reading.test is b.test and reading.pooled is not None
    decision = with_fleet(Decision(Status.DRIFT, None, ["server windows: ..."]), reading)
    assert decision.reasons[-1] == f"DRIFT on replica {B}, not on {A}, {C}"
    assert any(n.startswith(f"replica {D} unreachable") for n in decision.notes)  # one down: a note
    assert any(n.startswith(f"replica {B} parts from the others") for n in decision.notes)
    assert f"replica {B} (vllm): DRIFT" in reading.summary()


def test_engine_cores_are_read_one_by_one_or_summed(tmp_path):
    cores = fleet_windows(config(tmp_path, [{"replica": A, "model": MODEL, "per_core": True}]), "1", Recorded(),
                          now=NOW)
    assert list(cores) == [f"{A}/engine=0", f"{A}/engine=1"]
    assert len(cores[f"{A}/engine=0"].baseline) + len(cores[f"{A}/engine=0"].recent) == 9  # its missing point
    summed = fleet_windows(config(tmp_path / "summed", [{"replica": A, "model": MODEL}]), "1", Recorded(), now=NOW)
    one = cores[f"{A}/engine=0"].baseline[0].counters.accepted + cores[f"{A}/engine=1"].baseline[0].counters.accepted
    assert summed[A].baseline[0].counters.accepted == pytest.approx(one)


def test_without_a_list_every_replica_prometheus_holds_is_read(tmp_path):
    windows = fleet_windows(config(tmp_path, []), "1", Recorded(), now=NOW)
    assert sorted(windows) == [A, B, C]  # not Prometheus' own target, not a target without these series


def test_a_new_champion_owns_the_windows_after_the_next_boundary_and_a_rollback_keeps_its_baseline(tmp_path):
    cfg = config(tmp_path)
    fleet_windows(cfg, "1", Recorded(), now=NOW)
    promoted = fleet_windows(cfg, "2", Recorded(), now=NOW)
    assert promoted[A].baseline == [] and promoted[A].recent == []
    state = json.loads(state_path(cfg).read_text())
    assert state["champion"] == "2" and state["versions"]["2"]["since"] == END + 3600
    back = fleet_windows(cfg, "1", Recorded(), now=NOW + 3600)
    assert len(back[A].baseline) == 7 and back[A].recent == []  # recent windows start afresh after the rollback
    assert json.loads(state_path(cfg).read_text())["versions"]["1"]["resumed"] == END + 2 * 3600


def test_an_error_answer_or_no_prometheus_is_one_line_and_the_fleet_an_error(tmp_path):
    reading = read_fleet(config(tmp_path), "1", get=Recorded(error=True), now=NOW)
    assert reading.verdict == "ERROR"
    assert reading.error == ('Prometheus answered bad_data: invalid parameter "query": 1:23: parse error: unexpected '
                             '"=" in label matching, expected string')
    assert with_fleet(Decision(Status.OK, None), reading).status is Status.ERROR
    with pytest.raises(PrometheusError, match="Prometheus unreachable at http://127.0.0.1:9"):
        api_get("http://127.0.0.1:9/api/v1/query?query=up", 2)


class Api(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        bad = "bad" in self.path
        body = (DATA / ("error_bad_data.json" if bad else "query_up.json")).read_bytes()
        self.send_response(400 if bad else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_api_get_reads_an_answer_and_an_http_error_with_its_message():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_port}"
        assert api_get(f"{base}/api/v1/query?query=up", 5)["data"]["resultType"] == "vector"
        with pytest.raises(PrometheusError, match=r"HTTP 400: bad_data: invalid parameter"):
            api_get(f"{base}/api/v1/query?query=bad", 5)
    finally:
        httpd.shutdown()
        httpd.server_close()
