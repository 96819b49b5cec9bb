"""The whole run's config: the target, device and precision, and one section per stage (`DraftopsConfig`)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import Section
from pipeline.config.decode import DecodeConfig
from pipeline.config.distill import DistillConfig
from pipeline.config.monitor import MonitorConfig, TargetUpdateConfig
from pipeline.traffic_records import COLUMN_NAMES
from pipeline.url_credentials import redact_tree


class TrafficConfig(Section):
    path: str = Field("default", description=(
        "Traffic: a JSONL log, a ShareGPT JSON file, a saved `datasets` folder, parquet or arrow files, or a glob of "
        "them (.gz too); 'default' is the traffic shipped with draftops. docs/data.md."))
    columns: dict[str, str] = Field({}, description=(
        "A data set's own column names for draftops' fields: messages, id, category, time "
        "(e.g. {messages: conversation, id: uuid}); unnamed ones are read under draftops' names."))
    heldout_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Share of request ids held out (by hash).")
    max_prompt_tokens: int = Field(512, ge=8, description=(
        "Prompts longer than this keep their last tokens; a conversation is cut to 32 characters per token of this "
        "budget before it is tokenized, so one huge request costs no more memory than the budget."))
    max_line_bytes: int = Field(64 << 20, ge=1024, description=(
        "A traffic line longer than this (bytes) is malformed, read in pieces and never held whole: with the cut "
        "above, what bounds the memory one request can take."))
    skip_malformed: bool = Field(False, description="Skip and count malformed lines instead of failing.")
    since: str | float | None = Field(None, description=(
        "Keep requests logged at or after this time (ISO-8601, or epoch seconds/milliseconds); null: no bound."))
    until: str | float | None = Field(None, description="Keep requests logged before this time; null: no bound.")
    reasoning: Literal["template", "keep", "strip"] = Field("template", description=(
        "Think blocks and `reasoning_content`: template: as logged, the template's own default for thinking; keep: "
        "earlier replies keep their reasoning and enable_thinking is on; strip: reasoning dropped and "
        "enable_thinking off (a template that does not read it ignores it). docs/data.md."))
    chat_template: str | None = Field(None, description=(
        "A Jinja chat template file, the one the serving engine renders with (vLLM's and SGLang's --chat-template); "
        "null: the target tokenizer's. Used by distill, held-out measurement and the monitor."))
    served_by: str | None = Field(None, description=(
        "The model the log's replies were served by (its source or fingerprint), for distill.responses.source="
        "recorded: any model but the target is refused."))
    turns: Literal["last", "all"] = Field("last", description=(
        "last: each request is its last turn (the next assistant reply); all: every assistant turn of a conversation "
        "is a training target, generated turn by turn against the target's own earlier replies (or the logged ones "
        "with distill.responses.source=recorded), and held-out α is reported per turn position. docs/data.md."))

    @field_validator("columns")
    @classmethod
    def _known_columns(cls, columns: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(columns) - set(COLUMN_NAMES))
        if unknown:
            raise ValueError(f"traffic.columns names {unknown}: draftops' fields are {list(COLUMN_NAMES)}")
        return columns


class TrackingConfig(Section):
    uri: str | None = Field(None, description="MLflow tracking URI; else $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db.")
    registered_model: str = Field("draftops-draft", description=(
        "Registered model that holds the draft versions (no '/', '\\', '@', ':' or '..': it names URIs and the "
        "model's lock file)."))
    system_metrics: bool = Field(True, description="Log CPU/GPU/memory usage with every run.")
    http_timeout: int = Field(10, ge=1, description=(
        "Seconds one request to a tracking server may take, its whole answer (MLFLOW_HTTP_REQUEST_TIMEOUT, unless "
        "set in the environment); also the deadline of the /health and API check every tracked command starts "
        "with."))
    http_retries: int = Field(2, ge=0, description=(
        "Retries of a failed request to a tracking server (MLFLOW_HTTP_REQUEST_MAX_RETRIES, unless set in the "
        "environment; MLflow's own default retries for minutes)."))
    lock_timeout: float = Field(1800.0, ge=0.0, description=(
        "Seconds a registration (or an alias move) waits for the registered model's lock, held by a check with its "
        "retraining, before it gives up with one line; the draft stays in its job folder for `draftops distill "
        "--register-only`."))

    @field_validator("registered_model")
    @classmethod
    def _usable_name(cls, name: str) -> str:
        bad = [c for c in ("/", "\\", "@", ":", "..") if c in name]
        if not name.strip() or bad or any(ord(c) < 32 for c in name):
            raise ValueError(f"{name!r} is not a usable registered model name"
                             + (f" (it holds {' and '.join(repr(b) for b in bad)})" if bad else ""))
        return name



class DraftopsConfig(Section):
    target: str = Field("smollm2-135m-instruct", description="Target model source (see `draftops models info`).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="'auto' lets accelerate pick.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto': float32 on CPU, bfloat16 on CUDA.")
    cpu_linear: Literal["auto", "onednn", "torch"] = Field("auto", description=(
        "fp32 linear layers on CPU at inference: oneDNN on weights packed once, torch's own (MKL), or 'auto': per "
        "weight shape and row count the one measured faster on this CPU (measured at the first load, cached under "
        "$DRAFTOPS_HOME/machine_choice/cpu_linear; `draftops models info SOURCE --kernels` shows it). "
        "docs/concepts.md#the-cpu-runtime."))
    seed: int = 0
    traffic: TrafficConfig = TrafficConfig()
    tracking: TrackingConfig = TrackingConfig()
    decode: DecodeConfig = DecodeConfig()
    distill: DistillConfig = DistillConfig()
    monitor: MonitorConfig = MonitorConfig()
    target_update: TargetUpdateConfig = TargetUpdateConfig()

    @model_validator(mode="after")
    def _turns_for_layer_drafts(self) -> DraftopsConfig:
        if self.traffic.turns == "all" and self.distill.family == "features":
            raise ValueError("traffic.turns=all trains layer drafts (distill.family=layers): a feature draft's "
                             "target features are cached for one response set per prompt")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain data, for files, logs and MLflow: credentials in any URL are hidden
        (`pipeline.url_credentials`)."""
        return redact_tree(self.model_dump(mode="json"))

