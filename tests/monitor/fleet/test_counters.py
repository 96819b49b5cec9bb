"""Live acceptance from a serving engine's Prometheus endpoint: parsing vLLM's and llama.cpp's texts, windows between
scrapes (restarts, champion changes), the window test and its simulated false-alarm rate, a real HTTP scrape and
`draftops monitor check` reading a local server.

data/vllm_metrics.txt is vLLM's /metrics as prometheus_client prints it (HELP/TYPE lines, `_created` gauges, sorted
labels); its speculative-decoding values are those of a live vLLM scrape. data/llamacpp_metrics.txt is what
llama-server's `to_metrics()` prints.
"""
import http.server
import json
import re
import threading
from pathlib import Path

import mlflow
import pytest
import yaml
from mlflow import MlflowClient

from monitor.check.decision import Cause, Decision, Status, decide
from monitor.check.engine_acceptance import EngineCheck, read_windows, with_engine
from monitor.check.run import run_check
from monitor.fleet.counters import (
    ImpossibleCounters,
    ServerMetricsError,
    SpecCounters,
    parse_per_core,
    parse_spec_counters,
    scrape,
    window_between,
)
from monitor.fleet.verdicts import read_fleet
from monitor.fleet.window_store import load_store, record, replica_state, store_path
from monitor.stats.acceptance_tests import window_drop_test
from monitor.stats.window_simulation import simulate_window_checks
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import load_config
from pipeline.sources import save_checkpoint
from tests.conftest import make_tiny_model, make_tokenizer
from tests.monitor.check.test_prompt_acceptance import write_word_traffic
from tests.monitor.check.test_run import NAME, check_world

DATA = Path(__file__).parent.parent / "data"
VLLM = (DATA / "vllm_metrics.txt").read_text()
LLAMACPP = (DATA / "llamacpp_metrics.txt").read_text()
RECORDED = SpecCounters("vllm", 2739.0, 13695.0, 6425.0, (2048.0, 1588.0, 1235.0, 903.0, 651.0))


def vllm_text(c: SpecCounters) -> str:
    """The recorded vLLM text with other speculative-decoding counter values (every other line as recorded)."""
    values = {"spec_decode_num_drafts_total": c.drafts, "spec_decode_num_draft_tokens_total": c.draft_tokens,
              "spec_decode_num_accepted_tokens_total": c.accepted}

    def value(match):
        name, labels = match.group(1), match.group(2)
        if name == "spec_decode_num_accepted_tokens_per_pos_total":
            position = int(re.search(r'position="(\d+)"', labels)[1])
            return f"vllm:{name}{labels} {c.accepted_per_pos[position]}"
        return f"vllm:{name}{labels} {values[name]}"

    return re.sub(r"^vllm:(spec_decode_\w+_total)(\{[^}]*\}) \S+$", value, VLLM, flags=re.M)


def plus(c: SpecCounters, drafts, draft_tokens, accepted, per_pos) -> SpecCounters:
    return SpecCounters(c.engine, c.drafts + drafts, c.draft_tokens + draft_tokens, c.accepted + accepted,
                        tuple(a + b for a, b in zip(c.accepted_per_pos, per_pos)))


def test_recorded_vllm_text_gives_the_counts_by_hand():
    counters = parse_spec_counters(VLLM)
    assert counters == RECORDED  # not a `_created` timestamp nor the per-position series in the totals
    assert counters.acceptance == pytest.approx(6425 / 13695)
    assert counters.position_acceptance() == pytest.approx([2048 / 2739, 1588 / 2739, 1235 / 2739, 903 / 2739,
                                                            651 / 2739])
    assert sum(counters.accepted_per_pos) == counters.accepted  # vLLM counts a draft at every position it kept


def test_llamacpp_text():
    counters = parse_spec_counters(LLAMACPP)
    assert counters == SpecCounters("llamacpp", 552.0, 2160.0, 2105.0, (548.0, 540.0, 525.0, 492.0))
    no_positions = "\n".join(line for line in LLAMACPP.splitlines() if "per_pos" not in line)
    assert parse_spec_counters(no_positions).accepted_per_pos == ()  # absent before the first speculative request


def with_second_engine(text: str, model: str) -> str:
    """A data-parallel server: every speculative-decoding sample again for engine 1, serving `model`, with half the
    counts."""
    def twice(match):
        line = match.group(0)
        name_labels, value = line.rsplit(" ", 1)
        other = name_labels.replace('engine="0"', 'engine="1"').replace("deepseek-v4-flash", model)
        return f"{line}\n{other} {float(value) / 2 if '_total' in name_labels else value}"

    return re.sub(r"^vllm:spec_decode_.*$", twice, text, flags=re.M)


