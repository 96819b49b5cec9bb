"""A deploy that fails is one line and exit 2, naming its step, and leaves `current` on a whole deployment: a
read-only or full deploy folder (a small tmpfs where this machine lets the test mount one, else a patched write),
`current` replaced by a folder by hand, a literal `{` and an unknown placeholder in `reload_command`, a reload URL
that trickles its headers, a reload command that hangs. Each ends within `reload_timeout` (and the time the tiny
draft's export and MLflow record take), leaves no process, no temporary link, and a deploy.json that never says
reloaded when the engine was not.

Version 1 is deployed with the recording reload command first; then version 2 is promoted and `draftops monitor
deploy` (in this process, through `pipeline.cli.main`) meets the fault."""
import contextlib
import errno
import os
import re
import subprocess
import sys
import time

import psutil
import pytest

from monitor.release.layout import CURRENT, PREVIOUS, DeployFolder
from monitor.release.reload import GROUP_GONE_SECONDS, ReloadPlan
from monitor.release.rollout import deploy_champion
from pipeline import registry
from pipeline.cli import main
from tests.monitor.deploy_world import NAME, trickling_server, two_drafts_world, write_config
from tests.monitor.release.test_reload import running, spawner

TIMEOUT = 2.5  # reload_timeout of the reload faults
WORK = 15.0  # what the rest of a deploy may take on a loaded 2-core machine: the export of a tiny draft, MLflow


@pytest.fixture
def world(tmp_path, mlflow_uri):
    """Versions 1 (champion) and 2 of tiny drafts, and a config deploying them as hf with the recording reload."""
    return two_drafts_world(tmp_path, mlflow_uri)


