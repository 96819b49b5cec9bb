"""The MLflow model registry of draft versions: its URIs, registration, the champion's aliases, baselines and links.

A registered model holds the distilled drafts as versions. Aliases, not stages (deprecated in MLflow 3), say which
version does what: `champion` serves, `challenger` is a new distillation waiting for the monitor's gate,
`previous-champion` is where a rollback goes (names and tags in `pipeline.metrics`). A version is addressed as
`models:/NAME@ALIAS` or `models:/NAME/VERSION`; `pipeline.sources` resolves both to a local checkpoint.

A version's tags link it to its runs: the distill run that made it, its latest eval and bench (`link_run`), and the
monitor run whose artifact holds its baseline (per-prompt acceptance on held-out prompts, stored and loaded here as
the JSON payload that `monitor.check.prompt_acceptance.Baseline` writes).

mlflow is imported inside the functions that talk to the store: `draftops` imports this module while building its
command line (through `monitor.registry_report`), and `draftops models info` on a local path must not pay for mlflow.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pipeline import metrics as M
from pipeline.locks import DEFAULT_WAIT, model_lock
from pipeline.registry_records import VersionRecord as VersionRecord  # re-exported: `draftops report` reads them
from pipeline.registry_records import version_records as version_records

REGISTRY_PREFIX = "models:/"
BASELINE_ARTIFACT = "monitor/baseline.json"
_URI_FORMS = f"{REGISTRY_PREFIX}NAME@ALIAS or {REGISTRY_PREFIX}NAME/VERSION"


MODEL_DESCRIPTION = "Speculative-decoding drafts managed by draftops."
MISSING = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")  # MLflow's error codes for what the store lacks
LARGEST_VERSION = 2**63 - 1  # a version number the store can hold (SQLite's integers)


class RegistryError(RuntimeError):
    """The registry cannot do what was asked: a malformed `models:/` URI, a version it does not hold, no champion,
    nothing to roll back to."""


# --------------------------------------------------------------------------- URIs


@dataclass(frozen=True)
class RegistryURI:
    """`models:/NAME@ALIAS` (alias set) or `models:/NAME/VERSION` (version set)."""

    name: str
    alias: str | None = None
    version: str | None = None


def is_registry_uri(source: str) -> bool:
    return source.startswith(REGISTRY_PREFIX)


def alias_uri(name: str, alias: str) -> str:
    return f"{REGISTRY_PREFIX}{name}@{alias}"


def version_uri(name: str, version: str) -> str:
    return f"{REGISTRY_PREFIX}{name}/{version}"


def parse_uri(source: str) -> RegistryURI:
    """The name and alias, or name and version number, of a registry URI; RegistryError for anything else."""
    if not is_registry_uri(source):
        raise RegistryError(f"{source}: not a registry URI ({_URI_FORMS})")
    spec = source[len(REGISTRY_PREFIX):]
    if not spec:
        raise RegistryError(f"{source}: no model name ({_URI_FORMS})")
    if "@" in spec:
        name, alias = spec.split("@", 1)
        if not name or not alias:
            raise RegistryError(f"{source}: {'no model name' if not name else 'no alias'} ({_URI_FORMS})")
        return RegistryURI(name, alias=alias)
    name, _, version = spec.rpartition("/")
    if not name:
        raise RegistryError(f"{source}: neither an alias nor a version ({_URI_FORMS})")
    if not version.isdigit():
        raise RegistryError(f"{source}: version '{version}' is not a number ({_URI_FORMS})")
    return RegistryURI(name, version=version)


# --------------------------------------------------------------------------- versions


@dataclass(frozen=True)
class RegisteredVersion:
    name: str
    version: str  # MLflow returns versions as int or str depending on the call; always str here
    tags: dict[str, str]
    artifact_uri: str  # where its files are: the registering run's artifact folder

    @classmethod
    def of(cls, model_version) -> RegisteredVersion:
        """From an MLflow ModelVersion."""
        return cls(model_version.name, str(model_version.version), dict(model_version.tags or {}),
                   model_version.source)


def _client():
    from mlflow import MlflowClient

    return MlflowClient()


def store_uri() -> str:
    """The tracking store the registry calls go to."""
    import mlflow

    return mlflow.get_tracking_uri()


def find_version(source: str) -> RegisteredVersion:
    """The version a registry URI points at; RegistryError for a malformed URI or one the store does not hold."""
    from mlflow.exceptions import MlflowException

    uri = parse_uri(source)
    if uri.version is not None and int(uri.version) > LARGEST_VERSION:
        raise RegistryError(f"{source}: not in the MLflow registry at {store_uri()}: no version {uri.version}")
    client = _client()
    try:
        if uri.alias is not None:
            found = client.get_model_version_by_alias(uri.name, uri.alias)
        else:
            found = client.get_model_version(uri.name, uri.version)
    except MlflowException as exc:
        if exc.error_code not in MISSING:  # a store that failed (a timeout) is not a version it lacks
            raise
        raise RegistryError(f"{source}: not in the MLflow registry at {store_uri()}: {exc.message}") from None
    return RegisteredVersion.of(found)


def version_by_alias(name: str, alias: str) -> RegisteredVersion | None:
    """The version behind NAME@alias, or None when the model or the alias does not exist. Any other failure (a store
    that cannot be reached) is raised, not mistaken for a missing alias."""
    from mlflow.exceptions import MlflowException

    try:
        found = _client().get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if exc.error_code in MISSING:
            return None
        raise
    return RegisteredVersion.of(found)


def champion(name: str) -> RegisteredVersion:
    version = version_by_alias(name, M.CHAMPION)
    if version is None:
        raise RegistryError(f"registered model '{name}' has no '{M.CHAMPION}' alias; run `draftops distill` first")
    return version


def version_numbers(name: str) -> list[str]:
    """Every version of registered model `name`, oldest first."""
    return sorted((str(v.version) for v in _client().search_model_versions(f"name='{name}'")), key=int)


def model_tags(name: str) -> dict[str, str] | None:
    """The tags of registered model `name`, or None if there is no such model."""
    from mlflow.exceptions import MlflowException

    try:
        return dict(_client().get_registered_model(name).tags or {})
    except MlflowException as exc:
        if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
            return None
        raise


def create_model(name: str, *, tags: dict[str, str]) -> None:
    """Create registered model `name` with `tags` (registration then adds versions to it)."""
    _client().create_registered_model(name, tags=tags, description=MODEL_DESCRIPTION)


def delete_model(name: str) -> bool:
    """Delete registered model `name` with its versions (their runs stay); True if there was one."""
    from mlflow.exceptions import MlflowException

    client = _client()
    try:
        client.get_registered_model(name)
    except MlflowException:
        return False
    client.delete_registered_model(name)
    return True

# --------------------------------------------------------------------------- registration and links


def register(checkpoint_dir: str | Path, model_name: str, *, tags: dict[str, str], description: str,
             job: str | None = None, artifact_path: str = "draft", alias: str | None = None,
             lock_timeout: float = DEFAULT_WAIT):
    """Log a checkpoint directory to the active run and register it as a new version of `model_name`.

    The version's source is the run's artifact folder, so `models:/NAME@ALIAS` resolves to the plain HF checkpoint.
    The first version of a model becomes `champion`; later ones `challenger` until the monitor's gate promotes them,
    or, given `alias` (a draft-size family's `layers-N`), that alias, moved from any older version holding it.
    With `job` (a distill job's key, kept in the version's tags) registration is idempotent: a version of that job
    is returned as it is, or given its alias if a kill cut its registration short, and never registered twice.
    It waits up to `lock_timeout` seconds for the model's lock (a check, with its retraining, holds it), then gives
    up with `ModelBusy`: the draft stays in its job folder for `draftops distill --register-only`.
    Returns (the MLflow ModelVersion, its alias).
    """
    import mlflow
    from mlflow.exceptions import MlflowException

    run = mlflow.active_run()
    if run is None:
        raise RuntimeError("register needs an active MLflow run")
    client = _client()
    # waits for a check or a rollback, within a bound: the finished work is not lost either way
    with model_lock(model_name, store_uri(), timeout=lock_timeout,
                    then=f"; the draft stays in {checkpoint_dir}: register it later with `draftops distill "
                         "--register-only`"):
        try:
            client.get_registered_model(model_name)
        except MlflowException:
            client.create_registered_model(model_name, description=MODEL_DESCRIPTION)
        version = _version_of_job(client, model_name, job) if job else None
        if version is None:
            mlflow.log_artifacts(str(checkpoint_dir), artifact_path)
            job_tag = {M.DISTILL_JOB_TAG: job} if job else {}
            version = client.create_model_version(
                model_name, source=f"{run.info.artifact_uri}/{artifact_path}", run_id=run.info.run_id,
                tags={**{k: str(v) for k, v in tags.items()}, **job_tag}, description=description)
        has_champion = M.CHAMPION in client.get_registered_model(model_name).aliases
        if alias is not None:
            client.set_registered_model_alias(model_name, alias, version.version)
            if not has_champion:  # a model always has a champion to serve
                client.set_registered_model_alias(model_name, M.CHAMPION, version.version)
        else:
            alias = next(iter(version.aliases), None)
            if alias is None:
                alias = M.CHALLENGER if has_champion else M.CHAMPION
                client.set_registered_model_alias(model_name, alias, version.version)
    mlflow.set_tag(M.REGISTERED_VERSION_TAG, f"{model_name}/{version.version}")
    return version, alias


def set_alias(name: str, alias: str, version: str, lock_timeout: float = DEFAULT_WAIT) -> None:
    """Point `alias` of model `name` at `version` (an already registered one), under the model's lock (waited for
    up to `lock_timeout` seconds)."""
    with model_lock(name, store_uri(), timeout=lock_timeout):
        _client().set_registered_model_alias(name, alias, str(version))


def version_of_job(model_name: str, job: str):
    """The version of `model_name` registered for distill job `job` in the current registry, or None."""
    return _version_of_job(_client(), model_name, job)


def _version_of_job(client, model_name: str, job: str):
    """The version registered for distill job `job`, with its aliases, or None."""
    for found in client.search_model_versions(f"name='{model_name}'"):
        if found.tags.get(M.DISTILL_JOB_TAG) == job:
            return client.get_model_version(model_name, found.version)
    return None


def link_run(source: str, tag: str, run_id: str) -> tuple[str, str] | None:
    """Tag the version behind a registry source with `tag = run_id`, and the run with the version it measured
    (so a version page explains itself). None, and nothing tagged, for a source outside the registry."""
    if not is_registry_uri(source):
        return None
    found = find_version(source)
    client = _client()
    client.set_model_version_tag(found.name, found.version, tag, run_id)
    client.set_tag(run_id, M.DRAFT_VERSION_TAG, f"{found.name}/{found.version}")
    return found.name, found.version


# --------------------------------------------------------------------------- baselines and break-even


def save_baseline(name: str, version: str, payload: dict) -> None:
    """Log a baseline's JSON payload into the active (monitor) run and point the version at it."""
    import mlflow

    run = mlflow.active_run()
    if run is None:
        raise RuntimeError("save_baseline needs an active MLflow run")
    mlflow.log_dict(payload, BASELINE_ARTIFACT)
    _client().set_model_version_tag(name, version, M.BASELINE_RUN_TAG, run.info.run_id)


