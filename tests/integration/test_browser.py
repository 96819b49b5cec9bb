"""The user's path through the MLflow UI, in a real headless Chromium (Debian's chromium + chromium-driver).

Two tiny distills register two versions (champion, challenger), an eval of the champion links itself to the version;
then `mlflow server` serves the store and the browser checks the registered model page and the compare view.
Screenshots land in test-artifacts/. Run with `make test-browser` (pytest -m browser).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from pipeline import metrics as M
from tests.loopback_servers import TrackingServer

pytestmark = pytest.mark.browser

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
PAGE_TIMEOUT_S = 60

@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Two tiny distills (two versions) and one eval of the champion, in one sqlite store."""
    from distill.train import run_distill
    from pipeline.cli import main
    from tests.distill.tiny_job import tiny_config

    root = tmp_path_factory.mktemp("browser_store")
    cwd = os.getcwd()
    os.chdir(root)  # run artifacts go to ./mlruns: keep them in the tmp store
    try:
        first = run_distill(tiny_config(root, "distill.max_steps=4"))
        second = run_distill(tiny_config(root, "distill.max_steps=8"))
        cfg = tiny_config(root)
        assert main(["eval", "--target", cfg.target, "--draft", f"models:/{cfg.tracking.registered_model}@champion",
                     "--traffic", cfg.traffic.path, "--split", "heldout", "--limit", "4", "--max-new-tokens", "8",
                     "device=cpu", "tracking.system_metrics=false", f"tracking.uri={cfg.tracking.uri}"]) == 0
    finally:
        os.chdir(cwd)
    return cfg, first, second


@pytest.fixture(scope="module")
def server(store):
    cfg, _, _ = store
    tracking = TrackingServer(Path(cfg.distill.output_dir) / "tracking-server", backend_uri=cfg.tracking.uri)
    yield tracking.url
    tracking.close()


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="draftops-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=1500,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(PAGE_TIMEOUT_S)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def wait_for_text(driver, *texts: str, timeout: float = PAGE_TIMEOUT_S) -> str:
    """The page's visible text once it holds every one of `texts` (bounded wait)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        WebDriverWait(driver, timeout, poll_frequency=0.5).until(
            lambda d: all(t in d.find_element(By.TAG_NAME, "body").text for t in texts))
    except TimeoutException:
        body = driver.find_element(By.TAG_NAME, "body").text
        screenshot(driver, "timeout")
        missing = [t for t in texts if t not in body]
        pytest.fail(f"page {driver.current_url} never showed {missing}; it shows:\n{body[:800]}\n[...]\n{body[-1500:]}")
    return driver.find_element(By.TAG_NAME, "body").text


def close_assistant(driver) -> None:
    """MLflow 3's assistant side panel covers a third of the page; close it where it is open."""
    from selenium.webdriver.common.by import By

    for button in driver.find_elements(By.CSS_SELECTOR, "button[aria-label='Close']"):
        if button.is_displayed():
            button.click()


GRID_ROWS_JS = """
const box = arguments[0].closest('.du-bois-light-collapse-content-box');
const [names, values] = box.querySelectorAll('.ReactVirtualized__Grid');
const rows = {};
for (const cell of names.children[0].children) rows[cell.style.top] = [cell.textContent.trim()];
const cells = Array.from(values.children[0].children).sort(
    (a, b) => parseFloat(a.style.left) - parseFloat(b.style.left));
for (const cell of cells) if (rows[cell.style.top]) rows[cell.style.top].push(cell.textContent.trim());
return [Object.values(rows), values.scrollTop + values.clientHeight >= values.scrollHeight];
"""


def compare_metrics(driver) -> dict[str, list[float]]:
    """Every metric of the compare view's Metrics grid, a value per run. The grid is virtualized (only the rows in its
    300-pixel window exist in the page), so it is scrolled through a window at a time and read from the DOM."""
    from selenium.webdriver.common.by import By

    switch = driver.find_element(By.CSS_SELECTOR, "button[aria-label='Metrics - Show diff only']")
    grid = driver.execute_script("return arguments[0].closest('.du-bois-light-collapse-content-box')"
                                 ".querySelectorAll('.ReactVirtualized__Grid')[1]", switch)
    metrics: dict[str, list[float]] = {}
    for _ in range(200):
        rows, at_end = driver.execute_script(GRID_ROWS_JS, switch)
        metrics.update({row[0]: [float(v) for v in row[1:]] for row in rows if len(row) > 1})
        if at_end:
            return metrics
        driver.execute_script("arguments[0].scrollTop += arguments[0].clientHeight / 2", grid)
        time.sleep(0.3)
    return metrics


