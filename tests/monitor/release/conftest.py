"""The deploy tests' world: two registered tiny drafts and a config that deploys them."""
import pytest

from tests.monitor.deploy_world import two_drafts_world


@pytest.fixture
def world(tmp_path, mlflow_uri):
    """Versions 1 (champion) and 2 of tiny drafts, and a config deploying them as hf with the recording reload."""
    return two_drafts_world(tmp_path, mlflow_uri)
