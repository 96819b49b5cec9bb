"""What an on-call team relies on, against recorded Prometheus answers (tests/monitor/data/prometheus, read by the
range a query asks for): a change of the Prometheus source during an ongoing drop keeps the stored baseline and the
DRIFT, never a silent re-baseline; the `up` query built with and without a selector; a replica whose `up` is 0
pages (REPLICA_DOWN, DraftReplicaDown) once it was unreachable at the configured number of checks."""
import json
import urllib.parse

from monitor.check.decision import EXIT_REPLICA_DOWN, Decision, Status, with_fleet
from monitor.check.outcome import CheckReport
from monitor.fleet.prometheus import rebaseline, state_path
from monitor.fleet.verdicts import read_fleet
from monitor.service.alerts import report_alerts
from tests.monitor.fleet.test_prometheus import END, NOW, A, B, C, D, Recorded, config

HOUR = 3600
CLOSED = "http://127.0.0.1:9"


class InRange(Recorded):
    """The recorded answers cut to the range each query asks for, as Prometheus would answer them."""

    def __call__(self, url: str, timeout: float) -> dict:
        answer = super().__call__(url, timeout)
        params = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
        if "start" in params:
            start, end = float(params["start"][0]), float(params["end"][0])
            for series in answer["data"]["result"]:
                series["values"] = [v for v in series["values"] if start <= float(v[0]) <= end]
        return answer


def replicas(reading) -> dict[str, str]:
    return {r.name: r.verdict for r in reading.replicas}


def test_a_source_change_during_a_drop_keeps_the_baseline_and_the_drift(tmp_path):
    cfg = config(tmp_path)
    before = read_fleet(cfg, "1", get=InRange(), now=NOW)
    assert replicas(before)[B] == "DRIFT"
    # Prometheus moved to a closed port for two checks, then back: the checks in between are errors
    for hours in (1, 2):
        moved = read_fleet(config(tmp_path, prometheus_url=CLOSED), "1", get=Recorded(error=True),
                           now=NOW + hours * HOUR)
        assert moved.verdict == "ERROR"
    # back three hours later: a fresh first reading would take the dropped windows as B's baseline (collecting, OK);
    # the stored baseline judges them instead
    after = read_fleet(cfg, "1", get=InRange(), now=NOW + 3 * HOUR)
    assert replicas(after)[B] == "DRIFT" and after.verdict == "DRIFT"
    b = next(r for r in after.replicas if r.name == B)
    assert b.n_baseline_windows == 7 and b.test.baseline_acceptance > 0.6 > b.test.current_acceptance
    assert any("Prometheus source changed" in n and "stored baselines are kept" in n for n in b.notes)
    assert not any("first reading" in n for n in b.notes)
    state = json.loads(state_path(cfg).read_text())
    assert state["source"]["url"] == cfg.monitor.prometheus_url
    assert len(state["versions"]["1"]["baselines"][B]) == 7
    assert state["versions"]["1"]["baselines"][B][-1]["end"] == "2026-09-05T19:00:00+00:00"  # before the drop


def test_the_stored_baseline_outlives_windows_that_left_the_queried_range(tmp_path):
    cfg = config(tmp_path, prometheus_window="1h")
    read_fleet(cfg, "1", get=InRange(), now=NOW)
    later = read_fleet(config(tmp_path, prometheus_selector='job="vllm"'), "1", get=InRange(), now=NOW + 3 * HOUR)
    assert replicas(later)[B] == "DRIFT"  # a new selector is a source change too: same baseline, same verdict


def test_only_an_explicit_rebaseline_starts_a_baseline_afresh(tmp_path):
    cfg = config(tmp_path)
    read_fleet(cfg, "1", get=InRange(), now=NOW - 3 * HOUR)
    boundary = rebaseline(cfg, "1", now=NOW - 3 * HOUR)
    assert boundary == END - 2 * HOUR
    fresh = read_fleet(cfg, "1", get=InRange(), now=NOW)
    b = next(r for r in fresh.replicas if r.name == B)
    assert b.verdict == "collecting" and b.n_baseline_windows == 2  # the windows after the boundary alone
    assert json.loads(state_path(cfg).read_text())["versions"]["1"]["baselines"] == {}


