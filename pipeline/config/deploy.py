"""`monitor.deploy:`: the champion exported into a deploy folder after every promotion and rollback, the serving engine
reloaded, and the engine's acceptance checked against what the draft measured offline (monitor.deploy)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.config.base import Section


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
    reload_command: list[str] = Field([], description=(
        "Command run after the switch (argv list; {path} the deployed folder, {file} its GGUF file, {version}, "
        "{current} the `current` link), e.g. a restart of llama-server. Empty: none."))
    reload_url: str | None = Field(None, description=(
        "HTTP request sent after the switch (and after reload_command), with the deployment as a JSON body."))
    reload_method: Literal["POST", "PUT", "GET"] = Field("POST", description="Method of the reload request.")
    reload_timeout: float = Field(300.0, gt=0.0, description="Seconds the reload command or request may take.")
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
