"""Links from registered draft versions to the runs that measured them (so a version page explains itself)."""
from __future__ import annotations

REGISTRY_PREFIX = "models:/"


def registered_version(source: str) -> tuple[str, str] | None:
    """(name, version) behind `models:/NAME@ALIAS` or `models:/NAME/VERSION`; None for any other source."""
    from mlflow import MlflowClient

    if not source.startswith(REGISTRY_PREFIX):
        return None
    spec = source[len(REGISTRY_PREFIX):].rstrip("/")
    if "@" in spec:
        name, alias = spec.split("@", 1)
        return name, str(MlflowClient().get_model_version_by_alias(name, alias).version)
    name, _, version = spec.rpartition("/")
    return (name, version) if name else None


def link_run(source: str, tag: str, run_id: str) -> tuple[str, str] | None:
    """Tag the version behind a registry source with `tag = run_id`, and the run with the version it measured."""
    from mlflow import MlflowClient

    found = registered_version(source)
    if found is None:
        return None
    name, version = found
    client = MlflowClient()
    client.set_model_version_tag(name, version, tag, run_id)
    client.set_tag(run_id, "draftops.draft_version", f"{name}/{version}")
    return found
