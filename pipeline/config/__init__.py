"""Typed run configuration: YAML files in `configs/` plus dotted `key=value` overrides (`load_config`).

One module per section of the schema (`decode`, `distill`, `monitor`, and `run` for the whole file); `loading` reads,
merges and validates. The names below are the package's public API.
"""
from pipeline.config.base import ConfigError, Section
from pipeline.config.decode import AUTO, DEFAULT_TREE_BUDGET_SCHEDULE, DecodeConfig
from pipeline.config.deploy import DeployConfig
from pipeline.config.distill import DistillConfig, LossName
from pipeline.config.engine import ResponsesConfig
from pipeline.config.loading import (
    DEFAULT_CONFIG_PATH,
    REPO_CONFIGS,
    iter_fields,
    load_config,
    parse_overrides,
    reference_markdown,
    save_config,
    validated_update,
)
from pipeline.config.monitor import MonitorConfig, TargetUpdateConfig
from pipeline.config.run import DraftopsConfig, TrackingConfig, TrafficConfig

__all__ = [
    "AUTO", "DEFAULT_CONFIG_PATH", "DEFAULT_TREE_BUDGET_SCHEDULE", "REPO_CONFIGS", "ConfigError", "DecodeConfig",
    "DeployConfig", "DistillConfig", "DraftopsConfig", "LossName", "MonitorConfig", "ResponsesConfig", "Section",
    "TargetUpdateConfig", "TrackingConfig", "TrafficConfig", "iter_fields", "load_config", "parse_overrides",
    "reference_markdown", "save_config", "validated_update",
]
