"""The reload action of a deploy (monitor.deploy.reload, monitor.release.runtime_reload), without MLflow: placeholders
expanded as documented and nothing else, one deadline shared by the command and the request, the command's process
group killed past it, a request cut off however slowly its server answers its headers, and the request shapes of
vLLM's and SGLang's weight-update endpoints (fake servers that record them; no real engine)."""
import sys
import time

import psutil
import pytest

from monitor.release.reload import GROUP_GONE_SECONDS, become_subreaper, check_reload, plan_reload, run_command
from monitor.release.runtime_reload import ReloadError, push_to_sglang, push_to_vllm
from pipeline.config import ConfigError, load_config
from pipeline.config.deploy import DeployConfig, expand_placeholders
from tests.monitor.deploy_world import recording_engine, trickling_server

VALUES = {"path": "/d/versions/v2", "file": "/d/versions/v2/draft.gguf", "version": "2", "current": "/d/current"}
MARGIN = 1.0  # seconds a deadline may be overrun by the machine's own slowness (2 shared cores)


HANG = """import os, subprocess, sys, time
child = subprocess.Popen(["sleep", "1000"])
with open(sys.argv[1], "w") as pids:
    pids.write(f"{os.getpid()} {child.pid}")
time.sleep(1000)
"""


def spawner(tmp_path) -> tuple[list[str], object]:
    """A command that starts `sleep 1000` and sleeps 1000 s itself, writing both pids to a file first."""
    script, pids = tmp_path / "hang.py", tmp_path / "pids.txt"
    script.write_text(HANG)
    return [sys.executable, str(script), str(pids)], pids


def running(pids: list[int]) -> list[int]:
    """Those of `pids` that still run (a zombie waiting for its parent does not)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_only_the_documented_placeholders_are_expanded():
    assert expand_placeholders("--draft={path}/x {{literal}}", VALUES) == "--draft=/d/versions/v2/x {literal}"
    for bad, why in (("{", "Single '{'"), ("}", "Single '}'"), ('{"a": 1}', 'is not a placeholder'),
                     ("{version:>99999999}", r"\{version:>99999999\} is not a placeholder"),
                     ("{path.__class__}", "is not a placeholder"), ("{path[0]}", "is not a placeholder"),
                     ("{version!r}", "is not a placeholder"), ("{model}", "is not a placeholder"),
                     ("{}", "is not a placeholder")):
        with pytest.raises(ValueError, match=why):
            expand_placeholders(bad, VALUES)


def test_a_bad_placeholder_is_one_line_when_the_config_is_loaded(tmp_path):
    config = tmp_path / "cfg.yaml"
    for argv, why in ((["curl", "-d", '{"version": "{version}"}'], '{"version": "{version}"} is not a placeholder'),
                      (["restart", "{unknown}"], r"\{unknown\} is not a placeholder")):
        config.write_text(f"monitor:\n  deploy:\n    reload_command: {argv!r}\n")
        with pytest.raises(ConfigError, match=why) as caught:
            load_config(config)
        assert len(str(caught.value).splitlines()) == 1
    config.write_text("monitor:\n  deploy:\n    reload_command: [curl, -d, '{{\"version\": \"{version}\"}}']\n")
    argv = load_config(config).monitor.deploy.reload_command
    assert expand_placeholders(argv[2], VALUES) == '{"version": "2"}'  # braces doubled: written literally


def test_a_config_built_around_the_loader_is_still_checked_before_anything_runs():
    deploy = DeployConfig().model_copy(update={"reload_command": ["echo", "{path:>99999999}"]})  # no validation
    with pytest.raises(ReloadError, match=r"reload_command: '\{path:>99999999\}'"):
        check_reload(deploy)


@pytest.mark.parametrize("update, why", [
    ({"reload": "vllm"}, "reload vllm needs monitor.deploy.reload_url"),
    ({"reload": "sglang", "reload_url": "http://h:30000", "format": "gguf"}, "format gguf is for llama.cpp"),
    ({"reload": "command", "reload_command": ["x"], "reload_url": "http://h"}, "does not use .*reload_url"),
])
def test_a_reload_mode_without_what_it_needs_is_refused(update, why):
    with pytest.raises(ValueError, match=why):
        DeployConfig(**update)


def test_a_hung_command_is_killed_with_its_process_group_at_the_deadline(tmp_path):
    argv, pids = spawner(tmp_path)
    start = time.monotonic()
    with pytest.raises(ReloadError, match="still ran at monitor.deploy.reload_timeout: its process group was killed"):
        run_command(argv, time.monotonic() + 2.5)
    assert time.monotonic() - start < 2.5 + GROUP_GONE_SECONDS + MARGIN  # the kill, then its processes gone
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 2 and running(started) == []  # the command and the child it started
    assert psutil.Process().children(recursive=True) == []


def test_a_command_that_fails_says_so_in_one_line(tmp_path):
    with pytest.raises(ReloadError) as caught:
        run_command([sys.executable, "-c", "print('a'); print('b'); raise SystemExit('no engine here')"],
                    time.monotonic() + 30)
    assert str(caught.value).endswith("exited with 1: a | b | no engine here") and "\n" not in str(caught.value)
    with pytest.raises(ReloadError, match="reload command /nonexistent/restart: No such file or directory"):
        run_command(["/nonexistent/restart"], time.monotonic() + 30)


def test_a_server_trickling_its_headers_is_cut_off_at_the_deadline():
    deploy = DeployConfig(reload="url", reload_url="http://127.0.0.1:1/reload", reload_timeout=2.5)
    with trickling_server(interval=1.0) as url:
        plan = plan_reload(deploy.model_copy(update={"reload_url": url}), VALUES, {"version": "2"}, "m-v2")
        start = time.monotonic()
        with pytest.raises(ReloadError, match="no whole answer from .* within monitor.deploy.reload_timeout"):
            plan.run()
    assert 2.5 - 0.1 <= time.monotonic() - start < 2.5 + MARGIN


def test_the_command_and_the_request_share_one_deadline(tmp_path):
    """The command takes most of reload_timeout; the request gets only what is left, not a deadline of its own."""
    slow = [sys.executable, "-c", "import time; time.sleep(1.5)"]
    deploy = DeployConfig(reload_command=slow, reload_url="http://127.0.0.1:1/reload", reload_timeout=2.5)
    with trickling_server(interval=0.2) as url:
        plan = plan_reload(deploy.model_copy(update={"reload_url": url}), VALUES, {}, "m-v2")
        start = time.monotonic()
        with pytest.raises(ReloadError, match="within monitor.deploy.reload_timeout"):
            plan.run()
    assert time.monotonic() - start < 2.5 + MARGIN


def test_vllm_gets_the_draft_bracket_of_its_weight_update_api():
    with recording_engine() as engine:
        done = push_to_vllm(engine.url, "/d/versions/v2", "draftops-draft-v2", time.monotonic() + 10)
    assert engine.requests == [
        ("/pause?mode=keep", None),
        ("/start_draft_weight_update", None),
        ("/update_weights", {"update_info": {"path": "/d/versions/v2"}}),
        ("/finish_weight_update", {"weight_version": "draftops-draft-v2"}),
        ("/resume", None)]
    assert done == f"vLLM at {engine.url}: draft weights loaded from /d/versions/v2 (weight version draftops-draft-v2)"


def test_a_failed_vllm_update_resumes_the_engine_it_paused():
    answers = {"/update_weights": (500, {"error": "DiskWeightTransferEngine does not support draft model weight "
                                                  "updates."})}
    with recording_engine(answers) as engine:
        with pytest.raises(ReloadError, match=r"vLLM /update_weights: .* answered HTTP 500 .*: "
                                              "DiskWeightTransferEngine does not support draft"):
            push_to_vllm(engine.url, "/d/versions/v2", "m-v2", time.monotonic() + 10)
    assert [path for path, _ in engine.requests] == ["/pause?mode=keep", "/start_draft_weight_update",
                                                      "/update_weights", "/resume"]


def test_sglang_loads_the_folder_into_the_draft_alone():
    with recording_engine() as engine:
        push_to_sglang(engine.url + "/", "/d/versions/v2", "m-v2", time.monotonic() + 10)
    assert engine.requests == [("/update_weights_from_disk",
                                {"model_path": "/d/versions/v2", "draft_only": True, "weight_version": "m-v2"})]
    refusal = {"/update_weights_from_disk": (400, {"success": False, "message": "requires a speculative draft model"})}
    with recording_engine(refusal) as engine, pytest.raises(ReloadError, match="HTTP 400 Bad Request: requires a "
                                                                               "speculative draft model"):
        push_to_sglang(engine.url, "/d/versions/v2", "m-v2", time.monotonic() + 10)
    unsure = {"/update_weights_from_disk": (200, {"success": False, "message": "Failed to update weights"})}
    with recording_engine(unsure) as engine, pytest.raises(ReloadError, match="without success: true"):
        push_to_sglang(engine.url, "/d/versions/v2", "m-v2", time.monotonic() + 10)


def test_a_vllm_plan_loads_the_version_folder_not_the_link():
    deploy = load_config(None, ["monitor.deploy.reload=vllm", "monitor.deploy.format=vllm",
                                "monitor.deploy.reload_url=http://127.0.0.1:1"]).monitor.deploy
    with recording_engine() as engine:
        plan_reload(deploy.model_copy(update={"reload_url": engine.url}), VALUES, {}, "m-v2").run()
    assert engine.requests[2] == ("/update_weights", {"update_info": {"path": VALUES["path"]}})


ESCAPE = """import os, subprocess, sys, time
stays = subprocess.Popen(["setsid", "sleep", "1000"])  # leaves the group, its parent still runs
orphan = subprocess.run(["sh", "-c", "setsid sleep 1000 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
with open(sys.argv[1], "w") as pids:
    pids.write(f"{os.getpid()} {stays.pid} {orphan.stdout.strip()}")  # the second one's parent (sh) has exited
time.sleep(1000)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the subreaper (prctl) is Linux's")
def test_a_child_that_leaves_the_group_with_setsid_is_ended_too(tmp_path):
    if not become_subreaper():  # what run_command does first; a kernel or sandbox may refuse it
        pytest.skip("prctl(PR_SET_CHILD_SUBREAPER) is refused here: an orphaned setsid child cannot be found")
    script, pids = tmp_path / "escape.py", tmp_path / "pids.txt"
    script.write_text(ESCAPE)
    with pytest.raises(ReloadError, match="still ran at monitor.deploy.reload_timeout"):
        run_command([sys.executable, str(script), str(pids)], time.monotonic() + 3.0)
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 3 and running(started) == []  # the command, its setsid child and the orphaned one
    assert psutil.Process().children(recursive=True) == []
