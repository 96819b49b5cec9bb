import shutil

import pytest


@pytest.fixture(scope="session")
def _migrated_mlflow_db(tmp_path_factory):
    """Creating MLflow's sqlite schema takes seconds; do it once and copy the file per test."""
    from mlflow import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture
def mlflow_uri(tmp_path, _migrated_mlflow_db, monkeypatch):
    """A fresh sqlite MLflow store for this test (tracking and registry)."""
    import mlflow

    path = tmp_path / "mlflow.db"
    shutil.copy(_migrated_mlflow_db, path)
    uri = f"sqlite:///{path}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri
