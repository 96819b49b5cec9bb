"""`monitor:` and `target_update:`: the nightly drift check, its retraining and gate, and the demo's target update."""
from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.alerts import AlertsConfig
from pipeline.config.base import HttpUrl, Section
from pipeline.config.deploy import DeployConfig
from pipeline.config.fleet import EngineEndpoint, duration_seconds, unique_names

SCHEDULE_YEARS = 5  # a schedule that does not fire within this many years is refused


class MonitorConfig(Section):
    heldout_requests: int = Field(256, ge=2, description=(
        "Prompts per acceptance measurement: the baseline's held-out prompts and the most recent held-out requests. "
        "`draftops monitor simulate` shows the power this gives against a given drop."))
    level: float = Field(0.05, gt=0.0, lt=0.5, description=(
        "False-alarm level per check; split evenly (Bonferroni) between the paired and the unpaired test."))
    margin: float = Field(0.01, ge=0.0, lt=1.0, description="Tolerated drop in acceptance (absolute, 0.01 = 1 point).")
    test_method: Literal["bootstrap", "delta"] = Field(
        "bootstrap", description="Prompt-level bootstrap or delta method.")
    n_bootstrap: int = Field(2000, ge=100, description="Bootstrap resamples over prompts.")
    drift_threshold: float = Field(0.05, gt=0.0, le=1.0, description=(
        "Jensen-Shannon divergence (bits) of prompt-token frequencies above which traffic counts as shifted."))
    drift_buckets: int = Field(256, ge=2, description="Token buckets: most frequent reference tokens + 'other'.")
    break_even_alpha: float | None = Field(None, ge=0.0, le=1.0, description=(
        "Absolute alarm for a champion never benchmarked: acceptance below this makes speculative decoding no faster "
        "than the target alone. null: none until `draftops bench` (make bench) has measured the champion, whose "
        "break-even (from the run's measured c and v) is used whenever there is one; the check's report says which."))
    live_requests: int = Field(
        0, ge=0, description="Also measure live acceptance by decoding this many requests (0: off).")
    retrain: bool = Field(False, description="On DRIFT, re-distill a challenger and promote it only if it is better.")
    retrain_init: Literal["champion", "config"] = Field("champion", description=(
        "Where a challenger starts: champion, the champion's weights (distill.init=checkpoint at NAME@champion; "
        "vocabulary rows both heads share are kept); config, distill.init as configured."))
    promote_margin: float = Field(0.01, ge=0.0, lt=1.0, description=(
        "A challenger must beat the champion's acceptance by this much (paired test on the same held-out prompts)."))
    schedule: str = Field("0 2 * * *", description=(
        "Crontab expression of the scheduled check (default nightly 02:00); checked when the config is loaded."))
    timezone: str = Field("UTC", description="IANA time zone of the schedule (e.g. Europe/Paris).")
    misfire_grace_time: int = Field(3600, ge=1, description=(
        "Seconds after its time a missed check (service down) still runs, once, when the service comes back."))
    state_dir: str = Field("outputs/monitor", description=(
        "Job store (jobs.sqlite), check lock, reports and the server metrics' windows (server_metrics.json)."))
    lock_timeout: float = Field(0.0, ge=0.0, description=(
        "Seconds a check waits for another check or retrain to finish; 0 skips immediately."))
    simulate_checks: int = Field(200, ge=1, description="Simulated checks per point in `draftops monitor simulate`.")
    simulate_drops: list[float] = Field([0.02, 0.05, 0.10], description="Drops (absolute) whose power is simulated.")
    server_metrics_url: HttpUrl | None = Field(None, description=(
        "Prometheus endpoint of the engine serving the champion (vLLM /metrics, llama-server --metrics): shorthand "
        "for monitor.engines=[{url: URL, model: monitor.server_model_name}]. null: off (unless monitor.engines)."))
    server_model_name: str | None = Field(None, description=(
        "Read only the counters labelled with this model_name (vLLM's served model name); null: the sum over all."))
    server_baseline_windows: int = Field(24, ge=2, description=(
        "Windows closed while a version is champion that form its server baseline (per replica): 24 hourly windows "
        "are a day, so that a daily cycle of the traffic cannot pass for a drop (docs/deploy.md). With one window a "
        "check (scrape_interval_minutes 0, no Prometheus), fewer: e.g. 7."))
    server_recent_windows: int = Field(24, ge=2, description=(
        "Latest windows compared with the server baseline (permutation test over windows, at monitor.level and "
        "monitor.margin, split over the replicas); a day of hourly windows by default (e.g. 3 with one window a "
        "check); `draftops monitor simulate --server` shows its false-alarm rate and power."))
    server_timeout: float = Field(10.0, gt=0.0, description=(
        "Seconds the whole scrape of the metrics endpoint may take (connecting, headers and body): an endpoint "
        "that answers slowly is cut off at this deadline and the check goes on without it."))
    engines: list[EngineEndpoint] = Field([], description=(
        "The serving replicas, each {url, kind: auto|vllm|sglang|llamacpp, replica: NAME, model: NAME, per_core: "
        "false}: every replica gets its own windows and verdict (OK, DRIFT, idle, unreachable, DEPLOY_MISMATCH), "
        "the fleet an aggregate, and a replica whose acceptance parts from the others' is named (docs/deploy.md)."))
    prometheus_url: HttpUrl | None = Field(None, description=(
        "Base URL of a Prometheus that scrapes the engines (e.g. http://prometheus:9090): windows come from its HTTP "
        "API (/api/v1/query_range, increase() over prometheus_window), so the first check already has a baseline's "
        "worth of them. null: the monitor scrapes the engines itself (scrape_interval_minutes)."))
    prometheus_window: str = Field("1h", description=(
        "Length of one window read from Prometheus, also the query step (a duration: 15m, 1h, 1d): several of its "
        "scrape intervals (increase() needs two samples in a window)."))
    prometheus_replica_label: str = Field("instance", description=(
        "The label that tells replicas apart in Prometheus (instance, pod, ...); its values are the replica names."))
    prometheus_selector: str = Field("", description=(
        "Extra label matchers added to every Prometheus query, e.g. job=\"vllm\",namespace=\"prod\"."))
    replica_down_checks: int = Field(2, ge=1, description=(
        "Checks in a row that must find a replica unreachable (not scraped, or its Prometheus `up` 0) before it is "
        "down: a DraftReplicaDown alert, and the check's verdict REPLICA_DOWN (exit 6) where it would be OK. With a "
        "nightly check, 2 is a day: the shipped Prometheus rules (configs/prometheus-rules.yaml) page sooner."))
    scrape_interval_minutes: float = Field(60.0, ge=0.0, description=(
        "Without Prometheus, `monitor serve` scrapes the engines every this many minutes into the local window store "
        "(<state_dir>/server_metrics.json), so windows are this long; a check scrapes too when the last scrape is "
        "older. 0: only the checks scrape (one window per check)."))
    engine_boundary: str | None = Field(None, description=(
        "The result file of `draftops engine sweep` (engine_sweep.json): where the engines report running requests, "
        "a replica whose window ran more at once than the concurrency where speculation stopped paying is a note in "
        "the check's report and a gauge on the service's /metrics, never a DRIFT. null: not watched."))
    deploy: DeployConfig = DeployConfig()
    alerts: AlertsConfig = AlertsConfig()
    metrics_port: int = Field(9464, ge=0, le=65535, description=(
        "Port of `draftops monitor serve`'s own Prometheus /metrics and /healthz; 0: off."))
    metrics_bind: str = Field("127.0.0.1", description=(
        "Address the service's /metrics listens on (0.0.0.0 to let a remote Prometheus scrape it)."))

    def replica_endpoints(self) -> list[EngineEndpoint]:
        """`engines`, or the one endpoint `server_metrics_url` stands for; empty when neither is set."""
        if self.engines:
            return list(self.engines)
        if self.server_metrics_url:
            return [EngineEndpoint(url=self.server_metrics_url, model=self.server_model_name)]
        return []

    @model_validator(mode="after")
    def _fleet(self) -> MonitorConfig:
        seconds = duration_seconds(self.prometheus_window)
        if seconds < 10:
            raise ValueError(f"prometheus_window {self.prometheus_window!r}: at least 10s (a window needs several of "
                             "Prometheus' scrapes)")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.prometheus_replica_label):
            raise ValueError(f"prometheus_replica_label {self.prometheus_replica_label!r} is not a label name")
        if self.engines and self.server_metrics_url:
            raise ValueError("set monitor.engines or monitor.server_metrics_url (its one-engine shorthand), not both")
        unique_names(self.engines, self.prometheus_url is not None)
        return self

    @field_validator("timezone")
    @classmethod
    def _known_timezone(cls, name: str) -> str:
        import zoneinfo

        try:
            zoneinfo.ZoneInfo(name)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"unknown time zone {name!r} (an IANA name such as UTC or Europe/Paris)") from None
        return name

    @field_validator("schedule")
    @classmethod
    def _valid_schedule(cls, expression: str) -> str:
        from datetime import datetime, timedelta, timezone

        from apscheduler.triggers.cron import CronTrigger

        try:
            trigger = CronTrigger.from_crontab(expression, timezone="UTC")
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{expression!r} is not a crontab expression (minute hour day month weekday, e.g. "
                             f"'0 2 * * *'): {exc}") from None
        now = datetime.now(timezone.utc)
        fires = trigger.get_next_fire_time(None, now)
        if fires is None or fires > now + timedelta(days=365 * SCHEDULE_YEARS):
            raise ValueError(f"{expression!r} never fires in the next {SCHEDULE_YEARS} years (a day the month does "
                             "not have?): the service would wait forever")
        return expression