def load_baseline(model_version) -> dict | None:
    """The baseline payload of a version (anything with `.tags`), or None when none was recorded."""
    import mlflow

    run_id = model_version.tags.get(M.BASELINE_RUN_TAG)
    if not run_id:
        return None
    return mlflow.artifacts.load_dict(f"runs:/{run_id}/{BASELINE_ARTIFACT}")


def stored_baseline(name: str, version: str) -> dict | None:
    """The baseline payload of version `version` of `name`; None when it has none, or the registry lacks it."""
    try:
        return load_baseline(find_version(version_uri(name, version)))
    except RegistryError:
        return None


def break_even(model_version, default: float | None) -> tuple[float | None, str]:
    """The version's measured break-even acceptance (its latest `draftops bench`), else `default` from the config
    (None: no break-even, and no absolute alarm)."""
    run_id = model_version.tags.get(M.LATEST_BENCH_RUN_TAG)
    if run_id:
        measured = _client().get_run(run_id).data.metrics.get(M.BREAK_EVEN_ALPHA)
        if measured is not None:
            return float(measured), f"bench run {run_id}"
    if default is None:
        return None, "none: no `draftops bench` of this version (make bench) and monitor.break_even_alpha unset"
    return default, "monitor.break_even_alpha"


# --------------------------------------------------------------------------- moving the champion


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def promote(name: str, version: str, lock_timeout: float = DEFAULT_WAIT) -> str | None:
    """Make `version` the champion; the old champion becomes previous-champion. Returns the old champion. Under the
    model's lock (the check that decided it holds it already; anyone else waits up to `lock_timeout` seconds)."""
    client = _client()
    with model_lock(name, store_uri(), timeout=lock_timeout):
        old = version_by_alias(name, M.CHAMPION)
        if old is not None and old.version == str(version):
            return None
        # In this order a kill between two calls leaves the old champion serving (a version without an alias is
        # found again by its distill job) or the new one, never a challenger alias on the champion.
        if old is not None:
            client.set_registered_model_alias(name, M.PREVIOUS_CHAMPION, old.version)
        challenger = version_by_alias(name, M.CHALLENGER)
        if challenger is not None and challenger.version == str(version):
            client.delete_registered_model_alias(name, M.CHALLENGER)
        client.set_registered_model_alias(name, M.CHAMPION, str(version))
        client.set_model_version_tag(name, str(version), M.PROMOTED_AT_TAG, _now())
    return old.version if old is not None else None


