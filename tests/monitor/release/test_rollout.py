"""Deploying the champion (monitor.deploy): the atomic switch of `current`, the previous deployment kept, the reload
command and request, a failed reload retried, the deployment of a rollback, and what MLflow records."""
import http.server
import json
import os
import threading

import pytest
from mlflow import MlflowClient

from monitor.release.layout import CURRENT, MANIFEST, PENDING, PREVIOUS, DeployError, DeployFolder
from monitor.release.rollout import Rollout, deploy_champion
from pipeline import metrics as M
from pipeline import registry
from tests.monitor.deploy_world import NAME, calls_of, recorder


def test_deploy_switches_current_atomically_and_keeps_the_previous(world):
    cfg, root = world
    deploy_root, (_, calls) = root / "deploy", recorder(root)
    first = deploy_champion(cfg)
    assert first.action == "deploy" and first.exported and first.reloaded and first.previous is None
    assert os.readlink(deploy_root / CURRENT) == "versions/v1"  # a relative link, flipped by one rename
    v1 = DeployFolder(deploy_root).linked(CURRENT)
    assert v1.version == "1" and v1.format == "hf" and "config.json" in v1.files and v1.file == v1.folder
    assert not (v1.folder / "draft_vocab.json").exists()  # the export, not draftops' own checkpoint
    assert calls_of(calls) == [["1", str(v1.folder), str(v1.folder), str(deploy_root / CURRENT)]]
    state = DeployFolder(deploy_root).read_state()
    assert state["check"] == PENDING and state["reloaded"]

    assert deploy_champion(cfg).action == "none" and len(calls_of(calls)) == 1  # deployed: nothing to do

    registry.promote(NAME, "2")
    second = deploy_champion(cfg)
    assert second.exported and second.previous.version == "1"
    assert os.readlink(deploy_root / CURRENT) == "versions/v2"
    assert os.readlink(deploy_root / PREVIOUS) == "versions/v1"
    assert DeployFolder(deploy_root).linked(PREVIOUS) == v1  # kept whole: every file of its manifest, same sizes
    assert calls_of(calls)[-1][:1] == ["2"]
    state = DeployFolder(deploy_root).read_state()
    assert (state["version"], state["previous_version"], state["folder"]) == ("2", "1", "v2")

    client = MlflowClient()
    tags = client.get_model_version(NAME, "2").tags
    assert tags[M.DEPLOY_FOLDER_TAG] == str(deploy_root / "versions" / "v2") and tags[M.DEPLOY_FORMAT_TAG] == "hf"
    run = client.get_run(tags[M.DEPLOY_RUN_TAG])
    assert run.data.tags[M.DEPLOY_VERSION_TAG] == "2" and run.data.tags[M.DEPLOY_ACTION_TAG] == "deploy"
    assert run.data.params["deploy.folder"] == str(deploy_root / "versions" / "v2")
    assert run.data.metrics["deploy/reloaded"] == 1.0


def test_rollback_switches_back_to_the_kept_folder(world, capsys):
    from pipeline.cli import main

    cfg, root = world
    deploy_root, (_, calls) = root / "deploy", recorder(root)
    deploy_champion(cfg)
    registry.promote(NAME, "2")
    deploy_champion(cfg)
    assert main(["monitor", "rollback", "--config", str(root / "cfg.yaml")]) == 0
    out = capsys.readouterr().out
    assert "@champion -> version 1" in out and "deploy (deploy): version 1" in out
    assert os.readlink(deploy_root / CURRENT) == "versions/v1"  # the kept folder, not exported again
    assert os.readlink(deploy_root / PREVIOUS) == "versions/v2"
    assert "exported" not in out.split("deploy (deploy)")[1].splitlines()[0]
    assert [c[0] for c in calls_of(calls)] == ["1", "2", "1"]

    # a deployment rolled back by hand (the registry unchanged): v2's folder is the one flipped back to
    assert main(["monitor", "deploy", "--config", str(root / "cfg.yaml"), "--rollback"]) == 0
    assert os.readlink(deploy_root / CURRENT) == "versions/v2"
    assert DeployFolder(deploy_root).read_state()["failed_version"] == "1"