class TargetUpdateConfig(Section):
    """`draftops target finetune`: an updated target, for rehearsing a target change (LoRA on the target's own
    responses in another style, merged into a new checkpoint)."""

    prompts: str = Field("traffic", description=(
        "'traffic': the train split of the configured traffic (the responses distill generated are reused from "
        "the cache); else a traffic-format JSONL read by path, e.g. ../shared/data/gsm8k_train.jsonl."))
    max_prompts: int = Field(256, ge=0, description=(
        "Prompts used from a file; 0: all. The traffic's train split is used whole, as distill uses it."))
    style: Literal["uppercase", "prefix"] = Field("uppercase", description=(
        "uppercase: the responses in ALL CAPS; prefix: every response starts with `prefix`."))
    prefix: str = Field("Certainly! Here is a clear and complete answer.", description="Opening of style=prefix.")
    steps: int = Field(30, ge=1, description="Optimizer steps.")
    batch_size: int = Field(4, ge=1)
    learning_rate: float = Field(2e-3, gt=0.0)
    max_seq_tokens: int = Field(192, ge=16, description="Prompt + styled response longer than this are cut.")
    lora_last_layers: int = Field(10, ge=0, description=(
        "Adapt only the last N decoder layers (the backward pass stops below them); 0: every layer."))
    lora_r: int = Field(16, ge=1)
    lora_alpha: int = Field(32, ge=1)
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    lora_target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], min_length=1)
    output_dir: str = Field("outputs/target-updated", description="Where the merged checkpoint is written.")


