"""The champion in the MLflow model registry: its baseline, promotion and rollback (aliases, not stages).

`champion` is what serves; `previous-champion` is where `rollback` goes; `challenger` is a new
distillation waiting for the gate. A version's baseline (per-prompt acceptance on held-out
prompts, the target fingerprint it was measured with, the prompts' token frequencies) is a JSON
artifact of the monitor run that measured it; the version's tag points to that run.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone

from monitor.measure import Measurement

CHAMPION, PREVIOUS, CHALLENGER = "champion", "previous-champion", "challenger"
TARGET_FINGERPRINT_TAG = "draftops.target_fingerprint"  # set by distill when it registers a version
BASELINE_RUN_TAG = "draftops.monitor.baseline_run_id"
BASELINE_ARTIFACT = "monitor/baseline.json"


class RegistryError(RuntimeError):
    """The registry lacks what the monitor needs (no champion, nothing to roll back to)."""


@dataclass
class Baseline:
    target_fingerprint: str
    measurement: Measurement
    created: str

    def to_dict(self) -> dict:
        return {"target_fingerprint": self.target_fingerprint, "created": self.created,
                "measurement": self.measurement.to_dict()}

    @classmethod
    def from_dict(cls, data: dict) -> Baseline:
        return cls(data["target_fingerprint"], Measurement.from_dict(data["measurement"]), data["created"])


def new_baseline(target_fingerprint: str, measurement: Measurement) -> Baseline:
    return Baseline(target_fingerprint, measurement, datetime.now(timezone.utc).isoformat(timespec="seconds"))


@dataclass(frozen=True)
class RegisteredVersion:
    name: str
    version: str  # MLflow returns versions as int or str depending on the call; always str here
    tags: dict[str, str]


def _client():
    from mlflow import MlflowClient

    return MlflowClient()


def version_by_alias(name: str, alias: str) -> RegisteredVersion | None:
    """The version behind NAME@alias, or None."""
    from mlflow.exceptions import MlflowException

    try:
        found = _client().get_model_version_by_alias(name, alias)
    except MlflowException:
        return None
    return RegisteredVersion(found.name, str(found.version), dict(found.tags or {}))


def champion(name: str) -> RegisteredVersion:
    version = version_by_alias(name, CHAMPION)
    if version is None:
        raise RegistryError(f"registered model '{name}' has no '{CHAMPION}' alias; run `draftops distill` first")
    return version


def save_baseline(name: str, version: str, baseline: Baseline) -> None:
    """Log the baseline into the active (monitor) run and point the version at it."""
    import mlflow

    run = mlflow.active_run()
    if run is None:
        raise RuntimeError("save_baseline needs an active MLflow run")
    mlflow.log_dict(baseline.to_dict(), BASELINE_ARTIFACT)
    _client().set_model_version_tag(name, version, BASELINE_RUN_TAG, run.info.run_id)


def load_baseline(model_version) -> Baseline | None:
    import mlflow

    run_id = model_version.tags.get(BASELINE_RUN_TAG)
    if not run_id:
        return None
    return Baseline.from_dict(mlflow.artifacts.load_dict(f"runs:/{run_id}/{BASELINE_ARTIFACT}"))


def break_even(model_version, default: float) -> tuple[float, str]:
    """The version's measured break-even acceptance (its latest `draftops bench`), else `default` from the config."""
    from mlflow import MlflowClient

    from pipeline import metrics as M

    run_id = model_version.tags.get(M.LATEST_BENCH_RUN_TAG)
    if run_id:
        measured = MlflowClient().get_run(run_id).data.metrics.get(M.BREAK_EVEN_ALPHA)
        if measured is not None:
            return float(measured), f"bench run {run_id}"
    return default, "monitor.break_even_alpha"


def promote(name: str, version: str) -> str | None:
    """Make `version` the champion; the old champion becomes previous-champion. Returns the old champion."""
    client = _client()
    old = version_by_alias(name, CHAMPION)
    if old is not None and old.version == str(version):
        return None
    if old is not None:
        client.set_registered_model_alias(name, PREVIOUS, old.version)
    client.set_registered_model_alias(name, CHAMPION, str(version))
    challenger = version_by_alias(name, CHALLENGER)
    if challenger is not None and challenger.version == str(version):
        client.delete_registered_model_alias(name, CHALLENGER)
    client.set_model_version_tag(name, str(version), "draftops.monitor.promoted_at",
                                 datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return old.version if old is not None else None


def rollback(name: str, to_version: str | None = None) -> str:
    """Point champion back at previous-champion (or `to_version`); the two aliases swap. Returns the new champion."""
    client = _client()
    current = champion(name)
    if to_version is None:
        previous = version_by_alias(name, PREVIOUS)
        if previous is None:
            raise RegistryError(f"registered model '{name}' has no '{PREVIOUS}' alias to roll back to")
        to_version = previous.version
    to_version = str(to_version)
    client.get_model_version(name, to_version)  # fails loudly on a version that does not exist
    if to_version == current.version:
        return to_version
    client.set_registered_model_alias(name, CHAMPION, to_version)
    client.set_registered_model_alias(name, PREVIOUS, current.version)
    client.set_model_version_tag(name, current.version, "draftops.monitor.rolled_back_at",
                                 datetime.now(timezone.utc).isoformat(timespec="seconds"))
    return to_version