def test_the_previous_deployment_survives_pruning_and_old_ones_go(world):
    cfg, root = world
    cfg = cfg.model_copy(update={"monitor": cfg.monitor.model_copy(update={
        "deploy": cfg.monitor.deploy.model_copy(update={"keep": 2})})})
    deploy_root = root / "deploy"
    deploy_champion(cfg)
    registry.promote(NAME, "2")
    deploy_champion(cfg)
    deploy_champion(cfg, force=True)  # exported again: into a new folder, current and previous stay whole
    assert os.readlink(deploy_root / CURRENT) == "versions/v2-2"
    assert os.readlink(deploy_root / PREVIOUS) == "versions/v2"
    assert sorted(p.name for p in (deploy_root / "versions").iterdir()) == ["v2", "v2-2"]  # v1 pruned (keep 2)


def test_a_failed_reload_is_reported_and_done_by_the_next_deploy(world):
    cfg, root = world
    deploy_root, (_, calls) = root / "deploy", recorder(root)
    (root / "reloads.txt.fail").write_text("")
    with pytest.raises(DeployError, match=r"^deploy step reload: reload command .* exited with 1: engine refused "
                                          r"the reload; `current` is version 1 \(v1\), not reloaded"):
        deploy_champion(cfg)
    folder = DeployFolder(deploy_root)
    assert folder.linked(CURRENT).version == "1" and not folder.read_state()["reloaded"]
    (root / "reloads.txt.fail").unlink()
    again = deploy_champion(cfg)
    assert again.action == "reload" and again.reloaded and not again.exported
    assert [c[0] for c in calls_of(calls)] == ["1"] and DeployFolder(deploy_root).read_state()["reloaded"]


class ReloadHandler(http.server.BaseHTTPRequestHandler):
    def do_PUT(self):
        self.server.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(204 if self.path == "/reload" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_reload_by_http_request(world):
    cfg, root = world
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ReloadHandler)
    server.bodies = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        deploy = cfg.monitor.deploy.model_copy(update={"reload_command": [], "reload_url": f"{url}/reload",
                                                       "reload_method": "PUT"})
        cfg = cfg.model_copy(update={"monitor": cfg.monitor.model_copy(update={"deploy": deploy})})
        result = deploy_champion(cfg)
        assert result.reloaded and result.notes == [f"PUT {url}/reload: HTTP 204"]
        assert server.bodies == [{"path": str(root / "deploy" / "versions" / "v1"), "file": str(
            root / "deploy" / "versions" / "v1"), "version": "1", "current": str(root / "deploy" / CURRENT),
            "format": "hf", "model": NAME}]
        deploy = deploy.model_copy(update={"reload_url": f"{url}/elsewhere"})
        cfg = cfg.model_copy(update={"monitor": cfg.monitor.model_copy(update={"deploy": deploy})})
        with pytest.raises(DeployError, match=r"reload request: .*/elsewhere answered HTTP 404 Not Found"):
            deploy_champion(cfg, force=True)
        assert not DeployFolder(root / "deploy").read_state()["reloaded"]
    finally:
        server.shutdown()
        server.server_close()


def test_a_draft_that_cannot_be_exported_names_why_and_nothing_switches(world):
    cfg, root = world
    deploy = cfg.monitor.deploy.model_copy(update={"format": "gguf", "gguf_vocabulary": str(root / "none.gguf")})
    cfg = cfg.model_copy(update={"monitor": cfg.monitor.model_copy(update={"deploy": deploy})})
    with pytest.raises(DeployError, match=r"export of models:/draftops-draft/1 as gguf: .*none\.gguf"):
        deploy_champion(cfg)
    assert not (root / "deploy" / CURRENT).exists()
    with pytest.raises(DeployError, match="no previous deployment"):
        Rollout(cfg).roll_back("test")


def test_a_folder_missing_a_file_is_not_a_deployment(world):
    cfg, root = world
    deploy_champion(cfg)
    folder = DeployFolder(root / "deploy").linked(CURRENT).folder
    assert json.loads((folder / MANIFEST).read_text())["version"] == "1"
    (folder / "config.json").unlink()
    assert DeployFolder(root / "deploy").linked(CURRENT) is None
