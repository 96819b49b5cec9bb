import numpy as np
import pytest

from monitor.stats.acceptance_tests import PromptAcceptance
from monitor.stats.false_alarms import BetaBinomialTraffic, power_figure, simulate_checks, thin
from pipeline.config import MonitorConfig

DEFAULT = MonitorConfig()
N_CHECKS = 200
# Monte-Carlo slack: 3 binomial standard errors of a rate `level` estimated from N_CHECKS checks
SLACK = 3 * np.sqrt(DEFAULT.level * (1 - DEFAULT.level) / N_CHECKS)


@pytest.fixture(scope="module")
def default_result():
    """The check as configured by default (its test method included), at fewer bootstrap resamples."""
    return simulate_checks(DEFAULT.heldout_requests, DEFAULT.level, DEFAULT.margin, drops=(0.02, 0.05, 0.10),
                           n_checks=N_CHECKS, method=DEFAULT.test_method, n_bootstrap=400, seed=1)


def test_false_alarms_at_most_level(default_result):
    assert default_result.n_checks >= 200
    assert default_result.false_alarm_rate <= DEFAULT.level + SLACK


def test_power_against_five_point_drop_at_default_n(default_result):
    assert default_result.power[0.05] >= 0.9
    assert default_result.power[0.10] == 1.0
    assert default_result.power[0.02] < default_result.power[0.05]


def test_naive_token_ztest_alarms_far_above_nominal(default_result):
    assert default_result.naive_false_alarm_rate > 2 * DEFAULT.level
    assert default_result.naive_false_alarm_rate > 5 * default_result.false_alarm_rate


def test_bootstrap_false_alarms_on_resampled_real_pairs():
    # a pool of per-prompt (accepted, drafted) pairs standing in for held-out measurements
    rng = np.random.default_rng(5)
    alpha, drafted = BetaBinomialTraffic().draw_prompts(rng, 400)
    pairs = list(zip(rng.binomial(drafted, alpha), drafted))
    res = simulate_checks(128, DEFAULT.level, margin=0.0, drops=(0.10,), n_checks=200, pairs=pairs,
                          method="bootstrap", n_bootstrap=400, seed=2)
    assert res.source == "pairs"
    assert res.false_alarm_rate <= DEFAULT.level + SLACK
    assert res.power[0.10] >= 0.9
    assert res.naive_false_alarm_rate > 3 * DEFAULT.level


def test_thinning_lowers_acceptance_by_the_drop():
    rng = np.random.default_rng(0)
    values = PromptAcceptance.of(np.full(2000, 60), np.full(2000, 100))
    assert thin(rng, values, 0.1).acceptance == pytest.approx(0.5, abs=0.005)
    assert thin(rng, values, 0.0) is values


def test_power_figure(default_result):
    fig = power_figure(default_result)
    line = fig.axes[0].lines[0]
    np.testing.assert_allclose(line.get_xdata(), [0, 2, 5, 10])
    assert line.get_ydata()[0] == default_result.false_alarm_rate


def test_simulate_command_writes_json_and_plot(tmp_path, capsys):
    import json

    from pipeline.cli import main

    pairs = tmp_path / "pairs.json"
    pairs.write_text(json.dumps({"accepted": [30, 50, 20, 64, 41, 12], "drafted": [64, 64, 32, 64, 64, 48]}))
    code = main(["monitor", "simulate", "--pairs", str(pairs), "--n", "32", "--checks", "20", "--out",
                 str(tmp_path / "sim"), "--json", "monitor.test_method=delta"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["source"] == "pairs" and result["n_checks"] == 20 and result["n_prompts"] == 32
    assert set(result["power"]) == {"0.02", "0.05", "0.1"}
    assert json.loads((tmp_path / "sim" / "simulation.json").read_text()) == result
    assert (tmp_path / "sim" / "power.png").stat().st_size > 1000