def test_label_sets_are_summed_or_filtered_by_model_name():
    text = with_second_engine(VLLM, "other-model")
    both = parse_spec_counters(text)
    assert (both.drafts, both.draft_tokens, both.accepted) == (2739 * 1.5, 13695 * 1.5, 6425 * 1.5)
    assert both.accepted_per_pos == (3072.0, 2382.0, 1852.5, 1354.5, 976.5)
    assert parse_spec_counters(text, "deepseek-v4-flash") == RECORDED
    assert parse_spec_counters(text, "other-model").accepted == 3212.5
    with pytest.raises(ServerMetricsError, match="model names seen: deepseek-v4-flash, other-model"):
        parse_spec_counters(text, "missing")
    with pytest.raises(ServerMetricsError, match="no model_name label"):
        parse_spec_counters(LLAMACPP, "deepseek-v4-flash")


def test_data_parallel_label_sets_are_read_per_engine_core_or_summed():
    text = with_second_engine(VLLM, "deepseek-v4-flash")
    cores = parse_per_core(text)
    assert list(cores) == ["0", "1"] and cores["0"] == RECORDED
    assert cores["1"] == SpecCounters("vllm", 2739 / 2, 13695 / 2, 6425 / 2, (1024.0, 794.0, 617.5, 451.5, 325.5))
    assert parse_spec_counters(text).accepted == 6425 * 1.5
    assert list(parse_per_core(LLAMACPP)) == [""]
    with pytest.raises(ServerMetricsError, match="with prefix llamacpp"):
        parse_spec_counters(VLLM, kind="llamacpp")


def test_texts_without_counters_say_what_they_hold():
    no_spec = "\n".join(line for line in VLLM.splitlines() if "spec_decode" not in line) + "\n"
    with pytest.raises(ServerMetricsError, match=r"exports vllm metrics \(15 families, e\.g\. "
                                                 r"vllm:num_requests_running.*--speculative-config"):
        parse_spec_counters(no_spec)
    with pytest.raises(ServerMetricsError, match="not a Prometheus text exposition"):
        parse_spec_counters("<html>Not Found</html>")
    mixed = VLLM + LLAMACPP
    with pytest.raises(ServerMetricsError, match="several engines"):
        parse_spec_counters(mixed)


def test_a_counter_that_went_down_is_a_restart_and_the_window_is_the_new_counters():
    later = plus(RECORDED, 100, 500, 300, (90, 80, 60, 40, 30))
    assert window_between(RECORDED, later) == (SpecCounters("vllm", 100, 500, 300, (90, 80, 60, 40, 30)), False)
    restarted = SpecCounters("vllm", 40, 200, 90, (30, 25, 18, 10, 7))
    assert window_between(later, restarted) == (restarted, True)
    assert window_between(None, RECORDED) == (None, False)


def test_counters_that_cannot_be_true_are_an_error():
    with pytest.raises(ImpossibleCounters, match=r"the engine's counters cannot be true: 136950 accepted tokens of "
                                                  r"13695 drafted$"):
        parse_spec_counters(vllm_text(SpecCounters("vllm", 2739, 13695, 136950, RECORDED.accepted_per_pos)))
    with pytest.raises(ImpossibleCounters, match="cannot be true: drafts -5"):
        parse_spec_counters(LLAMACPP.replace("llamacpp:spec_decode_num_drafts_total 552",
                                             "llamacpp:spec_decode_num_drafts_total -5"))
    # each scrape possible, the window between them not: 300 more accepted tokens over 100 more drafted
    with pytest.raises(ImpossibleCounters, match="over a window cannot be true: 300 accepted tokens of 100 drafted"):
        window_between(RECORDED, plus(RECORDED, 20, 100, 300, (0, 0, 0, 0, 0)))
    # llama.cpp's six significant digits: a window of rounded counters may overshoot by the rounding, not more
    rounded = SpecCounters("llamacpp", 1e5, 1.23457e6, 1.23456e6)
    window, _ = window_between(rounded, SpecCounters("llamacpp", 1e5 + 10, 1.23458e6, 1.23458e6))
    assert (window.draft_tokens, window.accepted) == pytest.approx((10, 20))


