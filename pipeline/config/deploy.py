"""`monitor.deploy:`: the champion exported into a deploy folder after every promotion and rollback, the serving engine
reloaded, and the engine's acceptance checked against what the draft measured offline (monitor.release)."""
from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import HttpUrl, Section
from pipeline.config.canary import CanaryConfig

RELOAD_PLACEHOLDERS = ("path", "file", "version", "current")
_ALLOWED = ", ".join("{" + name + "}" for name in RELOAD_PLACEHOLDERS)


def expand_placeholders(text: str, values: Mapping[str, str]) -> str:
    """`text` with each documented placeholder ({path} {file} {version} {current}) replaced by its value, and `{{`
    `}}` written as a literal brace. ValueError, in one line, for anything else: an unknown name, attribute access or
    an index ({path.x}, {path[0]}), a conversion or a format spec ({version!r}, {version:>99}), a lone brace. Never
    `str.format` on config text, which would run those."""
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc} (a literal brace is written {{{{ or }}}})") from None
    out = []
    for literal, name, spec, conversion in parsed:
        out.append(literal)
        if name is None:
            continue
        if name not in RELOAD_PLACEHOLDERS or spec or conversion:
            field = name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "")
            raise ValueError(f"{text!r}: {{{field}}} is not a placeholder: only {_ALLOWED}, "
                             "as they are (a literal brace is written {{ or }})")
        out.append(values[name])
    return "".join(out)


class DeployConfig(Section):
    enabled: bool = Field(False, description=(
        "After a promotion or a rollback, export the champion into `dir` (a new folder per version, then the "
        "`current` link flipped) and run the reload action. `draftops monitor deploy` does it on demand."))
    dir: str = Field("outputs/deploy", description=(
        "Deploy root: versions/v<N>/ per deployed version, `current` and `previous` links, deploy.json (state)."))
    format: Literal["gguf", "vllm", "speculators", "hf"] = Field("gguf", description=(
        "Export format (`draftops export --format`): gguf for llama.cpp, vllm or speculators for vLLM, hf for "
        "transformers."))
    gguf_dtype: Literal["f16", "f32", "q8_0"] = Field("f16", description="Matrix type of a GGUF draft.")
    gguf_vocabulary: str | None = Field(None, description=(
        "The target GGUF whose vocabulary a GGUF draft carries (a named GGUF such as smollm2-135m-instruct, or a "
        ".gguf path); null: the configured target, which must then be a GGUF."))
    keep: int = Field(3, ge=2, description="Deployments kept under versions/ (current and previous always are).")
    reload: Literal["command", "url", "vllm", "sglang"] | None = Field(None, description=(
        "What reloads the engine after the switch: command (reload_command), url (a request to reload_url with the "
        "deployment as its JSON body), vllm or sglang (the new draft's weights loaded into the running engine "
        "through its weight-update endpoints at reload_url, its base URL; docs/deploy.md). null: reload_command, "
        "then the reload_url request, each when set."))
    reload_command: list[str] = Field([], description=(
        "Command run after the switch (argv list; {path} the deployed folder, {file} its GGUF file, {version}, "
        "{current} the `current` link, nothing else; a literal brace is written {{ or }}), e.g. a restart of "
        "llama-server. Empty: none."))
    reload_url: HttpUrl | None = Field(None, description=(
        "HTTP request sent after the switch (and after reload_command), with the deployment as a JSON body; the "
        "engine's base URL with reload vllm or sglang."))
    reload_method: Literal["POST", "PUT", "GET"] = Field("POST", description="Method of the reload request.")
    reload_timeout: float = Field(300.0, gt=0.0, description=(
        "Seconds the whole reload may take (the command and the requests together, connecting, headers and body); "
        "past it the command's process group is killed and the request cut off."))
    engine_check: Literal["after_deploy", "always", "off"] = Field("after_deploy", description=(
        "When a check reads the engine's counters over `check_windows` windows and compares its acceptance with "
        "the champion's offline figure: the first check after a deploy (post-deploy check), every check, or never. "
        "Needs monitor.server_metrics_url."))
    check_windows: int = Field(3, ge=2, description="Windows of engine counters the engine check reads.")
    check_window_seconds: float = Field(60.0, gt=0.0, description="Length of one engine-check window (seconds).")
    min_window_draft_tokens: int = Field(50, ge=1, description=(
        "A window with fewer draft tokens (little traffic) is read again, up to 3 times its length."))
    mismatch_tolerance: float = Field(0.25, ge=0.0, lt=1.0, description=(
        "Tolerated shortfall of the engine's acceptance, as a share of the draft's offline figure (0.25: the engine "
        "may count down to 75% of it): engines compute in their own precision, and near-tied tokens flip; a wrong "
        "or stale draft loses far more."))
    rollback_on_mismatch: bool = Field(False, description=(
        "On DEPLOY_MISMATCH, switch `current` back to the previous deployment and run the reload action again."))
    canary: CanaryConfig = CanaryConfig()

    @field_validator("engine_check", mode="before")
    @classmethod
    def _off_is_not_false(cls, value):
        """YAML reads a bare `off` (in a file or as `monitor.deploy.engine_check=off`) as false: it means "off"."""
        return "off" if value is False else value

    @field_validator("reload_command")
    @classmethod
    def _documented_placeholders(cls, argv: list[str]) -> list[str]:
        for part in argv:
            expand_placeholders(part, dict.fromkeys(RELOAD_PLACEHOLDERS, ""))
        return argv

    @field_validator("canary")
    @classmethod
    def _canary_placeholders(cls, canary: CanaryConfig) -> CanaryConfig:
        cls._documented_placeholders(canary.reload_command)
        return canary

    @model_validator(mode="after")
    def _reload_is_whole(self) -> DeployConfig:
        needs = {"command": ("reload_command", self.reload_command), "url": ("reload_url", self.reload_url),
                 "vllm": ("reload_url", self.reload_url), "sglang": ("reload_url", self.reload_url)}
        if self.reload is None:
            return self
        key, value = needs[self.reload]
        if not value:
            raise ValueError(f"reload {self.reload} needs monitor.deploy.{key}")
        unused = "reload_url" if self.reload == "command" else "reload_command"
        if getattr(self, unused):
            raise ValueError(f"reload {self.reload} does not use monitor.deploy.{unused}: unset it, or set reload: "
                             "null to run the command and then the request")
        if self.reload in ("vllm", "sglang") and self.format == "gguf":
            raise ValueError(f"reload {self.reload} loads a safetensors folder: format gguf is for llama.cpp (use "
                             "vllm, speculators or hf)")
        return self
