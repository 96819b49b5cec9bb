"""`draftops report` on a tiny registry in a tmp sqlite store: two versions, an eval, a bench and monitor checks."""
import mlflow
import pytest
from mlflow import MlflowClient

from monitor.registry_report import build_report, monitor_checks, monitor_history_figure, version_rows
from pipeline import metrics as M
from pipeline.cli import main
from pipeline.config import load_config
from pipeline.registry import link_run, register
from pipeline.tracking import start_run

NAME = "tiny-draft"


@pytest.fixture
def store(tmp_path):
    """Version 1 (champion, evaluated and benched) and version 2 (challenger); three monitor checks."""
    cfg = load_config(None, [f"tracking.uri=sqlite:///{tmp_path}/store.db", "tracking.system_metrics=false",
                             f"tracking.registered_model={NAME}", "decode.gamma=4"])
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text("{}")
    figures = [{M.ALPHA_T0: 0.61, M.ALPHA_T1: 0.52, M.tau_at(4): 2.31, M.DRAFT_PARAMS: 2_500_000,
                M.DRAFT_VOCAB_SIZE: 8192},
               {M.ALPHA_T0: 0.67, M.ALPHA_T1: 0.58, M.tau_at(4): 2.62, M.DRAFT_PARAMS: 2_500_000,
                M.DRAFT_VOCAB_SIZE: 8192}]
    for i, f in enumerate(figures):
        with start_run(cfg, "distill") as run:
            mlflow.log_metrics(f)
            fingerprint = "fp-target-a" if i == 0 else "fp-target-b"
            register(checkpoint, NAME, description="tiny", tags={
                "draftops.target_fingerprint": fingerprint, "gamma": "4", M.DISTILL_RUN_TAG: run.info.run_id,
                **{k: M.tag_value(v) for k, v in f.items() if k != M.ALPHA_T1}})  # α T=1 from the run
    with start_run(cfg, "eval") as run:
        mlflow.log_metrics({M.ACCEPTANCE_DRAFT: 0.594, M.ALPHA_T0: 0.6})
        assert link_run(f"models:/{NAME}@champion", M.LATEST_EVAL_RUN_TAG, run.info.run_id) == (NAME, "1")
    with start_run(cfg, "bench") as run:
        mlflow.log_metrics({M.SPEEDUP: 1.73})
        assert link_run(f"models:/{NAME}/1", M.LATEST_BENCH_RUN_TAG, run.info.run_id) == (NAME, "1")
    assert MlflowClient().get_run(run.info.run_id).data.tags["draftops.draft_version"] == f"{NAME}/1"
    checks = [("OK", "", {M.MONITOR_ACCEPTANCE_NOW: 0.62, M.MONITOR_ACCEPTANCE_BASELINE: 0.62}, {}),
              ("OK", "", {M.MONITOR_ACCEPTANCE_NOW: 0.615, M.MONITOR_ACCEPTANCE_BASELINE: 0.62,
                          M.MONITOR_ACCEPTANCE_THRESHOLD: 0.61, M.MONITOR_P_VALUE: 0.41}, {}),
              ("DRIFT", "target_changed", {M.MONITOR_ACCEPTANCE_NOW: 0.48, M.MONITOR_ACCEPTANCE_BASELINE: 0.62,
                                           M.MONITOR_ACCEPTANCE_THRESHOLD: 0.61, M.MONITOR_P_VALUE: 0.0012,
                                           M.MONITOR_BREAK_EVEN: 0.4, M.MONITOR_PROMOTED: 1.0},
               {"draftops.monitor.challenger_version": "2"})]
    for decision, cause, values, extra in checks:
        with start_run(cfg, "monitor", tags={"draftops.monitor.decision": decision, "draftops.monitor.cause": cause,
                                             "draftops.monitor.champion_version": "1",
                                             "draftops.registered_model": NAME, **extra}):
            mlflow.log_metrics(values)
    return cfg


def test_versions_side_by_side_with_their_figures(store):
    rows = version_rows(MlflowClient(store.tracking.uri, store.tracking.uri), NAME)
    assert [r.version for r in rows] == ["2", "1"]
    v2, v1 = rows
    assert v1.aliases == ["champion"] and v2.aliases == ["challenger"]
    assert (v1.alpha_t0, v1.alpha_t1, v1.tau) == (0.61, 0.52, 2.31)  # α T=1 read from the distill run
    assert (v2.alpha_t0, v2.tau, v2.target_fingerprint) == (0.67, 2.62, "fp-target-b")
    assert v1.eval_alpha_live == 0.594 and v1.speedup == 1.73
    assert v2.eval_alpha_live is None and v2.speedup is None
    assert v1.params == 2_500_000 and v1.vocab_size == 8192


def test_monitor_checks_oldest_first(store):
    checks = monitor_checks(MlflowClient(store.tracking.uri, store.tracking.uri), NAME)
    assert [c.decision for c in checks] == ["OK", "OK", "DRIFT"]
    assert checks[-1].cause == "target_changed" and checks[-1].p_value == 0.0012 and checks[-1].promoted
    assert checks[-1].challenger_version == "2" and checks[0].p_value is None
    fig = monitor_history_figure(checks)
    assert [len(line.get_xdata()) for line in fig.axes[0].lines][:1] == [3]


def test_report_markdown_and_html(store, capsys, tmp_path):
    text = build_report(NAME, tracking_uri=store.tracking.uri)
    lines = text.splitlines()
    v1 = next(line for line in lines if line.startswith("| 1 "))
    cells = [c.strip() for c in v1.strip("|").split("|")]
    assert cells[:8] == ["1", "champion", "fp-target-a", "0.610", "0.520", "2.31", "0.594", "1.73x"]
    assert cells[8:10] == ["2.5M", "8192"]
    assert "τ (γ=4)" in text
    drift = next(line for line in lines if "DRIFT" in line)
    assert [c.strip() for c in drift.strip("|").split("|")][1:] == [
        "DRIFT", "target_changed", "1", "0.480", "0.620", "0.0012", "–", "v2 promoted"]
    assert len({len(line) for line in lines if line.startswith("| 1 ") or line.startswith("| 2 ")}) == 1  # aligned

    out = tmp_path / "report.html"
    assert main(["report", "--model", NAME, "--format", "html", "--out", str(out),
                 f"tracking.uri={store.tracking.uri}"]) == 0
    page = out.read_text()
    assert page.startswith("<!doctype html>") and "<td>champion</td>" in page and "<td>1.73x</td>" in page
    assert "<img alt='monitor history' src='data:image/png;base64," in page


def test_report_on_an_empty_store(tmp_path, capsys):
    assert main(["report", f"tracking.uri=sqlite:///{tmp_path}/empty.db"]) == 0
    out = capsys.readouterr().out
    assert "No versions registered." in out and "No monitor checks yet." in out