@contextlib.contextmanager
def small_tmpfs(path, size: str = "16m"):
    """`path` as a tmpfs of `size` when this process may mount one (root, a kernel that allows it), else None."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                           capture_output=True).returncode != 0:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def deploy(root, capsys) -> tuple[int, str, float]:
    """`draftops monitor deploy`: (exit code, its one error line, seconds); fails unless stderr ends with exactly one
    `draftops: error:` line, holds no traceback and no ERROR logged before it (the failure said twice)."""
    start = time.monotonic()
    code = main(["monitor", "deploy", "--config", str(root / "cfg.yaml")])
    seconds = time.monotonic() - start
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("draftops: error:")]
    assert "Traceback" not in err and len(errors) == 1 and lines[-1] == errors[0], err[-3000:]
    assert not [line for line in lines if " ERROR " in line], err[-3000:]
    return code, errors[0], seconds


def deployed_v1_then_promote_v2(cfg) -> None:
    assert deploy_champion(cfg).reloaded
    registry.promote(NAME, "2")


def assert_whole(deploy_root, version: str) -> None:
    """`current` on a whole deployment of `version`, no temporary link left, deploy.json not claiming a reload that
    did not happen."""
    assert DeployFolder(deploy_root).linked(CURRENT).version == version
    assert not [p.name for p in deploy_root.glob(".*.tmp*")]
    state = DeployFolder(deploy_root).read_state()
    assert not state.get("reloaded") or (state["version"], state["folder"]) == ("1", "v1")


def test_a_read_only_deploy_folder_is_one_line(world, mlflow_uri, capsys, monkeypatch):
    cfg, root = world
    deploy_root = root / "deploy"
    with small_tmpfs(deploy_root) as mounted:
        deployed_v1_then_promote_v2(cfg)
        if mounted:
            subprocess.run(["mount", "-o", "remount,ro", str(deploy_root)], check=True)
        else:
            def read_only(*args, **kwargs):
                raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(args[-1]))
            monkeypatch.setattr(os, "symlink", read_only)
        code, line, _ = deploy(root, capsys)
        assert code == 2 and "Read-only file system" in line
        assert f"deploy step {'lock' if mounted else 'switch'}" in line
        assert_whole(deploy_root, "1")


def test_a_full_deploy_folder_is_one_line(world, mlflow_uri, capsys, monkeypatch):
    cfg, root = world
    deploy_root = root / "deploy"
    with small_tmpfs(deploy_root) as mounted:
        deployed_v1_then_promote_v2(cfg)
        if mounted:  # fill what is left of it
            with open(deploy_root / "filler", "wb", buffering=0) as filler, contextlib.suppress(OSError):
                while True:
                    filler.write(b"\0" * (1 << 16))
        else:
            def full(*args, **kwargs):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(args[0]))
            monkeypatch.setattr("monitor.release.rollout.write_text_atomic", full)
        code, line, _ = deploy(root, capsys)
        assert code == 2 and "No space left on device" in line
        assert f"deploy step {'export' if mounted else 'manifest'}" in line
        assert_whole(deploy_root, "1")
        assert not [p for p in (deploy_root / "versions").iterdir() if ".tmp" in p.name]  # the export cleaned up


def test_a_current_that_is_not_draftops_link_is_refused(world, mlflow_uri, capsys):
    cfg, root = world
    deploy_root = root / "deploy"
    deployed_v1_then_promote_v2(cfg)
    (deploy_root / CURRENT).unlink()
    (deploy_root / CURRENT).mkdir()  # an operator copied a draft in by hand
    (deploy_root / CURRENT / "model.safetensors").write_text("by hand")
    code, line, _ = deploy(root, capsys)
    assert code == 2 and line.endswith(f"{deploy_root / CURRENT} is a folder, not the link draftops made: move it "
                                       "away (a deploy replaces only its own links)")
    assert (deploy_root / CURRENT / "model.safetensors").read_text() == "by hand"  # untouched
    assert sorted(p.name for p in (deploy_root / "versions").iterdir()) == ["v1"]  # refused before the export
    assert DeployFolder(deploy_root).linked(PREVIOUS) is None and not list(deploy_root.glob(".*.tmp*"))
    (deploy_root / CURRENT / "model.safetensors").unlink()
    (deploy_root / CURRENT).rmdir()
    (deploy_root / CURRENT).symlink_to("/etc")  # a link, but not one draftops made
    code, line, _ = deploy(root, capsys)
    assert code == 2 and "points at /etc, not at a folder of" in line


@pytest.mark.parametrize("argument, why", [('{"draft": "{path}"}', r'\{"draft": "\{path\}"\} is not a placeholder'),
                                           ("--draft={model}", r"\{model\} is not a placeholder")])
def test_a_reload_command_with_a_brace_or_an_unknown_placeholder_is_refused_before_anything(
        world, mlflow_uri, capsys, argument, why):
    cfg, root = world
    deployed_v1_then_promote_v2(cfg)
    write_config(root, mlflow_uri, root / "traffic.jsonl", reload_command=["curl", "-d", argument])
    code, line, _ = deploy(root, capsys)
    assert code == 2 and "monitor.deploy.reload_command" in line
    assert re.search(why, line)
    assert_whole(root / "deploy", "1")
    assert DeployFolder(root / "deploy").read_state()["version"] == "1"  # nothing was written


def timed_reloads(monkeypatch) -> list[float]:
    """The seconds each reload took, recorded as the deploy runs it."""
    seconds, run = [], ReloadPlan.run

    def timed(plan):
        start = time.monotonic()
        try:
            return run(plan)
        finally:
            seconds.append(time.monotonic() - start)
    monkeypatch.setattr(ReloadPlan, "run", timed)
    return seconds


def test_a_reload_url_trickling_its_headers_is_cut_off_at_reload_timeout(world, mlflow_uri, capsys, monkeypatch):
    cfg, root = world
    deployed_v1_then_promote_v2(cfg)
    reloads = timed_reloads(monkeypatch)
    with trickling_server(interval=1.0) as url:
        write_config(root, mlflow_uri, root / "traffic.jsonl", reload="url", reload_url=url, reload_command=[],
                     reload_timeout=TIMEOUT)
        code, line, seconds = deploy(root, capsys)
    assert code == 2 and line.startswith("draftops: error: deploy step reload: reload request: no whole answer from")
    assert line.endswith("`current` is version 2 (v2), not reloaded: the next deploy or check reloads it")
    assert reloads and reloads[0] < TIMEOUT + 1.0 and seconds < TIMEOUT + WORK
    assert_whole(root / "deploy", "2")
    assert DeployFolder(root / "deploy").read_state()["reloaded"] is False


def test_a_hung_reload_command_is_killed_with_what_it_started(world, mlflow_uri, capsys, monkeypatch, tmp_path):
    cfg, root = world
    deployed_v1_then_promote_v2(cfg)
    reloads = timed_reloads(monkeypatch)
    argv, pids = spawner(tmp_path)  # python starting `sleep 1000`, then sleeping 1000 s itself
    write_config(root, mlflow_uri, root / "traffic.jsonl", reload_command=argv, reload_timeout=TIMEOUT)
    code, line, seconds = deploy(root, capsys)
    assert code == 2 and "still ran at monitor.deploy.reload_timeout: its process group was killed" in line
    assert reloads and reloads[0] < TIMEOUT + GROUP_GONE_SECONDS + 1.0 and seconds < TIMEOUT + WORK
    assert running([int(pid) for pid in pids.read_text().split()]) == []
    assert psutil.Process().children(recursive=True) == []
    assert_whole(root / "deploy", "2")
    assert DeployFolder(root / "deploy").read_state()["reloaded"] is False
    write_config(root, mlflow_uri, root / "traffic.jsonl", reload_command=[sys.executable, "-c", "pass"])
    assert main(["monitor", "deploy", "--config", str(root / "cfg.yaml")]) == 0  # the next deploy reloads it
    assert DeployFolder(root / "deploy").read_state()["reloaded"] is True
