"""What `draftops report` reads of the registry: every version of a model with the metrics of the runs its tags link
to (`pipeline.registry` names them)."""
from __future__ import annotations

from dataclasses import dataclass

from pipeline import metrics as M


@dataclass(frozen=True)
class VersionRecord:
    """One version with what its tags link to: the metrics of the run that made it and of its latest eval and bench
    (empty for a run that is missing or deleted)."""

    version: str
    aliases: list[str]
    created_ms: int | None
    tags: dict[str, str]
    distill_run: str | None
    distill_metrics: dict[str, float]
    eval_metrics: dict[str, float]
    bench_metrics: dict[str, float]


def _run_metrics(client, run_id: str | None) -> dict[str, float]:
    from mlflow.exceptions import MlflowException

    if not run_id:
        return {}
    try:
        return dict(client.get_run(run_id).data.metrics)
    except MlflowException:  # a deleted run
        return {}


def version_records(client, name: str) -> list[VersionRecord]:
    """Every version of registered model `name` as `client` (an MlflowClient) sees it; none when the store does not
    hold the model (or cannot be read)."""
    from mlflow.exceptions import MlflowException

    try:
        aliases: dict[str, list[str]] = {}
        for alias, version in client.get_registered_model(name).aliases.items():
            aliases.setdefault(str(version), []).append(alias)
        records = []
        for v in client.search_model_versions(f"name = '{name}'"):
            tags = dict(v.tags or {})
            distill_run = tags.get(M.DISTILL_RUN_TAG) or v.run_id
            records.append(VersionRecord(
                version=str(v.version), aliases=sorted(aliases.get(str(v.version), [])),
                created_ms=v.creation_timestamp, tags=tags, distill_run=distill_run,
                distill_metrics=_run_metrics(client, distill_run),
                eval_metrics=_run_metrics(client, tags.get(M.LATEST_EVAL_RUN_TAG)),
                bench_metrics=_run_metrics(client, tags.get(M.LATEST_BENCH_RUN_TAG))))
        return records
    except MlflowException:
        return []
