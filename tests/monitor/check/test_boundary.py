"""The boundary watch: a replica running more requests at once than the concurrency where the engine sweep found that
speculation stops paying is a note in the report and a gauge on the service's /metrics, never a DRIFT; the engines'
running-requests gauges and tokens per second as parsed."""
import json

from prometheus_client import generate_latest

from monitor.check.boundary import watch
from monitor.check.decision import Decision, Status
from monitor.check.outcome import CheckReport
from monitor.fleet.load import EngineLoad, parse_load, prometheus_load
from monitor.fleet.verdicts import FleetReading
from monitor.service.exporter import ServiceMetrics, report_figures
from pipeline.config import load_config

VLLM = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m",engine="0"} 3.0
vllm:num_requests_running{model_name="m",engine="1"} 4.0
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_sum{model_name="m"} 2.0
vllm:time_per_output_token_seconds_count{model_name="m"} 100.0
"""
LLAMACPP = """# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 41.5
"""
SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 12.0
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{model_name="m"} 880.0
"""


def test_each_engines_running_requests_and_tokens_per_second():
    assert parse_load(VLLM) == EngineLoad(7.0, 50.0)
    assert parse_load(LLAMACPP) == EngineLoad(2.0, 41.5)
    assert parse_load(SGLANG, "m") == EngineLoad(12.0, 880.0)
    assert parse_load("# TYPE x gauge\nx 1\n") == EngineLoad(None, None)


def test_from_prometheus_a_window_mean_per_replica(tmp_path):
    cfg = load_config(None, ["monitor.prometheus_url=http://prometheus:9090", "monitor.prometheus_replica_label=pod",
                             f"monitor.state_dir={tmp_path}"])
    asked = []

    def get(url, timeout):
        asked.append(url)
        n = len(asked)
        result = {1: [{"metric": {"pod": "a"}, "value": [0, "6.5"]}, {"metric": {"pod": "b"}, "value": [0, "1"]}],
                  2: [{"metric": {"pod": "b"}, "value": [0, "30"]}],
                  3: [{"metric": {"pod": "a"}, "value": [0, "0.02"]}]}
        return {"status": "success", "data": {"resultType": "vector", "result": result[n]}}

    assert prometheus_load(cfg, 1000.0, get) == {"a": EngineLoad(6.5, 50.0), "b": EngineLoad(1.0, 30.0)}
    assert "avg_over_time" in asked[0] and "requests_processing" in asked[0] and "%5B1h%5D" in asked[0]


def report(tmp_path, boundary):
    (tmp_path / "engine_sweep.json").write_text(json.dumps({"boundary_concurrency": boundary}))
    cfg = load_config(None, [f"monitor.engine_boundary={tmp_path / 'engine_sweep.json'}"])
    r = CheckReport(Decision(Status.OK, None), "draft", "1", "fp", "fp", server=FleetReading("prometheus"))
    loads = {"a": EngineLoad(6.5, 40.0), "b": EngineLoad(2.0, 80.0), "c": EngineLoad(None, 10.0)}
    watch(cfg, r, (loads, None))
    return r


def test_a_window_past_the_boundary_is_a_note_and_a_gauge_never_a_drift(tmp_path):
    r = report(tmp_path, 4)
    assert r.decision.status is Status.OK and r.exit_code == 0
    assert r.load == {"a": [6.5, True], "b": [2.0, False]}
    assert len(r.decision.notes) == 1 and r.decision.notes[0].startswith(
        "replica a: 6.5 requests running at once over its window, past concurrency 4")
    assert "note: replica a: 6.5" in r.summary()
    metrics = ServiceMetrics("draft")
    metrics.record_check(r, 0, 1.0, ended=10.0)
    page = generate_latest(metrics.registry).decode()
    assert 'draftops_monitor_replica_past_boundary{model="draft",replica="a"} 1.0' in page
    assert 'draftops_monitor_replica_past_boundary{model="draft",replica="b"} 0.0' in page
    assert 'draftops_monitor_replica_running_requests{model="draft",replica="a"} 6.5' in page
    assert report_figures(r, 1.0, 10.0)["load"] == {"a": [6.5, True], "b": [2.0, False]}
    metrics.record_check(report(tmp_path, None), 0, 1.0, ended=11.0)  # paid everywhere: never past it
    page = generate_latest(metrics.registry).decode()
    assert 'replica_past_boundary{model="draft",replica="a"} 0.0' in page


def test_a_result_file_that_is_not_a_sweeps_is_a_note(tmp_path):
    cfg = load_config(None, [f"monitor.engine_boundary={tmp_path / 'missing.json'}"])
    r = CheckReport(Decision(Status.OK, None), "draft", "1", "fp", "fp", server=FleetReading("store"))
    watch(cfg, r, ({}, None))
    assert r.decision.status is Status.OK and "not an engine sweep's result" in r.decision.notes[0]
