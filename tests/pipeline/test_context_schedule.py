"""pipeline.context_schedule: one schedule by context length for γ and the tree's node budget, checked at load."""
import pytest

from pipeline.config import ConfigError, load_config
from pipeline.context_schedule import ContextSchedule


def test_the_value_of_the_first_entry_covering_the_length_and_the_last_beyond():
    schedule = ContextSchedule.parse([(16, 4), (64, 2)])
    assert [schedule.at(n) for n in (1, 16, 17, 64, 65, 1000)] == [4, 4, 2, 2, 2, 2]
    assert schedule.largest() == 4 and schedule.as_lists() == [[16, 4], [64, 2]]


@pytest.mark.parametrize("bad", [[], [(16, 0)], [(64, 2), (16, 4)], [(16, 2), (16, 3)], [("x", 2)], [(0, 2)]])
def test_a_bad_schedule_is_refused_naming_its_key(bad):
    with pytest.raises(ValueError, match="^decode.gamma_schedule must be"):
        ContextSchedule.parse(bad, "decode.gamma_schedule")


@pytest.mark.parametrize("key", ["decode.gamma_schedule", "decode.tree_budget_schedule"])
def test_a_bad_schedule_in_the_default_config_is_refused_when_it_loads(key):
    policy = ["decode.gamma_policy=schedule"] if key == "decode.gamma_schedule" else []
    with pytest.raises(ConfigError) as err:
        load_config("configs/default.yaml", [*policy, f"{key}=[[512, 4], [128, 2]]"])
    assert key in str(err.value) and "increasing max_context" in str(err.value)
    assert "\n" not in str(err.value).strip()
    loaded = load_config("configs/default.yaml", [*policy, f"{key}=[[128, 4], [512, 2]]"])
    assert getattr(loaded.decode, key.split(".")[1]) == [(128, 4), (512, 2)]
