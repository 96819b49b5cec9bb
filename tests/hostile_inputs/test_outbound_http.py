"""Every outbound request of the monitor, the tracking check and llama-server goes through one client
(`pipeline.deadline_http`): a peer that trickles its answer a byte a second is cut off at the caller's deadline (headers
or body), a redirect is never followed (a secret never reaches the second origin), only http(s) URLs load, and
credentials written in a URL show in no message and no logged config."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from monitor.check.decision import Status
from monitor.check.run import run_check
from monitor.fleet.counters import ServerMetricsError, scrape
from monitor.fleet.prometheus import PrometheusError, api_get
from monitor.release.runtime_reload import ReloadError, send_deployment
from monitor.service.alerts import deliver, rollback_alert
from pipeline import metrics as M
from pipeline.config import ConfigError, load_config
from pipeline.config.alerts import AlertTarget
from pipeline.locks import model_lock
from pipeline.tracking import TrackingUnavailable, _check_api, check_tracking
from tests.fake_peers import Recorder, Trickler, elapsed
from tests.monitor.check.test_run import NAME, World, write_traffic

DEADLINE = 3.0
SLACK = 1.5  # a loaded 2-core machine


def _prometheus(url):
    return api_get(f"{url}/api/v1/query?query=up", DEADLINE)


def _metrics(url):
    return scrape(f"{url}/metrics", DEADLINE)


def _health(url):
    return check_tracking(load_config(None, [f"tracking.uri={url}"]), timeout=DEADLINE)


def _tracking_api(url):
    return _check_api(url)


def _alertmanager(url):
    return deliver(AlertTarget(kind="alertmanager", url=url), [rollback_alert("m", "1")], tries=3, deadline=DEADLINE)


def _webhook(url):
    return deliver(AlertTarget(kind="webhook", url=url), [rollback_alert("m", "1")], tries=3, deadline=DEADLINE)


def _reload(url):
    return send_deployment("POST", f"{url}/reload", {"version": "1"}, time.monotonic() + DEADLINE)


CALLERS = {"prometheus": (_prometheus, PrometheusError), "engine metrics": (_metrics, ServerMetricsError),
           "tracking /health": (_health, TrackingUnavailable), "tracking API": (_tracking_api, TrackingUnavailable),
           "alertmanager": (_alertmanager, False), "webhook": (_webhook, False), "reload url": (_reload, ReloadError)}


@pytest.mark.parametrize("slow_headers", [True, False], ids=["headers", "body"])
@pytest.mark.parametrize("caller", CALLERS)
def test_a_peer_trickling_a_byte_a_second_is_cut_off_at_the_deadline(caller, slow_headers, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", str(DEADLINE))
    call, failure = CALLERS[caller]
    peer = Trickler(slow_headers=slow_headers, pause=1.0)
    try:
        out, seconds = elapsed(call, peer.url)
    finally:
        peer.close()
    assert seconds < DEADLINE + SLACK, (seconds, out)
    if failure is False:
        assert out is False  # an alert that fails is logged and counted, never raised
    else:
        assert isinstance(out, failure), out
        assert "\n" not in str(out)


@pytest.mark.parametrize("kind", ["alertmanager", "webhook"])
def test_a_redirect_to_another_origin_never_carries_the_secret(kind, monkeypatch):
    monkeypatch.setenv("ALERT_TOKEN", "s3cret-token")
    second = Recorder()
    first = Recorder(location=second.url)
    try:
        target = AlertTarget(kind=kind, url=first.url, secret_env="ALERT_TOKEN")
        assert deliver(target, [rollback_alert("m", "1")], tries=2, deadline=DEADLINE) is False
    finally:
        first.close()
        second.close()
    assert first.requests and first.requests[0][2]["Authorization"] == "Bearer s3cret-token"
    assert second.requests == []  # the second origin heard nothing, let alone the token


def test_a_redirect_is_refused_by_the_other_callers():
    second = Recorder()
    first = Recorder(location=second.url)
    try:
        with pytest.raises(PrometheusError, match="a redirect to .* \\(not followed\\)"):
            _prometheus(first.url)
        with pytest.raises(ServerMetricsError, match="HTTP 302"):
            _metrics(first.url)
        with pytest.raises(ReloadError, match="HTTP 302"):
            _reload(first.url)
    finally:
        first.close()
        second.close()
    assert second.requests == []


@pytest.mark.parametrize("key", ["monitor.prometheus_url", "monitor.server_metrics_url",
                                 "monitor.deploy.reload_url"])
@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://host/x", "gopher://host", "http:///no-host"])
def test_only_http_urls_load(key, url):
    with pytest.raises(ConfigError, match="is not an http\\(s\\) URL"):
        load_config(None, [f"{key}={url}"])


def test_only_http_urls_load_for_engines_and_alert_targets(tmp_path):
    for monitor in ({"engines": [{"url": "file:///etc/passwd"}]},
                    {"alerts": {"targets": [{"kind": "webhook", "url": "file:///etc/passwd"}]}}):
        path = tmp_path / "cfg.yaml"
        path.write_text(yaml.safe_dump({"monitor": monitor}))
        with pytest.raises(ConfigError, match="is not an http\\(s\\) URL"):
            load_config(path)


def test_a_password_in_the_tracking_uri_is_sent_as_basic_auth_and_never_shown(monkeypatch):
    server = Recorder()
    uri = server.url.replace("http://", "http://ops:hunter2@")
    try:
        assert check_tracking(load_config(None, [f"tracking.uri={uri}"]), timeout=DEADLINE) == uri
    finally:
        server.close()
    assert server.requests[0][2]["Authorization"] == "Basic b3BzOmh1bnRlcjI="  # ops:hunter2
    peer = Trickler()
    uri = peer.url.replace("http://", "http://ops:hunter2@")
    try:
        with pytest.raises(TrackingUnavailable) as err:
            check_tracking(load_config(None, [f"tracking.uri={uri}"]), timeout=1.0)
    finally:
        peer.close()
    assert "hunter2" not in str(err.value) and "ops:***@" in str(err.value)
    cfg = load_config(None, [f"tracking.uri={uri}", "monitor.prometheus_url=http://a:hunter2@prom:9090"])
    assert "hunter2" not in yaml.safe_dump(cfg.to_dict())
    with pytest.raises(ConfigError) as bad:
        load_config(None, ["monitor.prometheus_url=file://a:hunter2@x/"])
    assert "hunter2" not in str(bad.value)


def test_a_password_in_a_url_reaches_no_mlflow_param_or_logged_config(mlflow_uri, tmp_path):
    from pipeline.tracking import start_run

    cfg = load_config(None, [f"tracking.uri={mlflow_uri}", "tracking.system_metrics=false",
                             "monitor.prometheus_url=http://ops:hunter2@prom:9090",
                             "monitor.deploy.reload_url=http://ops:hunter2@engine:8000/reload"])
    with start_run(cfg, "test") as run:
        pass
    client = MlflowClient()
    logged = client.get_run(run.info.run_id)
    folder = client.download_artifacts(run.info.run_id, "config", str(tmp_path))
    texts = [str(logged.data.params), str(logged.data.tags)] + [p.read_text() for p in sorted(
        Path(folder).rglob("*")) if p.is_file()]
    assert texts and not any("hunter2" in text for text in texts)
    assert any("ops:***@prom" in text for text in texts)


def test_a_check_whose_prometheus_trickles_ends_in_time_and_releases_the_lock(mlflow_uri, tmp_path):
    """`monitor check` with Prometheus sending a byte a second: an ERROR reading within the deadline (per request),
    and the model's lock free afterwards."""
    traffic = tmp_path / "traffic.jsonl"
    write_traffic(traffic, 0, 120)
    peer = Trickler()
    cfg = load_config(None, [f"traffic.path={traffic}", "traffic.heldout_fraction=0.5", f"tracking.uri={mlflow_uri}",
                             "tracking.system_metrics=false", "monitor.heldout_requests=30", "monitor.n_bootstrap=200",
                             f"monitor.state_dir={tmp_path / 'state'}", f"monitor.prometheus_url={peer.url}",
                             f"monitor.server_timeout={DEADLINE}"])
    client = MlflowClient()
    client.create_registered_model(NAME)
    client.create_model_version(NAME, source="file:///nonexistent", tags={M.TARGET_FINGERPRINT_TAG: "fp-A"})
    client.set_registered_model_alias(NAME, M.CHAMPION, "1")
    world = World()
    try:
        report, seconds = elapsed(run_check, cfg, load=world.load, measure=world.measure)
    finally:
        peer.close()
    assert not isinstance(report, Exception), report
    assert report.decision.status is Status.ERROR and "no whole answer within 3 s" in report.server.error
    assert seconds < 60, seconds  # the offline check included; the Prometheus reading is cut at 3 s a request
    with model_lock(NAME, mlflow_uri, timeout=0):
        pass


def test_a_llama_server_trickling_its_answer_is_cut_off_at_the_deadline(tmp_path):
    """The llama-server draftops starts is asked through the same client (`LlamaServer._post`)."""
    from decode.serving.llamacpp import LlamaCppError, LlamaServer

    peer = Trickler()
    try:
        server = LlamaServer(tmp_path / "model.gguf", binary=Path(sys.executable), port=int(peer.url.split(":")[-1]))
        out, seconds = elapsed(server._post, "/completion", {"prompt": [1]}, DEADLINE)
    finally:
        peer.close()
    assert isinstance(out, LlamaCppError) and "no whole answer within 3 s" in str(out), out
    assert seconds < DEADLINE + SLACK
