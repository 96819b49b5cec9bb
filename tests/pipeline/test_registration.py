"""Registration against a real (sqlite) MLflow store: a distill job is registered once, whatever cut it short."""
import mlflow
from mlflow import MlflowClient

from pipeline import metrics as M
from pipeline import registry

NAME = "drafts"


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