def rollback(name: str, to_version: str | None = None) -> str:
    """Point champion back at previous-champion (or `to_version`); the two aliases swap. Returns the new champion.
    A version that holds `challenger` loses that alias as it becomes champion (a champion is never also the
    challenger the gate would measure against it). Refused (`ModelBusy`) while another process holds the model's
    lock: a rollback never races a promotion. RegistryError for a version that is not a number or not registered."""
    from mlflow.exceptions import MlflowException

    if to_version is not None and not str(to_version).isdigit():
        raise RegistryError(f"--to-version {to_version!r}: a version is a number (see `draftops report`)")
    client = _client()
    with model_lock(name, store_uri(), timeout=0):
        current = champion(name)
        if to_version is None:
            previous = version_by_alias(name, M.PREVIOUS_CHAMPION)
            if previous is None:
                raise RegistryError(f"registered model '{name}' has no '{M.PREVIOUS_CHAMPION}' alias to roll back to")
            to_version = previous.version
        to_version = str(int(to_version))
        if int(to_version) > LARGEST_VERSION:
            raise RegistryError(f"registered model '{name}' has no version {to_version} (versions: "
                                f"{', '.join(version_numbers(name)) or 'none'})")
        try:
            client.get_model_version(name, to_version)
        except MlflowException as exc:
            if exc.error_code not in MISSING:
                raise
            raise RegistryError(f"registered model '{name}' has no version {to_version} (versions: "
                                f"{', '.join(version_numbers(name)) or 'none'})") from None
        if to_version == current.version:
            return to_version
        # In this order a kill between two calls leaves the old champion serving, or the new one without a
        # challenger alias: never champion and challenger on one version.
        challenger = version_by_alias(name, M.CHALLENGER)
        if challenger is not None and challenger.version == to_version:
            client.delete_registered_model_alias(name, M.CHALLENGER)
        client.set_registered_model_alias(name, M.CHAMPION, to_version)
        client.set_registered_model_alias(name, M.PREVIOUS_CHAMPION, current.version)
        client.set_model_version_tag(name, current.version, M.ROLLED_BACK_AT_TAG, _now())
    return to_version
