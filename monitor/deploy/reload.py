"""The reload action of a deploy (`monitor.deploy.reload`), planned before anything is flipped and run once the switch
is done, under one deadline.

`plan_reload` expands the placeholders of `reload_command` ({path} {file} {version} {current}, and nothing else:
`pipeline.config.deploy.expand_placeholders`) and fixes the requests, so that a command that cannot be built fails
before `current` moves. `ReloadPlan.run` runs the plan with a single deadline, `reload_timeout`, shared by the command
and the requests. The command runs in a process group of its own (a new session), killed whole past the deadline
(then waited for up to GROUP_GONE_SECONDS while its processes die), so neither it nor what it started is left
behind; each request is cut off at the deadline however slowly its server answers (`monitor.deploy.runtime_reload`).
A command that ends in time is never killed: a restart may leave its server running.
"""
from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from monitor.deploy.runtime_reload import ReloadError, push_to_sglang, push_to_vllm, send_deployment
from pipeline.config.deploy import RELOAD_PLACEHOLDERS, DeployConfig, expand_placeholders

OUTPUT_TAIL_BYTES = 4000
GROUP_GONE_SECONDS = 1.0  # how long a killed group's other processes are waited for (their new parent reaps them)


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


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL to the command's whole process group (it leads a session of its own), reap it, and wait (briefly) until
    the processes it started are gone too."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    gone_by = time.monotonic() + GROUP_GONE_SECONDS
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
        try:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT,
                                       start_new_session=True)
        except OSError as exc:
            raise ReloadError(f"reload command {argv[0]}: {exc.strerror or exc}") from None
        try:
            code = process.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            _kill_group(process)
            raise ReloadError(f"reload command {shown} still ran at monitor.deploy.reload_timeout: its process "
                              "group was killed") from None
        except BaseException:
            _kill_group(process)
            raise
        output.seek(max(output.seek(0, os.SEEK_END) - OUTPUT_TAIL_BYTES, 0))
        tail = [line.strip() for line in output.read().decode(errors="replace").splitlines() if line.strip()]
    if code != 0:
        said = f": {' | '.join(tail[-3:])}" if tail else ""
        raise ReloadError(f"reload command {shown} exited with {code}{said}")
    return f"ran {shown}"