def up_queries(prometheus: Recorded) -> list[str]:
    asked = [urllib.parse.parse_qs(urllib.parse.urlsplit(u).query)["query"][0] for u in prometheus.asked
             if "/api/v1/query?" in u]
    return [q for q in asked if not q.startswith("count by")]


def pages_after_two_checks(cfg) -> Recorded:
    prometheus = InRange()
    first = read_fleet(cfg, "1", get=prometheus, now=NOW)
    assert replicas(first)[D] == "unreachable" and first.down == []
    assert with_fleet(Decision(Status.OK, None), first).status is Status.OK
    second = read_fleet(cfg, "1", get=prometheus, now=NOW + 600)
    assert second.down == [D] and next(r for r in second.replicas if r.name == D).down_checks == 2
    decision = with_fleet(Decision(Status.OK, None), second)
    assert decision.status is Status.REPLICA_DOWN and decision.exit_code == EXIT_REPLICA_DOWN == 6
    assert decision.reasons == [f"replica down: {D} unreachable at 2 checks in a row"]
    drift = with_fleet(Decision(Status.DRIFT, None, ["server windows: ..."]), second)
    assert drift.status is Status.DRIFT and drift.reasons[-1].startswith("replica down")
    report = CheckReport(decision, "draft", "1", "fp", "fp", server=second)
    down = [a for a in report_alerts(report) if a.name == "DraftReplicaDown"]
    assert [a.labels["replica"] for a in down] == [D] and down[0].severity == "critical"
    assert "up{instance=\"10.0.0.8:8000\"} is 0" in down[0].description
    return prometheus


def test_a_dead_replica_pages_after_the_configured_checks_with_a_selector(tmp_path):
    prometheus = pages_after_two_checks(config(tmp_path))
    assert set(up_queries(prometheus)) == {'up{job=~"vllm|sglang"}'}


def test_a_dead_replica_pages_after_the_configured_checks_without_a_selector(tmp_path):
    prometheus = pages_after_two_checks(config(tmp_path, prometheus_selector='""'))
    assert set(up_queries(prometheus)) == {"up"}


def test_a_replica_back_up_starts_its_count_again(tmp_path):
    cfg = config(tmp_path, replica_down_checks=1)
    assert read_fleet(cfg, "1", get=InRange(), now=NOW).down == [D]
    back = read_fleet(config(tmp_path, [{"replica": B}], replica_down_checks=1), "1",
                      get=InRange(), now=NOW + 600)
    assert back.down == [] and json.loads((tmp_path / "replicas_down.json").read_text()) == {}


class NoWindowYet(Recorded):
    """A Prometheus that began scraping within the last window: counters and `up` now, no window closed yet."""

    def __call__(self, url: str, timeout: float) -> dict:
        if "/api/v1/query_range" in url:
            self.asked.append(url)
            return {"status": "success", "data": {"resultType": "matrix", "result": []}}
        return super().__call__(url, timeout)


def test_up_and_the_counters_present_are_read_at_the_check_not_at_the_last_window_end(tmp_path):
    """A replica that stopped after the last window boundary is down at this check, not an hour later; one whose
    counters Prometheus holds but whose first window has not closed yet is collecting, not unreachable."""
    prometheus = NoWindowYet()
    reading = read_fleet(config(tmp_path), "1", get=prometheus, now=NOW)
    instants = [urllib.parse.parse_qs(urllib.parse.urlsplit(u).query) for u in prometheus.asked
                if "/api/v1/query?" in u]
    assert instants and {q["time"][0] for q in instants} == {str(NOW)}
    assert replicas(reading) == {A: "collecting", B: "collecting", C: "unreachable", D: "unreachable"}
