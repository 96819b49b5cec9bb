"""The serve demo shortened (marked `llamacpp`: `make test-llamacpp` builds llama-server first): the real
SmolLM2 target served by llama-server, a real LoRA target update rolled out to it as GGUF, real GGUF deploys through the
engine's reload endpoint, and checks reading its counters: OK -> DRIFT(target_changed) from the engine -> promoted ->
deployed -> confirmed and recovered; then a deliberately wrong deployment (the engine restarted with the old draft's
file while the new one is deployed) caught by the post-deploy check as DEPLOY_MISMATCH.

Shortened: instead of distilling, the champion is a draft copied whole from the original target and the "retrained"
challenger one copied from the updated target (each agrees with its own target, so the acceptance falls with the
update and comes back with the redeploy, fast and unmistakably); 16 held-out prompts of 32 tokens, 15 LoRA steps on
16 prompts, 3 windows of 2 requests per check; llama-server on one thread (on a shared machine two spin-wait for
each other).
Measured on a 2-core AMD EPYC shared with other jobs: 7.1 min (load 3-6), 2026-12-05; an earlier run with 3 requests a
window and two llama-server threads took 54.8 min under load 9-11."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import mlflow
import pytest

from decode.models.layer_draft import draft_from_target_layers
from decode.serving.llamacpp import find_server
from distill.register import export_draft
from monitor.rehearsal.serve_demo import run_serve_demo
from pipeline import metrics as M
from pipeline import registry
from pipeline.config import load_config
from pipeline.sources import resolve_model
from pipeline.traffic import DEFAULT_TRAFFIC

pytestmark = pytest.mark.llamacpp
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def real_home():
    """The real $DRAFTOPS_HOME (the llama.cpp build, the converted target), read before the tests' own hides it."""
    server = find_server()
    if server is None:
        pytest.fail("no llama-server: `make test-llamacpp` builds it first (draftops llama-cpp build)")
    return os.environ.get("DRAFTOPS_HOME"), server.parent


def register_copy(cfg, folder) -> str:
    """The configured target copied whole as a draft, exported as distill exports and registered."""
    target = resolve_model(cfg.target, device="cpu")
    draft = draft_from_target_layers(target.model, list(range(target.model.config.num_hidden_layers))).eval()
    path = export_draft(draft, target.tokenizer, folder, token_ids=None, cfg=cfg)
    mlflow.set_experiment("draftops-distill")
    with mlflow.start_run():
        version, _ = registry.register(path, cfg.tracking.registered_model, description="a copy of the target",
                                       tags={M.TARGET_FINGERPRINT_TAG: target.fingerprint})
    return str(version.version)


def test_the_loop_through_llama_server_shortened(tmp_path, mlflow_uri, real_home, monkeypatch):
    home, binaries = real_home
    monkeypatch.setenv("DRAFTOPS_LLAMA_CPP", str(binaries))
    if home:  # as the integration tests: the converted target and its responses are shared, the rest is in tmp_path
        monkeypatch.setenv("DRAFTOPS_HOME", home)
    else:
        monkeypatch.delenv("DRAFTOPS_HOME")
    prompts = tmp_path / "update_prompts.jsonl"
    with open(DEFAULT_TRAFFIC) as f:
        prompts.write_text("".join(line for line, _ in zip(f, range(16))))
    cfg = load_config(REPO / "configs" / "serve_demo.yaml", [
        f"tracking.uri={mlflow_uri}", "monitor.heldout_requests=16", "monitor.n_bootstrap=300",
        "decode.max_new_tokens=32", "distill.max_new_tokens=32", "distill.generation_batch_size=16",
        f"target_update.prompts={prompts}", "target_update.max_prompts=16", "target_update.steps=15",
        "monitor.deploy.min_window_draft_tokens=20"])
    started = time.perf_counter()
    lines: list[str] = []
    result = run_serve_demo(cfg, tmp_path / "demo", champion=lambda c: register_copy(c, tmp_path / "v1"),
                            retrain=lambda c: register_copy(c, tmp_path / "v2"), rehearse_mismatch=True,
                            speed=False, per_window=2, threads=1, echo=lines.append)
    minutes = (time.perf_counter() - started) / 60
    (tmp_path / "summary.txt").write_text("\n".join(lines))
    print("\n".join(lines[-30:]), f"\n{minutes:.1f} min")
    assert result.ok, "\n".join(lines[-40:])
    assert result.decisions == ["OK", "DRIFT(target_changed)", "OK", "DEPLOY_MISMATCH"]
    before, dropped, after = list(result.windows.values())[:3]
    assert min(before) > max(dropped) and min(after) > max(dropped)
    assert json.loads((tmp_path / "demo" / "deploy" / "deploy.json").read_text())["failed_version"] == "2"