def test_impossible_engine_counters_never_confirm_a_deployment(cfg):
    config = cfg(**{"deploy.check_windows": 2})
    scrapes = iter([RECORDED, plus(RECORDED, 100, 500, 300, (0,) * 5), plus(RECORDED, 200, 1000, 6000, (0,) * 5)])
    check = EngineCheck(config.monitor.server_metrics_url, "1", post_deploy=True)
    read_windows(config, check, wait=lambda seconds: None, fetch=lambda url, timeout: vllm_text(next(scrapes)))
    assert check.impossible and check.error.startswith("the engine's counters over a window cannot be true")
    assert check.test is None and not check.mismatch
    decision = with_engine(Decision(Status.OK, None, [], ["a note"]), check)
    assert decision.status is Status.ERROR and decision.exit_code == 2
    assert decision.reasons == [f"engine check: {check.error}"]


def test_impossible_server_counters_are_not_recorded(cfg):
    config = cfg()
    text = vllm_text(SpecCounters("vllm", 2739, 13695, 136950, RECORDED.accepted_per_pos))
    reading = read_fleet(config, "1", fetch=lambda url, timeout: text)
    (replica,) = reading.replicas
    assert "cannot be true" in replica.error and reading.window is None


@pytest.fixture
def cfg(tmp_path):
    def make(**monitor):
        return load_config(None, [f"monitor.state_dir={tmp_path / 'state'}", "monitor.scrape_interval_minutes=0",
                                  "monitor.server_metrics_url=http://serving.invalid/metrics",
                                  *(f"monitor.{k}={v}" for k, v in monitor.items())])
    return make


def test_three_scrapes_make_two_windows_in_the_state_file(cfg):
    config = cfg()
    second = plus(RECORDED, 120, 600, 330, (100, 85, 70, 45, 30))
    third = plus(second, 80, 400, 150, (60, 40, 25, 15, 10))
    texts = iter([vllm_text(RECORDED), vllm_text(second), vllm_text(third)])

    def fetch(url, timeout):
        return next(texts)

    first = read_fleet(config, "1", fetch=fetch)
    assert first.source == "scrape" and first.window is None and first.error is None
    assert "first reading" in first.replicas[0].notes[0] and first.replicas[0].name == "serving.invalid"
    one, two = read_fleet(config, "1", fetch=fetch), read_fleet(config, "1", fetch=fetch)
    assert one.window.counters == SpecCounters("vllm", 120, 600, 330, (100, 85, 70, 45, 30))
    assert one.window.counters.acceptance == 0.55
    assert two.window.counters == SpecCounters("vllm", 80, 400, 150, (60, 40, 25, 15, 10))
    assert two.window.counters.position_acceptance() == [0.75, 0.5, 0.3125, 0.1875, 0.125]
    assert two.window.start == one.window.end
    state = json.loads(store_path(config).read_text())["replicas"]["serving.invalid"]
    assert [w["counters"]["accepted"] for w in state["versions"]["1"]["baseline"]] == [330, 150]
    assert state["last"]["reading"]["accepted"] == third.accepted
    replica = two.replicas[0]
    assert two.test is None and replica.n_baseline_windows == 2 and replica.verdict == "collecting"
    assert "2 of 24 baseline" in replica.notes[-1]
    # another server (or model) keeps the baseline its windows are judged against, and reads its counters afresh
    store = load_store(store_path(config))
    moved = replica_state(store, "serving.invalid", {"url": "http://other/metrics"})
    assert len(moved["versions"]["1"]["baseline"]) == 2 and moved["last"] is None


def closing(state: dict, counters: SpecCounters, version: str, at: str, n_baseline: int = 2, n_recent: int = 2):
    """`record` one scrape of counters, with the window it closes."""
    last = state["last"]
    window, restarted = window_between(SpecCounters.from_dict(last["reading"]) if last else None, counters)
    return record(state, counters.to_dict(), window, restarted, version, at, n_baseline, n_recent)


def test_a_window_spanning_a_change_of_champion_is_not_kept_and_a_rollback_keeps_the_baseline():
    state = {"source": {}, "last": None, "versions": {}}
    c = RECORDED
    for version, step in (("1", 0), ("1", 1), ("1", 2), ("1", 3), ("2", 4), ("2", 5), ("1", 6), ("1", 7)):
        c = plus(c, 10, 50, 20 + step, (10, 5, 3, 1, 1))
        window, notes = closing(state, c, version, f"t{step}")
        if step in (4, 6):
            assert "spans a change of champion" in notes[0]
    v1, v2 = state["versions"]["1"], state["versions"]["2"]
    assert [w["counters"]["accepted"] for w in v1["baseline"]] == [21, 22]
    assert [w["counters"]["accepted"] for w in v1["recent"]] == [27]  # 23 was before the rollback: dropped
    assert [w["counters"]["accepted"] for w in v2["baseline"]] == [25]
    idle, notes = closing(state, c, "1", "t8")
    assert idle.counters.draft_tokens == 0 and "idle" in notes[0]
    assert len(state["versions"]["1"]["recent"]) == 1


