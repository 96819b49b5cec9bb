"""pipeline.registry without a store: the one parser of `models:/` URIs, and mlflow kept out of light imports; and
registration against a real (sqlite) MLflow store: a distill job is registered once, whatever cut it short."""
import re
import subprocess
import sys
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from pipeline import metrics as M
from pipeline import registry
from pipeline.registry import RegistryError, RegistryURI, parse_uri
from pipeline.sources import SourceError, locate

REPO = Path(__file__).resolve().parents[2]
NAME = "drafts"


@pytest.mark.parametrize("source, expected", [
    ("models:/draftops-draft@champion", RegistryURI("draftops-draft", alias="champion")),
    ("models:/draftops-draft@previous-champion", RegistryURI("draftops-draft", alias="previous-champion")),
    ("models:/draftops-draft/12", RegistryURI("draftops-draft", version="12")),
    ("models:/team/draft/3", RegistryURI("team/draft", version="3")),  # the version follows the last slash
])
def test_registry_uris_parse_to_name_and_alias_or_version(source, expected):
    assert parse_uri(source) == expected


@pytest.mark.parametrize("source, reason", [
    ("models:/", "no model name"),
    ("models:/@champion", "no model name"),
    ("models:/draft", "neither an alias nor a version"),
    ("models:/draft@", "no alias"),
    ("models:/draft/", "version '' is not a number"),
    ("models:/draft/notanumber", "version 'notanumber' is not a number"),
    ("models:/draft/latest", "version 'latest' is not a number"),
    ("runs:/0123abcd/draft", "not a registry URI"),
    ("/checkpoints/draft", "not a registry URI"),
])
def test_malformed_registry_uris_are_refused_with_the_reason(source, reason):
    forms = "(models:/NAME@ALIAS or models:/NAME/VERSION)"
    with pytest.raises(RegistryError, match=re.escape(f"{source}: {reason} {forms}")):
        parse_uri(source)


def test_built_uris_parse_back():
    assert registry.alias_uri("draft", "champion") == "models:/draft@champion"
    assert registry.version_uri("draft", "7") == "models:/draft/7"
    assert parse_uri(registry.version_uri("draft", "7")) == RegistryURI("draft", version="7")


def test_a_malformed_uri_is_a_source_error_before_any_store_is_asked():
    with pytest.raises(SourceError, match="models:/draft/x: version 'x' is not a number"):
        locate("models:/draft/x")


def test_link_run_leaves_sources_outside_the_registry_alone():
    assert registry.link_run("/checkpoints/draft", "draftops.latest_eval_run", "0123abcd") is None


def test_the_command_line_modules_do_not_import_mlflow():
    """`draftops` imports monitor.registry_report to build its parser and pipeline.sources for `models info`: neither
    may pull mlflow (seconds) in through the registry."""
    code = "import sys, monitor.registry_report, pipeline.sources; print('mlflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def register(checkpoint, job=None):
    mlflow.set_experiment("registration")  # fluent mlflow remembers the experiment id of an earlier test's store
    with mlflow.start_run():
        version, alias = registry.register(checkpoint, NAME, tags={"kind": "test"}, description="d", job=job)
    return str(version.version), alias


def test_a_job_is_registered_once_and_later_jobs_are_challengers(mlflow_uri, tiny_checkpoint):
    assert register(tiny_checkpoint, job="job-a") == ("1", M.CHAMPION)
    assert register(tiny_checkpoint, job="job-a") == ("1", M.CHAMPION)  # a re-run of the same job
    assert register(tiny_checkpoint, job="job-b") == ("2", M.CHALLENGER)
    assert register(tiny_checkpoint) == ("3", M.CHALLENGER)  # without a job key every call registers
    assert registry.version_numbers(NAME) == ["1", "2", "3"]
    assert MlflowClient().get_model_version(NAME, "2").tags[M.DISTILL_JOB_TAG] == "job-b"


def test_a_registration_killed_before_its_alias_is_completed_not_repeated(mlflow_uri, tiny_checkpoint):
    register(tiny_checkpoint, job="job-a")
    client = MlflowClient()
    with mlflow.start_run() as run:  # what a kill leaves: a version of job-b, no alias yet
        client.create_model_version(NAME, source=f"{run.info.artifact_uri}/draft", run_id=run.info.run_id,
                                    tags={M.DISTILL_JOB_TAG: "job-b"})
    assert register(tiny_checkpoint, job="job-b") == ("2", M.CHALLENGER)
    assert registry.version_numbers(NAME) == ["1", "2"]
    assert client.get_registered_model(NAME).aliases == {M.CHAMPION: 1, M.CHALLENGER: 2}


def test_a_size_alias_replaces_challenger_and_moves_to_the_newest_version_of_that_size(mlflow_uri, tiny_checkpoint):
    def register_as(job, alias):
        mlflow.set_experiment("registration")
        with mlflow.start_run():
            version, given = registry.register(tiny_checkpoint, NAME, tags={}, description="d", job=job, alias=alias)
        return str(version.version), given

    # on an empty model the first member is also the champion: a model always has one to serve
    assert register_as("one-layer", M.size_alias(1)) == ("1", "layers-1")
    assert register_as("two-layers", M.size_alias(2)) == ("2", "layers-2")
    assert register_as("one-layer-again", M.size_alias(1)) == ("3", "layers-1")
    assert register_as("two-layers", M.size_alias(2)) == ("2", "layers-2")  # a re-run registers nothing twice
    assert MlflowClient().get_registered_model(NAME).aliases == {M.CHAMPION: 1, "layers-1": 3, "layers-2": 2}
