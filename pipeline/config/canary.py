"""`monitor.deploy.canary:` a promoted challenger deployed to a few replicas first, judged against the others on what
the engine serves, then rolled out to every replica or rolled back (monitor.check.canary; docs/deploy.md)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import HttpUrl, Section


class CanaryConfig(Section):
    replicas: list[str] = Field([], description=(
        "The canary replicas (names as in monitor.engines or Prometheus' replica label): a new champion is deployed "
        "to them alone (their own deploy folder, `dir`), and reaches the other replicas only once their windows "
        "pass. Empty: off (every replica at once)."))
    windows: int = Field(6, ge=2, description=(
        "Windows of the new champion the canary and each other replica must have before the canary is judged: its "
        "acceptance against the others' pooled (the fleet's replica-parting test), over the last this many windows. "
        "The check's report and the canary's MLflow run state the test's power at this number."))
    dir: str | None = Field(None, description=(
        "The canary replicas' deploy folder (versions/, current, previous, deploy.json, as monitor.deploy.dir): the "
        "canary serves <dir>/current. null: <monitor.deploy.dir>/canary."))
    reload: Literal["command", "url", "vllm", "sglang"] | None = Field(None, description=(
        "What reloads the canary replicas after their switch, as monitor.deploy.reload."))
    reload_command: list[str] = Field([], description=(
        "Command that reloads the canary replicas (placeholders as monitor.deploy.reload_command)."))
    reload_url: HttpUrl | None = Field(None, description=(
        "Request that reloads the canary replicas (as monitor.deploy.reload_url)."))
    speed_tolerance: float = Field(0.2, ge=0.0, lt=1.0, description=(
        "Where the engines report tokens per second, the canary fails when its mean is below (1 - this) times the "
        "other replicas' mean over the judged windows."))

    @field_validator("replicas")
    @classmethod
    def _distinct(cls, names: list[str]) -> list[str]:
        if len(set(names)) != len(names):
            raise ValueError(f"canary replicas {names} name a replica twice")
        return names

    @model_validator(mode="after")
    def _reload_is_whole(self) -> CanaryConfig:
        """A canary needs its own reload (its placeholders are checked by DeployConfig, which fills them in)."""
        if self.replicas and not (self.reload_command or self.reload_url):
            raise ValueError("monitor.deploy.canary needs reload_command or reload_url: how its replicas load a "
                             "new draft")
        return self