def test_window_test_sees_a_drop_and_not_its_absence():
    base_acc, base_n = [3250, 3180, 3320, 3205, 3290, 3150, 3260], [5000, 4900, 5100, 4950, 5050, 4800, 5000]
    same = window_drop_test(base_acc, base_n, [3240, 3190, 3300], [5000, 4950, 5080], margin=0.01, level=0.05)
    assert not same.alarm and same.method == "window_permutation"
    assert same.n_baseline_prompts == 7 and same.n_current_prompts == 3
    assert same.drop == pytest.approx(sum(base_acc) / sum(base_n) - 9730 / 15030)
    dropped = window_drop_test(base_acc, base_n, [2900, 2880, 2950], [5000, 4950, 5080], margin=0.01, level=0.05)
    assert dropped.alarm and dropped.p_value == pytest.approx(1 / 120)  # the observed split is the most extreme
    assert dropped.ci_low > 0.01 and dropped.drop == pytest.approx(sum(base_acc) / sum(base_n) - 8730 / 15030)
    with pytest.raises(ValueError, match="at least 2 baseline and 2 current windows"):
        window_drop_test([1, 2], [5, 5], [1], [5])


def test_simulated_false_alarm_rate_is_close_to_the_level():
    result = simulate_window_checks(7, 3, level=0.1, margin=0.0, drops=(0.10,), n_checks=300, seed=1)
    low, high = result.false_alarm_ci
    assert low <= 0.1 <= high and 0.05 <= result.false_alarm_rate <= 0.15
    assert result.power[0.10] > 0.9
    recorded = [(3250, 5000), (3180, 4900), (3320, 5100), (3205, 4950), (3290, 5050), (3150, 4800)]
    assert simulate_window_checks(7, 3, 0.1, 0.0, drops=(), n_checks=20, windows=recorded).source == "windows"


def test_the_decision_names_a_drop_only_the_server_saw():
    server = window_drop_test([3250, 3180, 3320, 3205], [5000] * 4, [2900, 2880, 2950, 2920], [5000] * 4,
                              margin=0.01, level=0.05)
    common = dict(current_target_fingerprint="fp-A", acceptance=None, drift=None, current_acceptance=0.6,
                  break_even=0.4, server=server)
    alone = decide(champion_target_fingerprint="fp-A", **common)
    assert alone.status is Status.DRIFT and alone.cause is Cause.SERVER_ACCEPTANCE_DROPPED
    assert alone.reasons[0].startswith("server windows (4 recent vs 4 baseline)")
    with_target = decide(champion_target_fingerprint="fp-old", **common)
    assert with_target.cause is Cause.TARGET_CHANGED


class MetricsHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path != "/metrics":
            self.send_error(404)
            return
        body = self.server.body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    """A metrics endpoint on 127.0.0.1 answering `server.body`."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), MetricsHandler)
    httpd.body = VLLM
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def test_http_scrape_of_a_local_server(server):
    url = f"http://127.0.0.1:{server.server_port}"
    assert scrape(f"{url}/metrics") == VLLM
    assert parse_spec_counters(scrape(f"{url}/metrics")) == RECORDED
    with pytest.raises(ServerMetricsError, match="HTTP 404"):
        scrape(f"{url}/nothing")
    server.shutdown()
    server.server_close()
    with pytest.raises(ServerMetricsError, match="server unreachable"):
        scrape(f"{url}/metrics", timeout=2)


@pytest.fixture
def fake_check(tmp_path, mlflow_uri):
    """The check with fake models (tests/monitor/check/test_run.py) and a server source."""
    cfg, world, _ = check_world(tmp_path, mlflow_uri, server_metrics_url="http://serving.invalid/metrics",
                                server_baseline_windows=4, server_recent_windows=4, scrape_interval_minutes=0)
    return cfg, world


def test_a_server_drop_is_a_drift_the_offline_check_does_not_see(fake_check, monkeypatch):
    cfg, world = fake_check
    monkeypatch.setattr("monitor.fleet.window_store.scrape", lambda url, timeout: vllm_text(RECORDED))
    run_check(cfg, load=world.load, measure=world.measure)  # the offline baseline and the first scrape
    store = load_store(store_path(cfg))
    state = store["replicas"]["serving.invalid"]
    c = RECORDED
    for step, accepted in enumerate([3250, 3180, 3320, 3205, 2900, 2880, 2950]):
        c = plus(c, 1000, 5000, accepted, (900, 800, 700, 500, 300))
        closing(state, c, "1", f"2026-10-0{step + 1}", 4, 4)
    store_path(cfg).write_text(json.dumps(store))
    last = plus(c, 1000, 5000, 2600, (800, 700, 600, 300, 200))
    monkeypatch.setattr("monitor.fleet.window_store.scrape", lambda url, timeout: vllm_text(last))
    report = run_check(cfg, load=world.load, measure=world.measure)
    assert report.decision.status is Status.DRIFT and report.decision.cause is Cause.SERVER_ACCEPTANCE_DROPPED
    assert not report.acceptance.alarm  # the offline measurement saw nothing
    assert report.server.test.current_acceptance == pytest.approx((2900 + 2880 + 2950 + 2600) / 20000)
    assert report.server.test.p_value == pytest.approx(1 / 70)  # C(8, 4) splits, the observed one the most extreme
    assert report.decision.reasons[-1] == "DRIFT on replica serving.invalid"
    run = MlflowClient().get_run(report.run_id)
    assert run.data.tags[M.MONITOR_CAUSE_TAG] == "server_acceptance_dropped"
    assert run.data.metrics["acceptance/server"] == pytest.approx(0.52)
    assert run.data.metrics["acceptance/server_pos_1"] == pytest.approx(0.8)
    assert run.data.metrics["monitor/server/p_value"] == pytest.approx(report.server.test.p_value)
    assert run.data.metrics["monitor/server/windows"] == 4
    assert run.data.metrics["monitor/replica/serving.invalid/p_value"] == pytest.approx(report.server.test.p_value)
    assert "monitor/drop" in run.data.metrics and "monitor/server/drop" in run.data.metrics

    def unreachable(url, timeout):
        raise ServerMetricsError(f"{url}: server unreachable: [Errno 111] Connection refused")

    monkeypatch.setattr("monitor.fleet.window_store.scrape", unreachable)
    report = run_check(cfg, load=world.load, measure=world.measure)  # the offline check still runs
    assert report.decision.status is Status.ERROR and report.server.error is None  # its one replica down: ERROR
    assert report.server.replicas[0].verdict == "unreachable"
    assert report.decision.reasons == ["no serving replica could be read (serving.invalid: "
                                       "http://serving.invalid/metrics: server unreachable: [Errno 111] Connection "
                                       "refused)"]


def test_draftops_monitor_check_reads_a_local_vllm_server(tmp_path, mlflow_uri, server, capsys):
    from pipeline.cli import main

    tokenizer = make_tokenizer()
    target = save_checkpoint(make_tiny_model(len(tokenizer), seed=0), tokenizer, tmp_path / "target")
    traffic = write_word_traffic(tmp_path / "traffic.jsonl", 40)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({
        "target": str(target), "device": "cpu",
        "traffic": {"path": str(traffic), "heldout_fraction": 0.5},
        "tracking": {"uri": mlflow_uri, "system_metrics": False},
        "decode": {"max_new_tokens": 6, "gamma": 3},
        "distill": {"generation_batch_size": 16},
        "monitor": {"heldout_requests": 8, "state_dir": str(tmp_path / "state"), "n_bootstrap": 200,
                    "break_even_alpha": 0.0, "scrape_interval_minutes": 0,
                    "server_metrics_url": f"http://127.0.0.1:{server.server_port}/metrics"}}))
    mlflow.set_experiment("draftops-distill")
    with mlflow.start_run():
        registry.register(target, NAME, tags={M.TARGET_FINGERPRINT_TAG: "any"}, description="test draft")

    assert main(["monitor", "check", "--config", str(cfg_path), "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["server"]["window"] is None and first["server"]["error"] is None
    server.body = vllm_text(plus(RECORDED, 200, 1000, 700, (180, 150, 120, 90, 60)))
    assert main(["monitor", "check", "--config", str(cfg_path), "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["server"]["acceptance"] == 0.7
    assert second["server"]["window"]["counters"] == {"engine": "vllm", "drafts": 200.0, "draft_tokens": 1000.0,
                                                      "accepted": 700.0, "accepted_per_pos": [180, 150, 120, 90, 60]}
    metrics = MlflowClient().get_run(second["run_id"]).data.metrics
    assert metrics["acceptance/server"] == 0.7
    assert [metrics[f"acceptance/server_pos_{i}"] for i in range(1, 6)] == [0.9, 0.75, 0.6, 0.45, 0.3]
    assert metrics["monitor/server/draft_tokens"] == 1000
    assert "monitor/server/p_value" not in metrics  # 1 of 24 baseline windows: no test yet
