"""`monitor.alerts:` and the service's own metrics endpoint: where the monitor service reports its verdicts
(monitor.service.alerts) and on which address it exposes Prometheus metrics (monitor.service.exporter)."""
from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from pipeline.config.base import Section, http_url

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


class AlertTarget(Section):
    kind: Literal["alertmanager", "webhook", "slack"] = Field(description=(
        "alertmanager: POST <url>/api/v2/alerts (Alertmanager API v2); webhook: a generic JSON body; slack: an "
        "incoming webhook's {\"text\": ...}."))
    url: str = Field(description=(
        "Alertmanager base URL (http://127.0.0.1:9093), or the webhook's URL; `{secret}` in it is replaced by the "
        "value of `secret_env` (the secret part of a Slack webhook URL)."))
    secret_env: str | None = Field(None, description=(
        "Name of the environment variable holding the token (sent as `Authorization: Bearer`) or the URL's secret "
        "part (when the URL has `{secret}`); the secret itself never goes in the config or MLflow."))

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        http_url(url.replace("{secret}", "secret"))
        return url

    @field_validator("secret_env")
    @classmethod
    def _env_name(cls, name: str | None) -> str | None:
        if name is not None and not ENV_NAME.fullmatch(name):
            raise ValueError(f"{name!r} is not an environment variable name (the secret goes in the environment, "
                             "its name here)")
        return name


class AlertsConfig(Section):
    targets: list[AlertTarget] = Field([], description=(
        "Where alerts go: on DRIFT, ERROR, DEPLOY_MISMATCH, DEPLOY_FAILED, a promotion, a rollback, and when no check "
        "has succeeded for `stale_after_hours`. Empty: no alerts."))
    stale_after_hours: float = Field(36.0, gt=0.0, description=(
        "Hours without a successful check after which the service sends a MonitorStale alert (once per stale spell)."))
    tries: int = Field(3, ge=1, description="Attempts per target and alert batch.")
    deadline: float = Field(10.0, gt=0.0, description=(
        "Seconds all attempts to one target may take together; past it the alert counts as failed."))
