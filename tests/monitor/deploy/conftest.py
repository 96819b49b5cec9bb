"""The deploy tests' world: two registered tiny drafts and a config that deploys them."""
import pytest

from pipeline.config import load_config
from tests.monitor.check.test_run import write_traffic
from tests.monitor.deploy_world import register_tiny_draft, write_config


@pytest.fixture
def world(tmp_path, mlflow_uri):
    """Versions 1 (champion) and 2 of tiny drafts, and a config deploying them as hf with the recording reload."""
    traffic = tmp_path / "traffic.jsonl"
    write_traffic(traffic, 0, 40)
    assert register_tiny_draft(tmp_path, seed=1) == "1"
    assert register_tiny_draft(tmp_path, seed=2) == "2"
    cfg = load_config(write_config(tmp_path, mlflow_uri, traffic))
    return cfg, tmp_path
