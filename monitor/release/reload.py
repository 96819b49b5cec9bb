"""The reload action of a deploy (`monitor.deploy.reload`), planned before anything is flipped and run once the switch
is done, under one deadline.

`plan_reload` expands the placeholders of `reload_command` ({path} {file} {version} {current}, and nothing else:
`pipeline.config.deploy.expand_placeholders`) and fixes the requests, so that a command that cannot be built fails
before `current` moves. `ReloadPlan.run` runs the plan with a single deadline, `reload_timeout`, shared by the command
and the requests. The command runs in a process group of its own (a new session), killed whole past the deadline
(then waited for up to GROUP_GONE_SECONDS while its processes die), so neither it nor what it started is left
behind. A process it starts that leaves the group (`setsid`) is found among this process's descendants and killed
too: on Linux this process is made a child subreaper (prctl PR_SET_CHILD_SUBREAPER), so that such a process stays a
descendant even once its parent has exited; where that is not available (other systems) only descendants whose
parents still run are found. Each request is cut off at the deadline however slowly its server answers
(`monitor.release.runtime_reload`).
A command that ends in time is never killed: a restart may leave its server running.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil

from monitor.release.runtime_reload import ReloadError, push_to_sglang, push_to_vllm, send_deployment
from pipeline.config.deploy import RELOAD_PLACEHOLDERS, DeployConfig, expand_placeholders

OUTPUT_TAIL_BYTES = 4000
GROUP_GONE_SECONDS = 1.0  # how long a killed group's other processes are waited for (their new parent reaps them)
PR_SET_CHILD_SUBREAPER = 36  # prctl(2), Linux


@dataclass(frozen=True)
class ReloadPlan:
    """What the reload runs, in order; each step takes the deadline and says what it did in one line."""

    steps: tuple[tuple[str, Callable[[float], str]], ...]
    timeout: float

    def run(self) -> list[str]:
        deadline = time.monotonic() + self.timeout
        return [step(deadline) for _, step in self.steps]


def command_of(d: DeployConfig, values: dict[str, str]) -> list[str]:
    """`reload_command` with its placeholders filled in; ReloadError naming the argument that is not allowed."""
    try:
        return [expand_placeholders(part, values) for part in d.reload_command]
    except ValueError as exc:
        raise ReloadError(f"monitor.deploy.reload_command: {exc}") from None


def check_reload(d: DeployConfig) -> None:
    """Refuse a reload command that cannot be built, before a deploy writes anything."""
    command_of(d, dict.fromkeys(RELOAD_PLACEHOLDERS, ""))


def plan_reload(d: DeployConfig, values: dict[str, str], deployment: dict, weight_version: str) -> ReloadPlan:
    """The steps of `d.reload` for one deployment: `values` fill the placeholders, `deployment` is the plain
    request's JSON body; vLLM and SGLang load the folder `values["path"]`."""
    steps: list[tuple[str, Callable[[float], str]]] = []
    if d.reload in (None, "command") and d.reload_command:
        argv = command_of(d, values)
        steps.append(("command", lambda deadline: run_command(argv, deadline)))
    if d.reload in (None, "url") and d.reload_url:
        steps.append(("url", lambda deadline: send_deployment(d.reload_method, d.reload_url, deployment, deadline)))
    if d.reload == "vllm":
        steps.append(("vllm", lambda deadline: push_to_vllm(d.reload_url, values["path"], weight_version, deadline)))
    if d.reload == "sglang":
        steps.append(("sglang", lambda deadline: push_to_sglang(d.reload_url, values["path"], weight_version,
                                                                deadline)))
    return ReloadPlan(tuple(steps), d.reload_timeout)


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux 3.4+): orphaned descendants are reparented here, not to init, so a
    command's `setsid` child that outlives its parent can still be found and ended. False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _descendants(before: set[int]) -> list[psutil.Process]:
    """This process's descendants that did not exist before the command started (`before`: their pids then)."""
    with contextlib.suppress(psutil.Error):
        return [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    return []


def _kill_group(process: subprocess.Popen, before: set[int] = frozenset()) -> None:
    """SIGKILL to the command's whole process group (it leads a session of its own) and to every descendant it started
    that left the group, reap it, and wait (briefly) until the processes it started are gone too."""
    strays = _descendants(set(before) | {process.pid})
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    for stray in strays:
        with contextlib.suppress(psutil.Error):
            stray.kill()
    process.wait()
    gone_by = time.monotonic() + GROUP_GONE_SECONDS
    psutil.wait_procs(strays, timeout=GROUP_GONE_SECONDS)  # reaps the strays reparented here
    while time.monotonic() < gone_by:
        try:
            os.killpg(process.pid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.02)


def run_command(argv: list[str], deadline: float) -> str:
    """Run `argv` until it exits or the deadline passes (then its process group is killed); ReloadError with the
    last lines it printed when it fails."""
    shown = shlex.join(argv)
    with tempfile.TemporaryFile() as output:  # a file, not a pipe: a server it starts may keep it open
        become_subreaper()
        before = {p.pid for p in _descendants(set())}
        try:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        except OSError as exc:
            raise ReloadError(f"reload command {argv[0]}: {exc.strerror or exc}") from None
        try:
            code = process.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            _kill_group(process, before)
            raise ReloadError(f"reload command {shown} still ran at monitor.deploy.reload_timeout: its process "
                              "group was killed") from None
        except BaseException:
            _kill_group(process, before)
            raise
        output.seek(max(output.seek(0, os.SEEK_END) - OUTPUT_TAIL_BYTES, 0))
        tail = [line.strip() for line in output.read().decode(errors="replace").splitlines() if line.strip()]
    if code != 0:
        said = f": {' | '.join(tail[-3:])}" if tail else ""
        raise ReloadError(f"reload command {shown} exited with {code}{said}")
    return f"ran {shown}"