def screenshot(driver, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    return path


def test_registered_model_page_lists_both_versions_with_aliases(store, server, browser):
    cfg, first, second = store
    name = cfg.tracking.registered_model
    browser.get(f"{server}/#/models/{name}")
    text = wait_for_text(browser, "Version 1", "Version 2", "champion", "challenger")
    close_assistant(browser)
    assert first.alias == "champion" and second.alias == "challenger"
    assert name in text and M.ALPHA_T0 in text  # the versions' tags carry the figures
    screenshot(browser, "registered_model")

    browser.get(f"{server}/#/models/{name}/versions/1")
    text = wait_for_text(browser, "Version 1", "draftops.latest_eval_run")
    assert "target fingerprint" in text  # the description says what the draft is
    screenshot(browser, "model_version_1")


def test_compare_view_of_the_two_distill_runs_shows_acceptance(store, server, browser):
    from mlflow import MlflowClient
    from selenium.webdriver.common.by import By

    cfg, first, second = store
    experiment = MlflowClient(cfg.tracking.uri).get_run(first.run_id).info.experiment_id
    runs = urllib.parse.quote(json.dumps([first.run_id, second.run_id]))
    experiments = urllib.parse.quote(json.dumps([experiment]))
    browser.get(f"{server}/#/compare-runs?runs={runs}&experiments={experiments}")
    wait_for_text(browser, M.ALPHA_T0, "draft-v1-forward_kl", "draft-v2-forward_kl")
    close_assistant(browser)
    metrics = compare_metrics(browser)
    assert {M.ALPHA_T0, M.tau_at(cfg.decode.gamma), M.DRAFT_VOCAB_SIZE} <= set(metrics), sorted(metrics)
    # one column per run, in the order asked for; MLflow shows 3 decimals
    assert metrics[M.ALPHA_T1] == pytest.approx([first.metrics["alpha_t1"], second.metrics["alpha_t1"]], abs=6e-4)
    assert metrics[M.tau_at(cfg.decode.gamma)] == pytest.approx(
        [first.metrics["tau"], second.metrics["tau"]], abs=6e-4)
    section = browser.find_elements(By.XPATH, "//*[normalize-space(text())='Metrics']")[-1]
    browser.execute_script("arguments[0].scrollIntoView(true);", section)
    screenshot(browser, "compare_distill_runs")


@pytest.fixture(scope="module")
def sweep_run(store) -> tuple[str, str]:
    """A tiny `draftops sweep` of the champion and prompt lookup logged to the store: (experiment id, run id)."""
    from mlflow import MlflowClient

    from pipeline.cli import main

    cfg, _, _ = store
    cwd = os.getcwd()
    os.chdir(Path(cfg.tracking.uri.removeprefix("sqlite:///")).parent)  # the store fixture's ./mlruns
    try:
        out = Path("sweep")
        assert main(["sweep", "--target", cfg.target, "--traffic", cfg.traffic.path, "--drafts",
                     f"models:/{cfg.tracking.registered_model}@champion,prompt-lookup", "--gammas", "1,2",
                     "--contexts", "16,24", "--max-new-tokens", "4,6", "--analytic-prompts", "2",
                     "--measure-prompts", "1", "--reps", "1", "--batches", "1,2", "--batch-context", "16",
                     "--out", str(out), "--json", "device=cpu", "tracking.system_metrics=false",
                     f"tracking.uri={cfg.tracking.uri}"]) == 0
        run_id = json.loads((out / "sweep.json").read_text())["mlflow_run_id"]
    finally:
        os.chdir(cwd)
    return MlflowClient(cfg.tracking.uri).get_run(run_id).info.experiment_id, run_id


@pytest.mark.parametrize("plot", ["draft_size.png", "batch.png", "quantization.png"])
def test_the_sweeps_plots_show_in_the_run_page(sweep_run, server, browser, plot):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    experiment, run_id = sweep_run
    browser.get(f"{server}/#/experiments/{experiment}/runs/{run_id}/artifacts/sweep/{plot}")
    wait_for_text(browser, plot)
    close_assistant(browser)
    WebDriverWait(browser, PAGE_TIMEOUT_S, poll_frequency=0.5).until(lambda d: any(
        d.execute_script("return arguments[0].complete && arguments[0].naturalWidth", img) > 400
        for img in d.find_elements(By.TAG_NAME, "img")))  # the plot itself, not an icon
    screenshot(browser, f"sweep_{plot.removesuffix('.png')}")
